"""The CUDA backend: a Triton kernel for the inverse-CDF step on GPU logits.

One program per row, three passes over the vocabulary in blocks of ``BLOCK``:

1. the row's maximum logit m (and a NaN check);
2. the total weight Σ exp((x − m)/T) over kept tokens (min-p: x ≥ m + T·log min_p),
   exponentials in float32, sums in float64;
3. the walk: block sums accumulate until the block holding u·total; inside it a
   cumulative sum finds the first token whose cumulative weight exceeds u·total.

Top-k and top-p, when a row asks for them, are applied first with the torch
masks (:func:`qmc_sampler.processing.process_logits`, on the GPU); ``sorted``
order uses the torch path. The kernel is validated on CPU tensors through
Triton's interpreter (``TRITON_INTERPRET=1``) in ``tests/core/test_triton_kernel.py``
and on a GPU where one is present.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "triton_available", "triton_inverse_cdf"]

BLOCK = 1024


def triton_available() -> bool:
    """True when Triton can run the kernel here (a CUDA device, or the interpreter)."""
    import os

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def inverse_cdf_kernel(
        logits_ptr,
        stride,
        vocab,
        temperature_ptr,
        min_p_ptr,
        u_ptr,
        token_ptr,
        start_ptr,
        prob_ptr,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row * stride
        temperature = tl.load(temperature_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        u = tl.load(u_ptr + row)
        offs = tl.arange(0, BLOCK_SIZE)

        m = -float("inf")
        nans = 0
        for lo in range(0, vocab, BLOCK_SIZE):
            x = tl.load(base + lo + offs, mask=lo + offs < vocab, other=-float("inf"))
            m = tl.maximum(m, tl.max(x, axis=0))
            nans += tl.sum((x != x).to(tl.int32), axis=0)

        cut = tl.where(min_p > 0, m + temperature * tl.log(tl.maximum(min_p, 1e-30)), -float("inf"))
        total = tl.zeros((), dtype=tl.float64)
        for lo in range(0, vocab, BLOCK_SIZE):
            valid = lo + offs < vocab
            x = tl.load(base + lo + offs, mask=valid, other=-float("inf"))
            keep = valid & (x >= cut) & (x > -float("inf"))
            w = tl.where(keep, tl.exp((x - m) / temperature), 0.0)
            total += tl.sum(w.to(tl.float64), axis=0)

        target = u * total
        acc = tl.zeros((), dtype=tl.float64)
        token = -1
        start = tl.zeros((), dtype=tl.float64)
        width = tl.zeros((), dtype=tl.float64)
        last = -1
        last_w = tl.zeros((), dtype=tl.float64)
        for lo in range(0, vocab, BLOCK_SIZE):
            valid = lo + offs < vocab
            x = tl.load(base + lo + offs, mask=valid, other=-float("inf"))
            keep = valid & (x >= cut) & (x > -float("inf"))
            w = tl.where(keep, tl.exp((x - m) / temperature), 0.0).to(tl.float64)
            cum = tl.cumsum(w, axis=0)
            crossing = (acc + cum > target) & (w > 0) & (token < 0)
            first = tl.min(tl.where(crossing, offs, BLOCK_SIZE), axis=0)
            hit = first < BLOCK_SIZE
            w_first = tl.sum(tl.where(offs == first, w, 0.0), axis=0)
            cum_first = tl.sum(tl.where(offs == first, cum, 0.0), axis=0)
            token = tl.where(hit, lo + first, token)
            start = tl.where(hit, acc + cum_first - w_first, start)
            width = tl.where(hit, w_first, width)
            positive = tl.max(tl.where(w > 0, offs, -1), axis=0)
            last_w = tl.where(positive >= 0, tl.sum(tl.where(offs == positive, w, 0.0), axis=0), last_w)
            last = tl.where(positive >= 0, lo + positive, last)
            acc += tl.sum(w, axis=0)
        # u within rounding of 1: the last token of positive weight (the CDF's last entry is 1).
        token = tl.where(token < 0, last, token)
        start = tl.where(width > 0, start, total - last_w)
        width = tl.where(width > 0, width, last_w)
        bad = (nans > 0) | (m == -float("inf"))
        tl.store(token_ptr + row, tl.where(bad, -1, token).to(tl.int64))
        tl.store(start_ptr + row, start / total)
        tl.store(prob_ptr + row, width / total)

    return inverse_cdf_kernel


_KERNEL = None


def triton_inverse_cdf(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, min-p and token-id-order inverse CDF per row (see module docstring).

    Args:
        logits: ``[batch, vocab]`` (top-k/top-p already applied as ``-inf``).
        uniforms: ``[batch]`` float64; temperature, min_p: ``[batch]``.

    Returns:
        ``(tokens [batch] int64, starts, probs [batch] float64)``; a token of -1
        marks a row with NaN or no admissible token.
    """
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    batch, vocab = logits.shape
    device = logits.device
    x = logits.float().contiguous()
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    starts = torch.empty(batch, dtype=torch.float64, device=device)
    probs = torch.empty(batch, dtype=torch.float64, device=device)
    mp = min_p if min_p is not None else torch.zeros(batch)
    _KERNEL[(batch,)](
        x,
        x.stride(0),
        vocab,
        temperature.to(device=device, dtype=torch.float32).contiguous(),
        mp.to(device=device, dtype=torch.float32).contiguous(),
        uniforms.to(device=device, dtype=torch.float64),
        tokens,
        starts,
        probs,
        BLOCK_SIZE=BLOCK,
    )
    return tokens, starts, probs
