"""The processed next-token distribution, exactly as vLLM's V1 sampler defines it.

Pipeline, in vLLM's order (``vllm/v1/sample/sampler.py::Sampler.sample``):

1. temperature: ``logits / T`` (``Sampler.apply_temperature``);
2. min-p: mask tokens whose softmax probability is below ``min_p · max prob``
   (``vllm/v1/sample/logits_processor/builtin.py::MinPLogitsProcessor.apply``);
3. top-k: mask logits strictly below the k-th largest (ties at the boundary are kept)
   (``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch``); without top-p
   the k-th largest comes from ``torch.topk`` (a selection), with it from the sort top-p needs;
4. top-p: on the top-k-masked, ascending-sorted row, mask tokens whose cumulative
   probability is ``<= 1 - p``, always keeping the largest;
5. softmax. (The CDF, choice and carry follow in :mod:`qmc_sampler.inverse_cdf`
   and :mod:`qmc_sampler.carry`.)

Masks are computed in float32 like vLLM's; the surviving logits are what the
inverse CDF turns into float64 probabilities. Ties in the top-p sort are broken by
token id (stable sort), which vLLM leaves to the unstable sort.
"""

from __future__ import annotations

import torch

__all__ = ["SAMPLING_EPS", "filters_active", "process_logits"]

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
    if not (k_active or p_active):
        return out
    if not p_active:
        return _top_k_by_selection(out, top_k)
    logits_sort, logits_idx = out.sort(dim=-1, descending=False, stable=True)
    if k_active:
        assert top_k is not None
        k = top_k.to(device=out.device, dtype=torch.long)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        kth = logits_sort.gather(1, (vocab - k).unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if p_active:
        assert top_p is not None
        cum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
        p_mask = cum <= 1 - top_p.to(out).unsqueeze(1)
        p_mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(p_mask, float("-inf"))
    return torch.empty_like(out).scatter_(dim=-1, index=logits_idx, src=logits_sort)


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
