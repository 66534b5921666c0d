"""The processed next-token distribution, exactly as vLLM's V1 sampler defines it.

Pipeline, in vLLM's order (``vllm/v1/sample/sampler.py::Sampler.sample``):

1. temperature: ``logits / T`` (``Sampler.apply_temperature``);
2. min-p: mask tokens whose softmax probability is below ``min_p · max prob``
   (``vllm/v1/sample/logits_processor/builtin.py::MinPLogitsProcessor.apply``);
3. top-k: mask logits strictly below the k-th largest (ties at the boundary are kept)
   (``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch``), the k-th
   largest without a sort: ``torch.topk`` on the CPU, a radix search elsewhere (no host read);
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

    Nothing is read back to the host for tensors on an accelerator: a filter whose tensor
    is given runs on every row (a row with it disabled is left as it is). On the CPU,
    where a read costs nothing, a filter that no row uses is skipped.

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
    on_cpu = out.device.type == "cpu"
    if min_p is not None and (not on_cpu or bool((min_p > 0).any())):
        probs = torch.softmax(out, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(out).unsqueeze(1)
        out = out.masked_fill(probs < threshold, float("-inf"))
    k_active, p_active = filters_active(top_k, top_p, vocab) if on_cpu else (top_k is not None, top_p is not None)
    if k_active:  # on the CPU a selection (torch.topk, its k read from the host) is the faster
        assert top_k is not None
        out = _top_k_by_selection(out, top_k) if on_cpu else _top_k_by_search(out, top_k)
    if p_active:
        assert top_p is not None
        out = _top_p_by_search(out, top_p)
    return out


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """``int32`` keys in the order of the float32 values of ``x`` (equal values, equal keys).

    The IEEE bit pattern is monotone for non-negative floats and reversed for negative
    ones (``bits ^ 0x7FFFFFFF`` = ``-(bits & 0x7FFFFFFF) - 1`` there); ``-0.0`` is first made
    ``+0.0`` (they compare equal).
    """
    bits = (x.to(torch.float32) + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


#: The widest digit of a cut's 32-bit key (2048 bins per row and pass: three passes).
MAX_DIGIT_BITS = 11


def _top_p_by_search(out: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p without a sort: the kept set of the ascending-sort rule, found by a radix search.

    In vLLM's rule a token survives when the probability of the tokens after it in
    ascending (logit, id) order is < p. So the cut is the logit x* whose tokens hold
    that boundary — mass(x > x*) < p·total <= mass(x >= x*) — found by
    :func:`_radix_cut` (three passes over a long row; no sort, no host round trip). Every
    token above x* is kept, and at x* the ties with the largest ids while the mass above
    them is still < p·total (the stable sort's order). Sums are in float64 over
    ``exp(x − max)``.
    """
    p = top_p.to(device=out.device, dtype=torch.float64).unsqueeze(1)
    keys = _unsigned_keys(out)
    weights = torch.exp((out - out.amax(dim=-1, keepdim=True)).to(torch.float64))
    target = p * weights.sum(dim=-1, keepdim=True)
    cut, above = _radix_cut(keys, weights, target)
    tie = keys == cut
    tie_weight = (weights * tie).amax(dim=-1, keepdim=True)
    # Ties kept from the largest id down: the i-th (i = 0, 1, …) while above + i·w < target.
    kept_ties = torch.ceil((target - above) / tie_weight)
    from_the_top = tie.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # ties at this id or after it
    keep = _above(keys, cut) | (tie & (from_the_top <= kept_ties))
    return out.masked_fill(~keep & (p < 1), float("-inf"))


