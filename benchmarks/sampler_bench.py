"""Sampling-step cost: the fused kernel vs the torch path vs vLLM's own sampler, same logits.

For each batch × vocab × filter setting it times, in this one process and
alternating between them:

* ``fused``  — ``qmc_sampler.kernels.fused_draw`` on the fastest backend (the C++
  kernel on CPU): temperature, top-k/top-p, CDF and choice in one pass per row;
* ``torch``  — the pure-torch reference (``process_logits`` + ``inverse_cdf``);
* ``vllm``   — vLLM's ``TopKTopPSampler`` as vLLM runs it on this device (on CPU:
  ``apply_top_k_top_p`` then the fused Gumbel-argmax op), after vLLM's
  temperature division.

It prints medians (ms), ratios against vLLM (< 1: faster than vLLM), and the
memory-bandwidth floor: the time to read the logits once at the copy bandwidth
measured just before the row (a shared machine's speed drifts over a run).

    python benchmarks/sampler_bench.py [--threads N] [--repeats 7] [--quick] [--device cpu|cuda]

With ``--device cuda`` the logits live on the GPU: ``fused`` is the Triton kernel and
``vllm`` vLLM's CUDA sampling op; each call is timed to the end of its kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

CPU = torch.device("cpu")


def median_ms(fn, repeats: int, device: torch.device = CPU) -> float:
    """Median wall time of fn() in ms; on a GPU, each call timed to the end of its kernels."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up (allocations, first-touch, kernel compilation)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Main-memory copy bandwidth (read + write), GB/s: src and dst exceed the caches."""
    ms = median_ms(lambda: dst.copy_(src), 9, src.device)
    return 2 * src.numel() * 4 / (ms / 1e3) / 1e9


def bench_case(
    batch: int, vocab: int, k: int, top_p: float, repeats: int, vllm_sampler, device: torch.device = CPU
) -> tuple[float, ...]:
    """Median ms of (fused, torch, vLLM) on one batch of random logits on ``device``."""
    from qmc_sampler import inverse_cdf, process_logits
    from qmc_sampler.kernels import fused_draw

    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    temperature = torch.full((batch,), 0.8, device=device)
    u = torch.rand(batch, dtype=torch.float64, generator=gen).to(device)
    kk = torch.full((batch,), k, device=device) if k else None
    pp = torch.full((batch,), top_p, device=device) if top_p < 1 else None
    scratch = logits.clone()

    def fused() -> None:
        # As the vLLM plugin calls it: bad rows come back as token -1, no host check.
        fused_draw(logits, u, temperature, kk, pp, None, "id", check=False)

    def reference() -> None:
        inverse_cdf(process_logits(logits, temperature, kk, pp, None), u, order="id")

    def vllm() -> None:
        # vLLM divides by temperature in place, then samples (possibly in place).
        scratch.copy_(logits)
        vllm_sampler(scratch.div_(temperature.unsqueeze(1)), {}, kk, pp)

    copy_ms = median_ms(lambda: scratch.copy_(logits), repeats, device)
    t_fused = median_ms(fused, repeats, device)
    t_torch = median_ms(reference, max(3, repeats // 2), device)
    t_vllm = max(median_ms(vllm, repeats, device) - copy_ms, 1e-6)  # vLLM gets its logits in place
    return t_fused, t_torch, t_vllm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="batch 32 only")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the logits live (default: cpu)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's CPU ops, loaded as its engine loads them: the kernel library built for this CPU
    # (_C: AVX-512 + bf16, _C_AVX512, _C_AVX2); importing vllm._C directly dies with SIGILL elsewhere.
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    current_platform.import_kernels()

    from qmc_sampler.cpu_defaults import describe_cpu
    from qmc_sampler.kernels import backend_for

    vllm_sampler = TopKTopPSampler()
    # Larger than the caches: 64 MiB on a CPU, 1 GiB on a GPU (an H100's or H200's L2 is 50-60 MB).
    copy_src = torch.empty((1024 if device.type == "cuda" else 64) * 2**20 // 4, device=device).uniform_()
    copy_dst = torch.empty_like(copy_src)
    print(describe_cpu(), flush=True)
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    print(
        f"threads: {torch.get_num_threads()}, logits on: {device.type}, fused backend: {backend_for(device)}, "
        f"vLLM sampler: {vllm_sampler.forward.__name__}"
    )
    header = (
        f"{'batch':>5} {'vocab':>7} {'filter':>12} | {'fused':>8} {'torch':>9} {'vllm':>8} | "
        f"{'fused/vllm':>10} {'torch/vllm':>10} | {'GB/s':>5} {'floor':>7} {'fused/floor':>11}"
    )
    print(header)
    print("-" * len(header))
    batches = [32] if args.quick else [1, 32, 256]
    for vocab in (49152, 151936):
        for batch in batches:
            for label, k, top_p in (
                ("none", 0, 1.0),
                ("top-k 50", 50, 1.0),
                ("top-p 0.9", 0, 0.9),
                ("k 50 p 0.9", 50, 0.9),
            ):
                # A single row takes tens of microseconds: more repeats for a stable median.
                repeats = args.repeats * 8 if batch == 1 else max(3, args.repeats // (2 if batch == 256 else 1))
                bandwidth = copy_bandwidth_gbs(copy_src, copy_dst)
                t_fused, t_torch, t_vllm = bench_case(batch, vocab, k, top_p, repeats, vllm_sampler, device)
                floor = batch * vocab * 4 / (bandwidth / 2 * 1e9) * 1e3
                print(
                    f"{batch:>5} {vocab:>7} {label:>12} | {t_fused:>8.3f} {t_torch:>9.2f} {t_vllm:>8.2f} | "
                    f"{t_fused / t_vllm:>10.2f} {t_torch / t_vllm:>10.2f} | {bandwidth:>5.1f} {floor:>7.3f} "
                    f"{t_fused / floor:>11.1f}"
                )
    print(
        "\nms medians; ratios < 1 are faster than vLLM's own sampling op; floor = logits read once at the copy "
        "bandwidth (GB/s, read + write) measured just before the row."
    )


if __name__ == "__main__":
    main()
