"""The processed next-token distribution, exactly as vLLM's V1 sampler defines it.

Pipeline, in vLLM's order (``vllm/v1/sample/sampler.py::Sampler.sample``):

1. temperature: ``logits / T`` (``Sampler.apply_temperature``);
2. min-p: mask tokens whose softmax probability is below ``min_p · max prob``
   (``vllm/v1/sample/logits_processor/builtin.py::MinPLogitsProcessor.apply``);
3. top-k: mask logits strictly below the k-th largest (ties at the boundary are kept)
   (``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch``), the k-th
   largest from ``torch.topk`` (a selection, no sort);
4. top-p: on the top-k-masked, ascending-sorted row, mask tokens whose cumulative
   probability is ``<= 1 - p``, always keeping the largest — found without sorting
   (a radix search on the logit value's bits, :func:`_top_p_by_search`);
5. softmax. (The CDF, choice and carry follow in :mod:`qmc_sampler.inverse_cdf`
   and :mod:`qmc_sampler.carry`.)

Temperature and min-p are computed in float32 like vLLM's, top-p's masses in float64;
the surviving logits are what the inverse CDF turns into float64 probabilities. Ties
at the top-p cut are broken by token id as a stable ascending sort orders them (larger
ids kept first), which vLLM leaves to its unstable sort.
"""

from __future__ import annotations

import torch

__all__ = ["SAMPLING_EPS", "filters_active", "ordered_keys", "process_logits"]

#: vLLM's greedy threshold (``vllm/v1/sample/sampler.py::_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p (vLLM semantics) to a batch of rows.

    Args:
        logits: ``[batch, vocab]`` float logits; not modified.
        temperature: ``[batch]`` float, every entry ``>= SAMPLING_EPS``.
        top_k: ``[batch]`` int, ``0`` (or ``>= vocab``) disables; None for no row.
        top_p: ``[batch]`` float in (0, 1], ``1`` disables; None for no row.
        min_p: ``[batch]`` float in [0, 1], ``0`` disables; None for no row.

    Returns:
        ``[batch, vocab]`` float32 logits with excluded tokens set to ``-inf``.
    """
    out = logits.to(torch.float32) / temperature.to(device=logits.device, dtype=torch.float32).unsqueeze(1)
    vocab = out.shape[1]
    if min_p is not None and bool((min_p > 0).any()):
        probs = torch.softmax(out, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(out).unsqueeze(1)
        out = out.masked_fill(probs < threshold, float("-inf"))
    k_active, p_active = filters_active(top_k, top_p, vocab)
    if k_active:
        assert top_k is not None
        out = _top_k_by_selection(out, top_k)
    if p_active:
        assert top_p is not None
        out = _top_p_by_search(out, top_p)
    return out


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """``int64`` keys in the order of the float32 values of ``x`` (equal values, equal keys).

    The IEEE bit pattern is monotone for non-negative floats and reversed for negative
    ones; ``-0.0`` is first made ``+0.0`` (they compare equal).
    """
    bits = (x.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)


#: The top-p cut's 32-bit key is found a digit at a time, from the top (11 + 11 + 10 bits).
CUT_DIGIT_BITS = (11, 11, 10)


def _top_p_by_search(out: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p without a sort: the kept set of the ascending-sort rule, found by a radix search.

    In vLLM's rule a token survives when the probability of the tokens after it in
    ascending (logit, id) order is < p. So the cut is the logit x* whose tokens hold
    that boundary — mass(x > x*) < p·total <= mass(x >= x*). x* is found on the
    order-preserving 32-bit key of the float32 value (:func:`ordered_keys`, unsigned
    here) a digit at a time: each pass adds the weights of the tokens still in range into
    one bin per value of the next digit, and the cumulative mass from the top picks the
    digit (three passes over the row; no sort, no host round trip). Every token above x*
    is kept, and at x* the ties with the largest ids while the mass above them is still
    < p·total (the stable sort's order). Sums are in float64 over ``exp(x − max)``.
    """
    p = top_p.to(device=out.device, dtype=torch.float64).unsqueeze(1)
    bits = (out + 0.0).view(torch.int32)  # -0.0 made +0.0 first: they compare equal
    # ordered_keys in int32, then the sign bit flipped: the value's order as unsigned keys
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) ^ -(1 << 31)
    weights = torch.exp((out - out.amax(dim=-1, keepdim=True)).to(torch.float64))
    target = p * weights.sum(dim=-1, keepdim=True)
    batch = out.shape[0]
    found = torch.zeros(batch, 1, dtype=torch.int64, device=out.device)  # x*'s key digits so far
    above = torch.zeros_like(target)  # mass of the keys above found's range
    top = 0
    for width in CUT_DIGIT_BITS:
        digit = (keys >> (32 - top - width)) & ((1 << width) - 1)
        if top:  # tokens outside found's range go to a last bin, ignored
            in_range = ((keys >> (32 - top)) & ((1 << top) - 1)) == found
            digit = torch.where(in_range, digit, 1 << width)
        mass = torch.zeros(batch, (1 << width) + 1, dtype=torch.float64, device=out.device)
        mass.scatter_add_(1, digit.long(), weights)
        at_or_above = mass[:, : 1 << width].flip(-1).cumsum(-1).flip(-1) + above
        # the largest digit whose mass at or above it reaches the target (non-increasing sums)
        chosen = ((at_or_above >= target).sum(-1, keepdim=True) - 1).clamp(min=0)
        above = torch.cat([at_or_above[:, 1:], above], dim=1).gather(1, chosen)
        found = (found << width) | chosen
        top += width
    signed = keys ^ -(1 << 31)
    cut = found - (1 << 31)
    tie = signed == cut
    tie_weight = (weights * tie).amax(dim=-1, keepdim=True)
    # Ties kept from the largest id down: the i-th (i = 0, 1, …) while above + i·w < target.
    kept_ties = torch.ceil((target - above) / tie_weight)
    from_the_top = tie.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # ties at this id or after it
    keep = (signed > cut) | (tie & (from_the_top <= kept_ties))
    return out.masked_fill(~keep & (p < 1), float("-inf"))


def _top_k_by_selection(out: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k alone, without a sort: the k-th largest logit per row from ``torch.topk`` (over the
    largest k any row asks for), then the same mask as the sorted path (below it: ``-inf``;
    ties at the k-th value are kept)."""
    vocab = out.shape[1]
    k = top_k.to(dtype=torch.long)
    active = (k > 0) & (k < vocab)
    k_max = int(torch.where(active, k, 0).max())
    values = torch.topk(out, k_max, dim=-1, sorted=True).values
    k_dev = k.to(out.device).clamp(1, k_max)
    kth = values.gather(1, (k_dev - 1).unsqueeze(1))
    return out.masked_fill((out < kth) & active.to(out.device).unsqueeze(1), float("-inf"))


def filters_active(top_k: torch.Tensor | None, top_p: torch.Tensor | None, vocab: int) -> tuple[bool, bool]:
    """Whether any row asks for top-k (0 < k < vocab) and for top-p (p < 1)."""
    k_active = top_k is not None and bool(((top_k > 0) & (top_k < vocab)).any())
    p_active = top_p is not None and bool((top_p < 1.0).any())
    return k_active, p_active
