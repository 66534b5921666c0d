"""Batched inverse-CDF sampling: one uniform per row in, one token and its interval out.

Given processed logits q (see :mod:`qmc_sampler.processing`) and u ∈ [0, 1), the
token is the first j in the chosen vocabulary order with F(j) > u
(``../shared/design/qmc-math.md`` §1). The CDF is accumulated in float64 and every
entry from the last token of positive probability onwards is forced to exactly
1.0, so every u ∈ [0, 1) lands on a token of positive probability. The interval
``[start, start + prob)`` that contains u is returned for the residual carry.

Orders: ``"id"`` (token-id order; no sort) and ``"sorted"`` (descending
probability, ties by token id).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ORDERS", "Draw", "inverse_cdf", "reject_bad_rows"]

ORDERS: tuple[str, ...] = ("id", "sorted")


@dataclass(frozen=True)
class Draw:
    """The result of :func:`inverse_cdf` for a batch.

    Attributes:
        tokens: ``[batch] int64`` chosen token ids.
        starts: ``[batch] float64`` F(token⁻), the CDF just below the token.
        probs: ``[batch] float64`` the width of the token's CDF interval (its
            processed probability, as the CDF saw it).
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    probs: torch.Tensor


def inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor, order: str = "id", check: bool = True) -> Draw:
    """Pick, per row, the token whose CDF interval contains the row's uniform.

    Args:
        logits: ``[batch, vocab]`` processed logits (``-inf`` = excluded).
        uniforms: ``[batch]`` float64 in [0, 1), on any device.
        order: ``"id"`` or ``"sorted"`` (see module docstring).
        check: raise for a bad row (a host round trip); False: its token is -1 instead.

    Returns:
        :class:`Draw` with tensors on ``logits.device``.

    Raises:
        ValueError: a row contains NaN or has no token of positive probability (``check``).
    """
    rows = logits.to(torch.float64)
    top = rows.amax(dim=-1, keepdim=True)
    bad = ~torch.isfinite(top.squeeze(1)) | torch.isnan(rows).any(dim=-1)
    if check:
        reject_bad_rows(bad)
    else:  # stand-ins, so the row's arithmetic stays finite; its token becomes -1 below
        rows = torch.where(bad.unsqueeze(1), 0.0, rows)
        top = torch.where(bad.unsqueeze(1), 0.0, top)
    weights = torch.exp(rows - top)
    perm = None
    if order == "sorted":
        # Descending weight, ties by token id: a stable sort of the negated weights.
        weights, perm = torch.sort(-weights, dim=-1, stable=True)
        weights = -weights
    elif order != "id":
        raise ValueError(f"order={order!r} is not a vocabulary order; use one of {set(ORDERS)}")
    cdf = torch.cumsum(weights, dim=-1)
    cdf = cdf / cdf[:, -1:]
    vocab = cdf.shape[1]
    positions = torch.arange(vocab, device=cdf.device)
    last_positive = vocab - 1 - torch.argmax(torch.flip(weights > 0, dims=[1]).to(torch.int8), dim=-1)
    cdf = cdf.masked_fill(positions.unsqueeze(0) >= last_positive.unsqueeze(1), 1.0)
    u = uniforms.to(device=cdf.device, dtype=torch.float64).unsqueeze(1)
    pos = torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1)
    ends = cdf.gather(1, pos).squeeze(1)
    starts = torch.where(pos.squeeze(1) > 0, cdf.gather(1, (pos - 1).clamp_(min=0)).squeeze(1), 0.0)
    tokens = pos.squeeze(1) if perm is None else perm.gather(1, pos).squeeze(1)
    tokens = tokens.to(torch.int64) if check else torch.where(bad, -1, tokens.to(torch.int64))
    return Draw(tokens=tokens, starts=starts, probs=ends - starts)


def reject_bad_rows(bad: torch.Tensor) -> None:
    """Raise for the first row flagged in ``bad`` (``[batch] bool``): NaN, or no admissible token.

    Raises:
        ValueError: naming the row; every backend reports bad rows with this message.
    """
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"logits row {row} has NaN or no admissible token (all -inf after "
            "temperature/top-k/top-p/min-p); every row needs a finite maximum"
        )
