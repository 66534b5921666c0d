"""Sampling-step cost: the fused kernel vs the torch path vs transformers' and vLLM's samplers, same logits.

For each batch × vocab × filter setting it times, in this one process and
alternating between them:

* ``fused``  — ``qmc_sampler.kernels.fused_draw`` on the fastest backend (the C++
  kernel on CPU): temperature, top-k/top-p, CDF and choice in one pass per row;
* ``torch``  — the pure-torch reference (``process_logits`` + ``inverse_cdf``);
* ``hf``     — what transformers' ``generate(do_sample=True)`` does: its temperature, top-k
  and top-p warpers (``torch.topk``; a full sort of the row for top-p), softmax, then
  ``torch.multinomial`` (transformers' own warper classes where it is installed);
* ``vllm``   — vLLM's ``TopKTopPSampler`` as vLLM runs it on this device (on CPU:
  ``apply_top_k_top_p`` then the fused Gumbel-argmax op), after vLLM's
  temperature division; ``nan`` where vLLM is not installed (or ``--no-vllm``).

It prints medians (ms), the ratios fused/hf and fused/vllm (< 1: fused is faster), and
the memory-bandwidth floor: the time to read the logits once at the copy bandwidth
measured just before the row (a shared machine's speed drifts over a run); the last
line sums the ratios up (medians over the rows).

    python benchmarks/sampler_bench.py [--threads N] [--repeats 7] [--quick] [--device cpu|cuda]
                                       [--batches 1,32,256] [--vocabs 49152,151936] [--no-vllm]

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


def hf_sampler(temperature: float, k: int, top_p: float):
    """transformers' sampling step for one setting: its warpers (temperature, top-k, top-p, in the order
    ``generate`` applies them), softmax and ``torch.multinomial``; the same steps written out where
    transformers is not installed (its ``TopKLogitsWarper`` / ``TopPLogitsWarper``, 5.x)."""
    try:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    except ImportError:
        warpers = None
    else:
        warpers = LogitsProcessorList(
            [TemperatureLogitsWarper(temperature)]
            + ([TopKLogitsWarper(k)] if k else [])
            + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        )

    def written_out(scores: torch.Tensor) -> torch.Tensor:
        scores = scores / temperature
        if k:
            scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], float("-inf"))
        if top_p < 1:
            sorted_logits, sorted_indices = torch.sort(scores, descending=False)
            remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
            remove[..., -1:] = False
            scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))
        return scores

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = written_out(logits) if warpers is None else warpers(None, logits)
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    sample.source = "written out" if warpers is None else "transformers' warpers"  # type: ignore[attr-defined]
    return sample


def bench_case(
    batch: int, vocab: int, k: int, top_p: float, repeats: int, vllm_sampler, device: torch.device = CPU
) -> tuple[float, ...]:
    """Median ms of (fused, torch, transformers, vLLM or NaN) on one batch of random logits on ``device``."""
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

    hf = hf_sampler(0.8, k, top_p)
    t_fused = median_ms(fused, repeats, device)
    t_torch = median_ms(reference, max(min(3, repeats), repeats // 2), device)
    t_hf = median_ms(lambda: hf(logits), repeats, device)
    t_vllm = float("nan")
    if vllm_sampler is not None:
        copy_ms = median_ms(lambda: scratch.copy_(logits), repeats, device)
        t_vllm = max(median_ms(vllm, repeats, device) - copy_ms, 1e-6)  # vLLM gets its logits in place
    return t_fused, t_torch, t_hf, t_vllm


def load_vllm_sampler():
    """vLLM's ``TopKTopPSampler`` with its ops loaded as its engine loads them, or None without vLLM."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from vllm.platforms import current_platform
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    except ImportError:
        return None
    # vLLM's CPU ops, loaded as its engine loads them: the kernel library built for this CPU
    # (_C: AVX-512 + bf16, _C_AVX512, _C_AVX2); importing vllm._C directly dies with SIGILL elsewhere.
    current_platform.import_kernels()
    return TopKTopPSampler()


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="batch 32 only")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the logits live (default: cpu)")
    p.add_argument("--batches", type=sizes, default=[1, 32, 256], help="comma-separated (default: 1,32,256)")
    p.add_argument("--vocabs", type=sizes, default=[49152, 151936], help="comma-separated (default: 49152,151936)")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM's sampler out even where vLLM is installed")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    vllm_sampler = None if args.no_vllm else load_vllm_sampler()

    from qmc_sampler.cpu_defaults import describe_cpu
    from qmc_sampler.kernels import backend_for

    # Larger than the caches: 64 MiB on a CPU, 1 GiB on a GPU (an H100's or H200's L2 is 50-60 MB).
    copy_src = torch.empty((1024 if device.type == "cuda" else 64) * 2**20 // 4, device=device).uniform_()
    copy_dst = torch.empty_like(copy_src)
    print(describe_cpu(), flush=True)
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    print(
        f"threads: {torch.get_num_threads()}, logits on: {device.type}, fused backend: {backend_for(device)}, "
        f"hf: {hf_sampler(1.0, 0, 1.0).source}, "
        f"vLLM sampler: {vllm_sampler.forward.__name__ if vllm_sampler is not None else 'none'}"
    )
    header = (
        f"{'batch':>5} {'vocab':>7} {'filter':>12} | {'fused':>8} {'torch':>9} {'hf':>8} {'vllm':>8} | "
        f"{'fused/hf':>8} {'fused/vllm':>10} {'torch/vllm':>10} | {'GB/s':>7} {'floor':>7} {'fused/floor':>11}"
    )
    print(header)
    print("-" * len(header))
    batches = [32] if args.quick else args.batches
    ratios: dict[str, list[float]] = {"fused/hf": [], "fused/vllm": [], "fused/floor": []}
    for vocab in args.vocabs:
        for batch in batches:
            for label, k, top_p in (
                ("none", 0, 1.0),
                ("top-k 50", 50, 1.0),
                ("top-p 0.9", 0, 0.9),
                ("k 50 p 0.9", 50, 0.9),
            ):
                # A single row takes tens of microseconds: more repeats for a stable median; at
                # least 3 elsewhere, unless fewer were asked for.
                fewer = args.repeats // (2 if batch == 256 else 1)
                repeats = args.repeats * 8 if batch == 1 else max(min(3, args.repeats), fewer)
                bandwidth = copy_bandwidth_gbs(copy_src, copy_dst)
                t_fused, t_torch, t_hf, t_vllm = bench_case(batch, vocab, k, top_p, repeats, vllm_sampler, device)
                floor = batch * vocab * 4 / (bandwidth / 2 * 1e9) * 1e3
                ratios["fused/hf"].append(t_fused / t_hf)
                ratios["fused/vllm"].append(t_fused / t_vllm)
                ratios["fused/floor"].append(t_fused / floor)
                print(
                    f"{batch:>5} {vocab:>7} {label:>12} | {t_fused:>8.3f} {t_torch:>9.2f} {t_hf:>8.3f} "
                    f"{t_vllm:>8.2f} | {t_fused / t_hf:>8.2f} {t_fused / t_vllm:>10.2f} {t_torch / t_vllm:>10.2f} | "
                    f"{bandwidth:>7.1f} {floor:>7.3f} {t_fused / floor:>11.1f}"
                )
    print(
        "\nms medians; ratios < 1: the first is faster; hf = transformers' warpers, softmax and multinomial; "
        "vllm = vLLM's own sampling op (nan: left out); floor = logits read once at the copy bandwidth "
        "(GB/s, read + write) measured just before the row."
    )

    def spread(values: list[float]) -> str:
        values = [v for v in values if v == v]  # NaN: vLLM not installed
        if not values:
            return "-"
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    summary = ", ".join(f"{name} {spread(values)}" for name, values in ratios.items())
    print(f"summary ({device.type}, {len(ratios['fused/hf'])} rows, median (range)): {summary}")


if __name__ == "__main__":
    main()
