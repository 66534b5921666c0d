"""How often qmc-eval's 95% intervals cover the population value (docs/evaluation.md, "Intervals").

Simulated evaluations with a known answer, on three populations of problems — p ~ Beta(0.6, 1.4)
(``hard``: mean 0.3), Beta(2, 2) (``mixed``: 0.5) and Beta(4, 0.5) (``easy``: 0.89, most problems
solved at large k). Each problem has one group of N = 32 members per sampler, correct where the
member's code (its first uniform, from the design's own functions: ``lattice`` radical-inverse
codes, ``iid`` fresh uniforms) falls in [0, p) — a one-step model whose correct tokens come first
in the vocabulary, so a size-k lattice's pass@k is min(1, k·p). The same groups are read as a run of
``qmc-eval run --until-correct 1`` with the cap N (its ``first`` mode draws one group of 32 and
stops at the first correct member). Every figure is then scored by the report's own functions
(:func:`qmc_sampler.eval.reports.passk_report.summarize`,
:func:`qmc_sampler.eval.reports.until_report.summarize_until`),
and each printed interval is checked against the population value:

* ``pass@k`` (k = 1 … 32): i.i.d. 1 − E[(1 − p)^k]; lattice E[min(1, k·p)];
* ``solved within B`` (B = 1 … 32, the until report's solve rate): P(one of the first B members is
  correct), for a lattice the length of the union of the arcs [−φ2(i), −φ2(i) + p), i < B;
* ``samples to correct``: the mean over all problems with an unsolved problem counted as the cap,
  Σ_{j<N} (1 − P(solved within j)); ``…, both solved``: its mean and median over the problems both
  samplers solve (conditional on that, from the distribution of the first correct member);
* the ratios lattice / i.i.d. of those two means (the bounded-mean test inverted on L − r·I);
* ``samples saved @k``: how many fewer samples than k the lattice needs to reach i.i.d.'s pass@k,
  from the population curves (:func:`qmc_sampler.eval.stats.passk.samples_saved`); its coverage counts the
  replications that print a figure (``printed``: how many did).

Population values are integrals over p on 2^16 Beta quantiles spaced to resolve the tails
(:func:`quantile_grid`; tests/benchmarks/test_ci_coverage.py checks them against closed forms and quadrature).

    python benchmarks/ci_coverage.py [--reps 1000] [--problems 48] [--resamples 1000] [--populations hard,mixed,easy]
        [--figures ratio]
"""

from __future__ import annotations

import argparse
import platform
import time
from functools import cache
from typing import Any

import numpy as np
from qmc_sampler.eval.reports.passk_report import summarize
from qmc_sampler.eval.reports.until_report import summarize_until
from qmc_sampler.eval.runs.samples import ProblemGroups
from qmc_sampler.eval.stats.passk import samples_saved
from scipy import stats

from qmc_sampler import get_design, radical_inverse

POPULATIONS = {"hard": (0.6, 1.4), "mixed": (2.0, 2.0), "easy": (4.0, 0.5)}
N = 32
KS = (1, 2, 4, 8, 16, 32)  # what the report prints: pass@k, solved within B, samples saved at k ≥ 2
ROUND = 4  # --round-size of the simulated until run (what is generated past the answer; no figure)
GRID = 2**16
DESIGNS = ("iid", "lattice")


def arc_union(j: int, p: float | np.ndarray) -> np.ndarray:
    """P(one of a radical-inverse lattice's first j members lands in [0, p)), over the shift."""
    p = np.asarray(p, dtype=np.float64)
    if j == 0:
        return np.zeros_like(p)
    starts = np.sort(np.mod(-radical_inverse(np.arange(j)), 1.0))
    gaps = np.sort(np.diff(np.append(starts, starts[0] + 1.0)))  # the arcs cover Σ min(gap, p)
    below = np.searchsorted(gaps, p)  # gaps shorter than p count whole, the others p each
    return np.append(0.0, np.cumsum(gaps))[below] + p * (len(gaps) - below)


