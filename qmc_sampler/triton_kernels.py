"""The CUDA backend: a Triton kernel for the inverse-CDF step on GPU logits.

One program per row, passes over the vocabulary in blocks of ``BLOCK``, no sort:

1. the row's maximum logit m (and a NaN check); min-p keeps x ≥ m + T·log min_p;
2. top-k (0 < k < vocab): the k-th largest logit, by bisection on the logits'
   ordered bit keys (:func:`qmc_sampler.processing.ordered_keys`): a count per step;
   ties at it are kept (vLLM);
3. top-p (p < 1): the cut x* with mass(x > x*) < p·total ≤ mass(x ≥ x*), by bisection
   on the keys (a masked sum per step); at x* the ties with the largest ids are kept
   while the mass above them is < p·total — the set vLLM's ascending sort keeps, ties
   in a stable sort's order (:func:`qmc_sampler.processing.process_logits` states it);
4. the total weight Σ exp((x − m)/T) over kept tokens, exponentials in float32, sums
   in float64; then the walk: block sums accumulate until the block holding u·total;
   inside it a cumulative sum finds the first token whose cumulative weight exceeds it.

``sorted`` order uses the torch path. The kernel is validated on CPU tensors through
Triton's interpreter (``TRITON_INTERPRET=1``) in ``tests/core/test_triton_kernel.py``
and on a GPU where one is present.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "triton_available", "triton_inverse_cdf"]

#: Bisection steps that pin a key in the int32 range (plus the -inf sentinel below it).
KEY_SEARCH_STEPS = 34

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

    # Triton resolves the helpers a kernel calls among the module's globals, not a closure's.
    global ordered_key, kept_block

    @triton.jit
    def ordered_key(x):
        # The float32 value's order (qmc_sampler.processing.ordered_keys), held in an int64.
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits.to(tl.int64), -((bits & 0x7FFFFFFF).to(tl.int64)) - 1)

    @triton.jit
    def kept_block(base, lo, offs, vocab, cut, k_lo, p_key, id_cut, m, temperature):
        # One block's keys, kept tokens (min-p, top-k, and top-p's cut: key above p_key, or at
        # it from id_cut on) and their float64 weights exp((x − m)/T). Before the top-p cut is
        # known, p_key below every key keeps everything top-k and min-p keep.
        valid = lo + offs < vocab
        x = tl.load(base + lo + offs, mask=valid, other=-float("inf"))
        key = ordered_key(x)
        keep = valid & (x >= cut) & (x > -float("inf")) & (key >= k_lo)
        keep = keep & ((key > p_key) | ((key == p_key) & (lo + offs >= id_cut)))
        return key, keep, tl.where(keep, tl.exp((x - m) / temperature), 0.0).to(tl.float64)

    @triton.jit
    def inverse_cdf_kernel(
        logits_ptr,
        stride,
        vocab,
        temperature_ptr,
        min_p_ptr,
        top_k_ptr,
        top_p_ptr,
        u_ptr,
        token_ptr,
        start_ptr,
        prob_ptr,
        BLOCK_SIZE: tl.constexpr,
        KEY_STEPS: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row * stride
        temperature = tl.load(temperature_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row).to(tl.float64)
        u = tl.load(u_ptr + row)
        offs = tl.arange(0, BLOCK_SIZE)
        no_key = -(1 << 31) - 2  # below every key, -inf's included

        m = -float("inf")
        nans = 0
        for lo in range(0, vocab, BLOCK_SIZE):
            x = tl.load(base + lo + offs, mask=lo + offs < vocab, other=-float("inf"))
            m = tl.maximum(m, tl.max(x, axis=0))
            nans += tl.sum((x != x).to(tl.int32), axis=0)
        cut = tl.where(min_p > 0, m + temperature * tl.log(tl.maximum(min_p, 1e-30)), -float("inf"))

        # Top-k: the k-th largest key (min-p's masked tokens count as -inf, as in vLLM).
        # Invariant: count(key >= k_lo) >= k > count(key >= k_hi).
        k_lo = tl.full((), no_key, tl.int64)
        if (top_k > 0) & (top_k < vocab):
            k_hi = ordered_key(m) + 1
            for _ in range(KEY_STEPS):
                mid = k_lo + (k_hi - k_lo) // 2
                count = 0
                for lo in range(0, vocab, BLOCK_SIZE):
                    valid = lo + offs < vocab
                    x = tl.load(base + lo + offs, mask=valid, other=-float("inf"))
                    x = tl.where(x >= cut, x, -float("inf"))
                    count += tl.sum((valid & (ordered_key(x) >= mid)).to(tl.int32), axis=0)
                enough = count >= top_k
                k_lo = tl.where(enough, mid, k_lo)
                k_hi = tl.where(enough, k_hi, mid)

        # Top-p: the cut key x* (mass(key > x*) < p·total <= mass(key >= x*)), then the
        # smallest id kept among the ties at x*. Without top-p: x* below every key.
        p_key = tl.full((), no_key, tl.int64)
        id_cut = 0
        if top_p < 1.0:
            kept_total = tl.zeros((), dtype=tl.float64)
            for lo in range(0, vocab, BLOCK_SIZE):
                _, _, w = kept_block(base, lo, offs, vocab, cut, k_lo, p_key, id_cut, m, temperature)
                kept_total += tl.sum(w, axis=0)
            target = top_p * kept_total
            p_lo = tl.full((), no_key, tl.int64)  # mass(key > p_lo) >= target > mass(key > p_hi)
            p_hi = ordered_key(m)
            for _ in range(KEY_STEPS):
                mid = p_lo + (p_hi - p_lo) // 2
                mass = tl.zeros((), dtype=tl.float64)
                for lo in range(0, vocab, BLOCK_SIZE):
                    key, _, w = kept_block(base, lo, offs, vocab, cut, k_lo, p_key, id_cut, m, temperature)
                    mass += tl.sum(tl.where(key > mid, w, 0.0), axis=0)
                below = mass < target
                p_hi = tl.where(below, mid, p_hi)
                p_lo = tl.where(below, p_lo, mid)
            above = tl.zeros((), dtype=tl.float64)
            ties = 0
            tie_w = tl.zeros((), dtype=tl.float64)
            for lo in range(0, vocab, BLOCK_SIZE):
                key, keep, w = kept_block(base, lo, offs, vocab, cut, k_lo, p_key, id_cut, m, temperature)
                above += tl.sum(tl.where(key > p_hi, w, 0.0), axis=0)
                ties += tl.sum((keep & (key == p_hi)).to(tl.int32), axis=0)
                tie_w = tl.maximum(tie_w, tl.max(tl.where(key == p_hi, w, 0.0), axis=0))
            p_key = p_hi
            # Ties kept from the largest id down while the mass above them is < target.
            kept_ties = tl.minimum(tl.ceil((target - above) / tie_w), ties.to(tl.float64)).to(tl.int32)
            if kept_ties < ties:
                # The largest c with count(ties at id >= c) >= kept_ties.
                c_lo = 0
                c_hi = vocab
                for _ in range(32):
                    mid = c_lo + (c_hi - c_lo) // 2
                    count = 0
                    for lo in range(0, vocab, BLOCK_SIZE):
                        valid = lo + offs < vocab
                        x = tl.load(base + lo + offs, mask=valid, other=-float("inf"))
                        tie = valid & (x >= cut) & (ordered_key(x) == p_hi) & (lo + offs >= mid)
                        count += tl.sum(tie.to(tl.int32), axis=0)
                    enough = count >= kept_ties
                    c_lo = tl.where(enough, mid, c_lo)
                    c_hi = tl.where(enough, c_hi, mid)
                id_cut = c_lo

        total = tl.zeros((), dtype=tl.float64)
        for lo in range(0, vocab, BLOCK_SIZE):
            _, _, w = kept_block(base, lo, offs, vocab, cut, k_lo, p_key, id_cut, m, temperature)
            total += tl.sum(w, axis=0)

        target = u * total
        acc = tl.zeros((), dtype=tl.float64)
        token = -1
        start = tl.zeros((), dtype=tl.float64)
        width = tl.zeros((), dtype=tl.float64)
        last = -1
        last_w = tl.zeros((), dtype=tl.float64)
        for lo in range(0, vocab, BLOCK_SIZE):
            _, _, w = kept_block(base, lo, offs, vocab, cut, k_lo, p_key, id_cut, m, temperature)
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
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, min-p, top-k, top-p and the token-id-order inverse CDF per row (module docstring).

    Args:
        logits: ``[batch, vocab]``.
        uniforms: ``[batch]`` float64; temperature, min_p, top_k, top_p: ``[batch]`` (None:
            off for every row; top-k 0 and top-p 1 are off).

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
    # A disabled filter's parameters are made on the device: a host tensor's upload would wait
    # for the device (PyTorch synchronises after a copy from pageable memory) in every step.
    mp = min_p if min_p is not None else torch.zeros(batch, device=device)
    k = top_k if top_k is not None else torch.zeros(batch, dtype=torch.int32, device=device)
    p = top_p if top_p is not None else torch.ones(batch, device=device)
    _KERNEL[(batch,)](
        x,
        x.stride(0),
        vocab,
        temperature.to(device=device, dtype=torch.float32).contiguous(),
        mp.to(device=device, dtype=torch.float32).contiguous(),
        k.to(device=device, dtype=torch.int32).contiguous(),
        p.to(device=device, dtype=torch.float32).contiguous(),
        uniforms.to(device=device, dtype=torch.float64),
        tokens,
        starts,
        probs,
        BLOCK_SIZE=BLOCK,
        KEY_STEPS=KEY_SEARCH_STEPS,
    )
    return tokens, starts, probs
