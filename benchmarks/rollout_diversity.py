"""What correlated rollouts give a GRPO step: distinct correct completions and pass@G, i.i.d. vs lattice.

For each problem of one eval task, one group of G rollouts per sampler (G = 8
and 16 by default), generated side by side in one run on one engine with the
same group seeds, then scored with the task's verifier. Per sampler and G it
prints, averaged over problems:

* pass@G — the share of problems with at least one correct rollout (a group with
  no correct rollout gives GRPO no learning signal for that prompt);
* distinct correct — how many *different* correct completions a group contains;
* distinct — how many different completions a group contains;

and the ratio lattice / i.i.d. for each. Both samplers are exact, so their
per-rollout success rates agree up to noise (printed as p̂).

    python benchmarks/rollout_diversity.py [--task basic_arithmetic] [--problems 32] [--groups 8,16]
                                           [--model DIR] [--dtype auto] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--groups", default="8,16", help="comma-separated G (rollouts per prompt)")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from qmc_sampler.eval.generation import GroupJob, InProcessBackend
    from qmc_sampler.eval.runner import build_engine, group_seed, shutdown_engine
    from qmc_sampler.eval.tasks import get_task

    from qmc_sampler.cpu_defaults import describe_cpu
    from qmc_sampler.models import resolve_model

    sizes = [int(g) for g in args.groups.split(",")]
    task = get_task(args.task)
    problems = task.problems(args.problems, args.seed)
    llm, where = build_engine(resolve_model(args.model), args.dtype)
    print(f"{describe_cpu()}; {where}", flush=True)
    sampling = {"temperature": args.temperature, "max_tokens": task.max_tokens, "stop": list(task.stop)}
    jobs = [
        GroupJob(
            key=(sampler, pr.problem_id, g),
            messages=pr.messages,
            prompt=pr.prompt,
            n=g,
            seed=group_seed(args.seed, args.task, pr.problem_id, g),
            method=sampler,
            order="id",
            sampling=sampling,
        )
        for g in sizes
        for pr in problems
        for sampler in ("iid", "lattice")  # side by side: the same seeds, interleaved
    ]
    by_id = {pr.problem_id: pr for pr in problems}
    stats: dict[tuple[str, int], list[tuple[bool, int, int, float]]] = {}

    def collect(job: GroupJob, texts: list[str]) -> None:
        sampler, problem_id, g = job.key
        verdicts = [task.score(by_id[problem_id], t).correct for t in texts]
        correct = {t for t, ok in zip(texts, verdicts, strict=True) if ok}
        stats.setdefault((sampler, g), []).append(
            (any(verdicts), len(correct), len(set(texts)), float(np.mean(verdicts)))
        )

    start = time.perf_counter()
    try:
        InProcessBackend(llm).run(jobs, collect)
    finally:
        shutdown_engine(llm)
    print(
        f"{args.task}: {len(problems)} problems, temperature {args.temperature}, {time.perf_counter() - start:.0f} s\n"
    )
    header = f"{'G':>3}  {'sampler':>8}  {'pass@G':>7}  {'distinct correct':>16}  {'distinct':>8}  {'p̂':>6}"
    print(header + "\n" + "-" * len(header))
    for g in sizes:
        means = {}
        for sampler in ("iid", "lattice"):
            rows = np.array(stats[(sampler, g)], dtype=float)
            means[sampler] = rows.mean(axis=0)
            solved, distinct_correct, distinct, p_hat = means[sampler]
            print(f"{g:>3}  {sampler:>8}  {solved:7.3f}  {distinct_correct:16.2f}  {distinct:8.2f}  {p_hat:6.3f}")
        ratio = means["lattice"][:3] / np.maximum(means["iid"][:3], 1e-12)
        print(f"{g:>3}  {'ratio':>8}  {ratio[0]:7.2f}  {ratio[1]:16.2f}  {ratio[2]:8.2f}   (lattice / i.i.d.)")


if __name__ == "__main__":
    main()