def quantile_grid(a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes p and weights for E[g(p)], p ~ Beta(a, b): the midpoint rule in z on [−9, 9] with p the
    Beta quantile of Φ(z), weighted by φ(z) — so the tails are resolved down to Φ(−9) ≈ 1e-19 (an easy
    task's lattice pass@16 misses 1 by 7e-7: a grid even in the quantile itself rounds it to 1)."""
    z = -9 + 18 * (np.arange(GRID) + 0.5) / GRID
    p = np.where(z < 0, stats.beta.ppf(stats.norm.cdf(z), a, b), stats.beta.isf(stats.norm.sf(z), a, b))
    weight = stats.norm.pdf(z)
    return p, weight / weight.sum()


def solved_within(design: str, j: int, p: np.ndarray) -> np.ndarray:
    """P(one of a group's first j members is correct | p)."""
    return arc_union(j, p) if design == "lattice" else 1.0 - (1.0 - p) ** j


@cache
def truth(population: str) -> dict[str, float | None]:
    """The population value of every figure (None: a samples-saved figure with no crossing)."""
    p, weight = quantile_grid(*POPULATIONS[population])

    def mean(g: np.ndarray) -> float:
        return float(g @ weight)

    hits = {d: np.array([solved_within(d, j, p) for j in range(N + 1)]) for d in DESIGNS}  # [N+1, GRID]
    out: dict[str, float | None] = {}
    for d in DESIGNS:
        for k in KS:
            out[f"{d} pass@{k}"] = mean(1 - (1 - p) ** k if d == "iid" else np.minimum(1.0, k * p))
    for d in DESIGNS:
        for b_ in KS:
            out[f"{d} solved within {b_}"] = mean(hits[d][b_])
    for d in DESIGNS:
        out[f"{d} samples to correct"] = sum(mean(1 - hits[d][j]) for j in range(N))
    both = mean(hits["iid"][N] * hits["lattice"][N])  # P(both samplers solve): independent groups given p
    for d in DESIGNS:
        other = hits["lattice" if d == "iid" else "iid"][N]
        cdf = np.array([mean(hits[d][j] * other) for j in range(N + 1)]) / both  # P(T ≤ j | both)
        out[f"{d} samples to correct, both solved"] = float(sum(1 - cdf[j] for j in range(N)))
        out[f"{d} median to correct, both solved"] = float(np.argmax(cdf >= 0.5))
    for suffix in ("", ", both solved"):
        out[f"ratio lattice / iid{suffix}"] = (
            out[f"lattice samples to correct{suffix}"] / out[f"iid samples to correct{suffix}"]  # type: ignore[operator]
        )
    curve = {k: out[f"lattice pass@{k}"] for k in KS}
    for k in KS[1:]:
        out[f"samples saved @{k}"] = samples_saved(curve, out[f"iid pass@{k}"], k)  # type: ignore[arg-type]
    return out


def groups(design: str, ps: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """``[problems, N]`` correctness of one group per problem, from the design's own codes."""
    d = get_design(design)
    s, m = np.repeat(seeds, N), np.tile(np.arange(N), len(ps))
    ns = np.full(len(s), N)
    u = d.start_codes(s, ns, m) if d.carries else d.step_uniforms(s, ns, m, np.zeros_like(m))
    return u.reshape(len(ps), N) < ps[:, None]


def until_records(design: str, correct: np.ndarray) -> list[dict[str, Any]]:
    """The records ``qmc-eval run --until-correct 1 --n 32 --round-size 4`` writes for these groups."""
    records = []
    for problem, row in enumerate(correct):
        first = int(row.argmax()) + 1 if row.any() else N
        for member in range(min(N, -(-first // ROUND) * ROUND)):  # whole rounds
            records.append({"sampler": design, "problem": problem, "group": 0, "member": member,
                            "round": member // ROUND, "score": bool(row[member]), "want": 1, "cap": N,
                            "round_size": ROUND})  # fmt: skip
    return records


def intervals(correct: dict[str, np.ndarray], resamples: int, wanted: set[str]) -> dict[str, tuple[float, float]]:
    """Every interval the reports print for these groups, by figure name (only what ``wanted`` needs:
    samples saved take both samplers' whole curves; a pass@k alone, its sampler at that k)."""
    out: dict[str, tuple[float, float]] = {}
    cells = {d: [ProblemGroups(d, str(i), row[None, :]) for i, row in enumerate(correct[d])] for d in DESIGNS}
    if any(name.startswith("samples saved") for name in wanted):
        reports = summarize(cells["iid"] + cells["lattice"], resamples=resamples)
    else:  # one sampler at a time: no samples-saved figures to compute
        reports = []
        for d in DESIGNS:
            ks = [k for k in KS if f"{d} pass@{k}" in wanted]
            reports += summarize(cells[d], ks=ks, resamples=resamples) if ks else []
    for r in reports:
        for k, (_, low, high) in r.curve.items():
            out[f"{r.sampler} pass@{k}"] = (low, high)
        for k, figure in r.saved.items():
            out[f"samples saved @{k}"] = (figure.low, figure.high)
    if any(not ("pass@" in name or name.startswith("samples saved")) for name in wanted):
        records = until_records("iid", correct["iid"]) + until_records("lattice", correct["lattice"])
        for r in summarize_until(records, resamples=resamples):
            for b_ in KS:
                out[f"{r.sampler} solved within {b_}"] = r.solve_rate[b_][1:]
            out[f"{r.sampler} samples to correct"] = r.spent_capped[1:]
            out[f"{r.sampler} samples to correct, both solved"] = r.mean_to_want[1:]
            out[f"{r.sampler} median to correct, both solved"] = r.median_to_want[1:]
            if r.ratio_capped is not None and r.ratio_mean is not None:
                out["ratio lattice / iid"] = r.ratio_capped[1:]
                out["ratio lattice / iid, both solved"] = r.ratio_mean[1:]
    return out


def coverage(
    reps: int,
    problems: int,
    resamples: int,
    seed: int = 0,
    population: str = "hard",
    only: tuple[str, ...] | None = None,
) -> dict[str, tuple[float, int]]:
    """Per figure, (the share of the ``reps`` simulated evaluations whose printed interval covers the
    population value, among those that print one; how many printed one). ``only``: just these figures.

    A samples-saved figure whose population has no crossing counts every printed interval as a miss.
    """
    rng = np.random.default_rng(seed)
    true = truth(population)
    wanted = set(only or true)
    hits = dict.fromkeys(sorted(wanted, key=list(true).index), 0)
    printed = dict.fromkeys(hits, 0)
    a, b = POPULATIONS[population]
    for _ in range(reps):
        ps = rng.beta(a, b, size=problems)
        seeds = rng.integers(0, 2**63, size=problems, dtype=np.uint64)
        found = intervals({d: groups(d, ps, seeds) for d in DESIGNS}, resamples, wanted)
        for name in hits:
            if name in found and not np.isnan(found[name]).any():
                printed[name] += 1
                value = true[name]
                hits[name] += value is not None and found[name][0] <= value <= found[name][1]
    return {name: (hits[name] / printed[name] if printed[name] else float("nan"), printed[name]) for name in hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--problems", type=int, default=48)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--populations", default="hard,mixed,easy", help="comma-separated: hard, mixed, easy")
    parser.add_argument("--figures", default="", help="comma-separated prefixes of the figures to measure "
                        "(e.g. 'ratio', 'lattice pass@'); default: every figure")  # fmt: skip
    args = parser.parse_args()
    names = args.populations.split(",")
    prefixes = [f for f in args.figures.split(",") if f]
    only = tuple(n for n in truth(names[0]) if any(n.startswith(f) for f in prefixes)) if prefixes else None
    if prefixes and not only:
        parser.error(f"--figures {args.figures!r} matches no figure; figures: {', '.join(truth(names[0]))}")
    start = time.perf_counter()
    results = {pop: coverage(args.reps, args.problems, args.resamples, args.seed, pop, only) for pop in names}
    se = (0.95 * 0.05 / args.reps) ** 0.5
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    print(f"CPU: {cpu or platform.processor()}; {args.reps} replications of {args.problems} problems, "
          f"{args.resamples} resamples; standard error of a coverage at 0.95: {se:.3f}")  # fmt: skip
    head = "".join(f"  {f'{pop} Beta{POPULATIONS[pop]}':>26}" for pop in names)
    print(f"{'figure (population value, coverage)':<38}{head}")
    for name in results[names[0]]:
        cells = []
        for pop in names:
            value, (cov, printed) = truth(pop)[name], results[pop][name]
            shown = "none" if value is None else f"{value:.4f}"
            note = "" if printed == args.reps else f" ({printed})"
            cells.append(f"{shown:>9} {cov:>6.3f}{note:<7}".rjust(26))
        print(f"{name:<38}" + "".join(f"  {c}" for c in cells))
    took = time.perf_counter() - start
    print(f"(in parentheses: how many replications printed the figure, where not all did; {took:.0f} s)")


if __name__ == "__main__":
    main()
