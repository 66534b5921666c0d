"""How often qmc-eval's 95% intervals cover the population value (docs/evaluation.md, "Intervals").

Simulated evaluations with a known answer: each problem has a success probability
p ~ Beta(0.6, 1.4) and one group of N = 32 members, correct where the member's code
(its first uniform, from the design's own functions: ``lattice`` radical-inverse codes,
``iid`` fresh uniforms) falls in [0, p) — a one-step model whose correct tokens come
first in the vocabulary. The population values are then exact integrals over p:

* pass@k: i.i.d. 1 − B(a, b + k)/B(a, b); lattice (k = 2^j) E[min(1, k·p)];
* samples to the first correct member, capped at N (``qmc-eval run --until-correct 1``):
  Σ_{j<N} (1 − pass_j), where a lattice's first j members in radical-inverse order hit
  [0, p) with probability the length of the union of the arcs [−φ2(i), −φ2(i) + p);
* the ratio lattice / i.i.d. of those means.

Each replication evaluates ``--problems`` problems with the intervals ``qmc-eval score``
prints (:func:`qmc_sampler.eval.passk.bootstrap_pass_at_k`, and
:func:`qmc_sampler.eval.passk.bca_interval` with the statistics of
:mod:`qmc_sampler.eval.until_report`, :func:`qmc_sampler.eval.passk.fieller_ratio` for
the ratio) and counts how often each covers.

    python benchmarks/ci_coverage.py [--reps 2000] [--problems 48] [--resamples 400]
"""

from __future__ import annotations

import argparse
import platform
import time
from functools import cache

import numpy as np
from qmc_sampler.eval.passk import bca_interval, bootstrap_pass_at_k, fieller_ratio, per_group_pass_at_k
from qmc_sampler.eval.until_report import _mean
from scipy import special

from qmc_sampler import get_design, radical_inverse

A, B = 0.6, 1.4
N = 32
KS = (1, 4, 16)


def arc_union(j: int, p: float) -> float:
    """P(one of a radical-inverse lattice's first j members lands in [0, p)), over the shift."""
    if j == 0:
        return 0.0
    starts = np.sort(np.mod(-radical_inverse(np.arange(j)), 1.0))
    gaps = np.diff(np.append(starts, starts[0] + 1.0))
    return float(np.minimum(gaps, p).sum())


def expected_min(g: float) -> float:
    """E[min(g, p)] for p ~ Beta(A, B): E[p; p < g] + g·P(p ≥ g), in closed form."""
    return A / (A + B) * special.betainc(A + 1, B, g) + g * (1 - special.betainc(A, B, g))


def lattice_pass(j: int) -> float:
    """E[arc_union(j, p)]: Σ over the arcs' gaps of E[min(gap, p)]."""
    if j == 0:
        return 0.0
    starts = np.sort(np.mod(-radical_inverse(np.arange(j)), 1.0))
    return float(sum(expected_min(g) for g in np.diff(np.append(starts, starts[0] + 1.0))))


@cache
def truth() -> dict[str, float]:
    """The population value of every figure."""
    out = {}
    for k in KS:
        out[f"iid pass@{k}"] = 1 - special.beta(A, B + k) / special.beta(A, B)
        out[f"lattice pass@{k}"] = lattice_pass(k)
    out["iid samples to correct"] = sum(special.beta(A, B + j) / special.beta(A, B) for j in range(N))
    out["lattice samples to correct"] = sum(1 - lattice_pass(j) for j in range(N))
    out["ratio lattice / iid"] = out["lattice samples to correct"] / out["iid samples to correct"]
    return out


def groups(design: str, ps: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """``[problems, N]`` correctness of one group per problem, from the design's own codes."""
    d = get_design(design)
    s, m = np.repeat(seeds, N), np.tile(np.arange(N), len(ps))
    ns = np.full(len(s), N)
    u = d.start_codes(s, ns, m) if d.carries else d.step_uniforms(s, ns, m, np.zeros_like(m))
    return u.reshape(len(ps), N) < ps[:, None]


def first_correct(correct: np.ndarray) -> np.ndarray:
    """Samples to the first correct member, the cap N where none is."""
    return np.where(correct.any(axis=1), correct.argmax(axis=1) + 1, N).astype(np.float64)


def coverage(
    reps: int, problems: int, resamples: int, seed: int = 0, only: tuple[str, ...] | None = None
) -> dict[str, float]:
    """The share of ``reps`` simulated evaluations whose interval covers each figure's population value
    (``only``: just these figures, and just what they need)."""
    rng = np.random.default_rng(seed)
    true = truth()
    wanted = set(only or true)
    hits = dict.fromkeys(sorted(wanted, key=list(true).index), 0)
    for r in range(reps):
        ps = rng.beta(A, B, size=problems)
        seeds = rng.integers(0, 2**63, size=problems, dtype=np.uint64)
        spent = {}
        for design in ("iid", "lattice"):
            if not any(name.startswith(design) for name in wanted) and "ratio lattice / iid" not in wanted:
                continue
            c = groups(design, ps, seeds)
            for k in KS:
                if f"{design} pass@{k}" not in wanted:
                    continue
                values = per_group_pass_at_k(c, k, design)  # one group per problem
                est = bootstrap_pass_at_k([values[i : i + 1] for i in range(problems)], k, resamples=resamples, seed=r)
                hits[f"{design} pass@{k}"] += est.low <= true[f"{design} pass@{k}"] <= est.high
            spent[design] = first_correct(c)
            if f"{design} samples to correct" not in wanted:
                continue
            _, low, high = bca_interval(_mean, [spent[design]], resamples=resamples, seed=r)
            hits[f"{design} samples to correct"] += low <= true[f"{design} samples to correct"] <= high
        if "ratio lattice / iid" in wanted:
            _, low, high = fieller_ratio(spent["lattice"], spent["iid"])
            hits["ratio lattice / iid"] += low <= true["ratio lattice / iid"] <= high
    return {name: h / reps for name, h in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--problems", type=int, default=48)
    parser.add_argument("--resamples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    cov = coverage(args.reps, args.problems, args.resamples, args.seed)
    se = (0.95 * 0.05 / args.reps) ** 0.5
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    print(f"CPU: {cpu or platform.processor()}; {args.reps} replications of {args.problems} problems, "
          f"{args.resamples} resamples; standard error of a coverage at 0.95: {se:.3f}")  # fmt: skip
    print(f"{'figure':<28} {'population':>10} {'coverage':>9}")
    for name, c in cov.items():
        print(f"{name:<28} {truth()[name]:>10.4f} {c:>9.3f}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