def _top_k_by_search(out: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a sort: the k-th largest logit per row by :func:`_radix_cut` on counts
    (count(x > x*) < k <= count(x >= x*)), then the sorted path's mask (below it: ``-inf``;
    ties at the k-th value are kept). No host round trip."""
    vocab = out.shape[1]
    k = top_k.to(device=out.device, dtype=torch.float32).unsqueeze(1)
    active = (k > 0) & (k < vocab)
    keys = _unsigned_keys(out)
    cut, _ = _radix_cut(keys, torch.ones_like(out), k)  # a row with k off is left as it is below
    return out.masked_fill(~(_above(keys, cut) | (keys == cut)) & active, float("-inf"))


def _top_k_by_selection(out: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """:func:`_top_k_by_search`'s mask from the k-th largest logit of ``torch.topk`` (over the
    largest k any row asks for; that k is read from the host)."""
    vocab = out.shape[1]
    k = top_k.to(device=out.device, dtype=torch.long)
    active = (k > 0) & (k < vocab)
    k_max = int(torch.where(active, k, 0).max())
    values = torch.topk(out, max(k_max, 1), dim=-1, sorted=True).values
    kth = values.gather(1, (k.clamp(1, max(k_max, 1)) - 1).unsqueeze(1))
    return out.masked_fill((out < kth) & active.unsqueeze(1), float("-inf"))


def _unsigned_keys(x: torch.Tensor) -> torch.Tensor:
    """:func:`ordered_keys` with the sign bit flipped: read as unsigned 32-bit integers, they
    are in the order of the float32 values of ``x``."""
    return ordered_keys(x) ^ -(1 << 31)


def _above(keys: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``keys > cut`` in the unsigned order of :func:`_unsigned_keys` (``cut`` from :func:`_radix_cut`)."""
    return (keys ^ -(1 << 31)) > (cut ^ -(1 << 31))


def _radix_cut(keys: torch.Tensor, weights: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key x* with mass(key > x*) < target <= mass(key >= x*), per row, a digit at a time.

    Each pass adds the weights of the keys that share x*'s digits found so far into one bin
    per value of the next digit; the cumulative mass from the top picks the digit (the
    largest whose mass at or above it reaches the target).

    Args:
        keys: ``[batch, vocab]`` int32 patterns of :func:`_unsigned_keys`.
        weights: ``[batch, vocab]`` non-negative, float32 or float64 (sums in that dtype).
        target: ``[batch, 1]`` of the weights' dtype.

    Returns:
        ``(cut, above)``: ``[batch, 1]`` int64, x* as the value of its int32 pattern (compare
        with ``keys == cut`` and :func:`_above`), and the mass above it. A row whose target
        exceeds its total mass (NaN weights) gets the lowest key.
    """
    batch, vocab = keys.shape
    # Bins per pass about vocab / 8: fewer passes for long rows, small histograms for short ones.
    bits = min(MAX_DIGIT_BITS, max(4, vocab.bit_length() - 3))
    found = torch.zeros(batch, 1, dtype=torch.int64, device=keys.device)  # x*'s digits so far
    above = torch.zeros_like(target)  # mass of the keys above found's range
    top = 0
    for width in [bits] * (32 // bits) + ([32 % bits] if 32 % bits else []):
        digit = (keys >> (32 - top - width)) & ((1 << width) - 1)
        if top:  # keys outside found's range go to a last bin, ignored
            in_range = ((keys >> (32 - top)) & ((1 << top) - 1)) == found
            digit = torch.where(in_range, digit, 1 << width)
        mass = torch.zeros(batch, (1 << width) + 1, dtype=weights.dtype, device=keys.device)
        mass.scatter_add_(1, digit.long(), weights)
        at_or_above = mass[:, : 1 << width].flip(-1).cumsum(-1).flip(-1) + above  # non-increasing
        chosen = ((at_or_above >= target).sum(-1, keepdim=True) - 1).clamp(min=0)
        above = torch.cat([at_or_above[:, 1:], above], dim=1).gather(1, chosen)
        found = (found << width) | chosen
        top += width
    # as the int32 pattern's value, so that ``keys == cut`` holds for x*'s tokens
    return torch.where(found >= 1 << 31, found - (1 << 32), found), above


def filters_active(top_k: torch.Tensor | None, top_p: torch.Tensor | None, vocab: int) -> tuple[bool, bool]:
    """Whether any row asks for top-k (0 < k < vocab) and for top-p (p < 1)."""
    k_active = top_k is not None and bool(((top_k > 0) & (top_k < vocab)).any())
    p_active = top_p is not None and bool((top_p < 1.0).any())
    return k_active, p_active
