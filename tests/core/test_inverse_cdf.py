"""Inverse CDF: the token whose interval holds u; float64 CDF with its last entry 1.0."""

import pytest
import torch

from qmc_sampler import inverse_cdf


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log()


def test_picks_the_first_token_whose_cdf_exceeds_u():
    logits = logits_of([0.25, 0.5, 0.25])
    for u, token, start, prob in [
        (0.0, 0, 0.0, 0.25),
        (0.2499, 0, 0.0, 0.25),
        (0.25, 1, 0.25, 0.5),
        (0.9999, 2, 0.75, 0.25),
    ]:
        draw = inverse_cdf(logits, torch.tensor([u], dtype=torch.float64))
        assert draw.tokens.item() == token
        assert draw.starts.item() == pytest.approx(start)
        assert draw.probs.item() == pytest.approx(prob)


def test_zero_probability_tokens_are_never_chosen():
    logits = logits_of([0.0, 0.3, 0.0, 0.7, 0.0, 0.0])
    u = torch.tensor([0.0, 0.29999, 0.3, 1.0 - 2.0**-53], dtype=torch.float64)
    draw = inverse_cdf(logits.expand(4, -1), u)
    assert draw.tokens.tolist() == [1, 1, 3, 3]
    assert draw.probs.min().item() > 0


def test_u_just_below_one_lands_on_the_last_positive_token_despite_rounding():
    logits = torch.randn(64, 5000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[:, -100:] = float("-inf")
    draw = inverse_cdf(logits, torch.full((64,), 1.0 - 2.0**-53, dtype=torch.float64))
    assert (draw.tokens == 4899).all()


def test_sorted_order_walks_tokens_by_descending_probability_ties_by_id():
    logits = logits_of([0.2, 0.4, 0.2, 0.2])
    tokens = [
        inverse_cdf(logits, torch.tensor([u], dtype=torch.float64), order="sorted").tokens.item()
        for u in (0.1, 0.5, 0.7, 0.9)
    ]
    assert tokens == [1, 0, 2, 3]


def test_the_interval_contains_u():
    logits = torch.randn(100, 50, generator=torch.Generator().manual_seed(2))
    u = torch.rand(100, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for order in ("id", "sorted"):
        draw = inverse_cdf(logits, u, order=order)
        assert ((draw.starts <= u) & (u < draw.starts + draw.probs)).all()


def test_nan_logits_are_rejected():
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    with pytest.raises(ValueError, match="row 0 has NaN or no admissible token"):
        inverse_cdf(logits, torch.tensor([0.5], dtype=torch.float64))


def test_a_row_with_no_admissible_token_is_rejected():
    logits = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]])
    with pytest.raises(ValueError, match="row 1 has NaN or no admissible token"):
        inverse_cdf(logits, torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_unknown_order_names_the_allowed_orders():
    with pytest.raises(ValueError, match=r"order='random' is not a vocabulary order; use one of"):
        inverse_cdf(torch.zeros(1, 3), torch.tensor([0.5], dtype=torch.float64), order="random")
