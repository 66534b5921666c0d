"""Samples to ``want`` correct, per sampler, from a run of ``qmc-eval run --until-correct K``.

Per sampler, over problems: the samples spent to K correct (capped: a problem not
solved within the cap counts the cap — the mean of this is Σ_{j<N} (1 − pass@j) of
the sampler's design for K = 1), its mean and median over the problems every sampler
solved, the solve rate at every budget B (the design's pass@B for K = 1), and the
ratio of each sampler's figures to i.i.d.'s. Intervals are over problems: a mean and a solve rate
take the interval for a mean of bounded values (each problem's samples to K lie in [K, cap], its
solve rate in [0, 1]: :func:`qmc_sampler.eval.stats.passk.bounded_mean_interval`), which keeps its width
where every problem is solved at once or none within B; the median takes the order-statistic
interval (:func:`qmc_sampler.eval.stats.passk.median_interval`), and a ratio of means, paired by problem,
inverts the bounded-mean test on a − r·b (:func:`qmc_sampler.eval.stats.passk.bounded_ratio_interval`,
Fieller's idea with that test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from qmc_sampler.eval.runs.samples import SampleFileError
from qmc_sampler.eval.runs.sequential import load_until
from qmc_sampler.eval.stats.passk import bounded_mean_interval, bounded_ratio_interval, median_interval

__all__ = ["UntilReport", "format_until", "is_until", "summarize_until", "until_as_json"]

Interval = tuple[float, float, float]  # value, low, high


@dataclass(frozen=True)
class UntilReport:
    """One sampler's samples-to-K figures (``ratio_*`` against i.i.d.; None for i.i.d. itself)."""

    sampler: str
    want: int
    cap: int
    round_size: int
    problems: int
    solved: int
    both: int  # problems every sampler solved
    spent_capped: Interval  # mean samples to K over all problems, unsolved counted as the cap
    mean_to_want: Interval  # over problems every sampler solved
    median_to_want: Interval
    generated: float  # members generated per problem (whole rounds)
    solve_rate: dict[int, Interval]  # budget B -> share of problems solved within B samples
    ratio_capped: Interval | None = None
    ratio_mean: Interval | None = None


def is_until(records: list[dict[str, Any]]) -> bool:
    """Whether a samples file holds a sequential run (its records carry ``want``)."""
    return any("want" in r for r in records)


def summarize_until(records: list[dict[str, Any]], resamples: int = 2000) -> list[UntilReport]:
    """Samples-to-K figures of every sampler of a sequential run (i.i.d. first).

    Raises:
        SampleFileError: records of different ``want``/``cap``/``round_size``, or samplers that
            do not share their problems.
    """
    settings = {(r.get("want"), r.get("cap"), r.get("round_size")) for r in records}
    if len(settings) != 1 or None in next(iter(settings)):
        raise SampleFileError(f"a sequential run needs one want/cap/round_size; found {sorted(map(str, settings))}")
    want, cap, round_size = next(iter(settings))
    groups = load_until(records)
    per: dict[str, dict[str, list[tuple[int | None, int]]]] = {}
    for (sampler, problem, _), members in groups.items():
        hits, first = 0, None
        for position, r in enumerate(members, start=1):
            hits += bool(r["score"])
            if hits == want:
                first = position
                break
        per.setdefault(sampler, {}).setdefault(problem, []).append((first, len(members)))
    samplers = sorted(per, key=lambda s: (s != "iid", s))
    problems = sorted(set.intersection(*(set(v) for v in per.values())))
    if not problems:
        raise SampleFileError("the samplers of this run share no problem")

    def to_want(sampler: str, problem: str) -> float:  # capped, mean over the problem's groups
        return float(np.mean([cap if f is None else f for f, _ in per[sampler][problem]]))

    def solved(sampler: str, problem: str) -> bool:
        return all(f is not None for f, _ in per[sampler][problem])

    both = [p for p in problems if all(solved(s, p) for s in samplers)]
    capped = {s: np.array([to_want(s, p) for p in problems]) for s in samplers}
    solved_to = {s: np.array([to_want(s, p) for p in both]) for s in samplers}
    budgets = list(range(1, cap + 1))
    reports = []
    for s in samplers:
        firsts = [[f for f, _ in per[s][p]] for p in problems]
        rate = {}
        for b in budgets:
            hit = np.array([np.mean([f is not None and f <= b for f in fs]) for fs in firsts])
            rate[b] = bounded_mean_interval(hit, resamples=resamples)
        baseline = s != "iid" and "iid" in per
        reports.append(
            UntilReport(
                sampler=s, want=want, cap=cap, round_size=round_size, problems=len(problems),
                solved=sum(solved(s, p) for p in problems), both=len(both),
                spent_capped=bounded_mean_interval(capped[s], lo=want, hi=cap, resamples=resamples),
                mean_to_want=_or_nan(solved_to[s], want, cap, resamples),
                median_to_want=median_interval(solved_to[s]) if both else (float("nan"),) * 3,
                generated=float(np.mean([np.mean([g for _, g in per[s][p]]) for p in problems])),
                solve_rate=rate,
                ratio_capped=_ratio(capped[s], capped["iid"], want, cap, resamples) if baseline else None,
                ratio_mean=_ratio(solved_to[s], solved_to["iid"], want, cap, resamples) if baseline else None,
            )
        )  # fmt: skip
    return reports


def _ratio(a: np.ndarray, b: np.ndarray, want: int, cap: int, resamples: int) -> Interval:
    return bounded_ratio_interval(a, b, lo=want, hi=cap, resamples=resamples)  # NaN where no problem


def _or_nan(values: np.ndarray, want: int, cap: int, resamples: int) -> Interval:
    if len(values) == 0:
        return float("nan"), float("nan"), float("nan")
    return bounded_mean_interval(values, lo=want, hi=cap, resamples=resamples)


def _fmt(v: Interval, digits: int = 2) -> str:
    return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}, {v[2]:.{digits}f}]"


def format_until(reports: list[UntilReport]) -> str:
    """A table of the figures, then the solve rate at powers-of-two budgets and the ratios."""
    r0 = reports[0]
    k = r0.want
    head = (
        f"samples to {k} correct (cap {r0.cap}, rounds of {r0.round_size}); {r0.problems} problems, "
        f"{r0.both} solved by every sampler; 95% intervals over problems (means: bounded-mean bootstrap, "
        "medians: order statistics, ratios: bounded-mean test inverted)"
    )
    lines = [head, ""]
    lines.append(f"{'sampler':>12}  {'solved':>7}  {'mean, all (unsolved = cap)':>26}  "
                 f"{'mean, solved by all':>22}  {'median, solved by all':>22}  {'generated':>9}")  # fmt: skip
    for r in reports:
        lines.append(
            f"{r.sampler:>12}  {r.solved:>3}/{r.problems:<3}  {_fmt(r.spent_capped):>26}  "
            f"{_fmt(r.mean_to_want):>22}  {_fmt(r.median_to_want, 1):>22}  {r.generated:>9.2f}"
        )
    budgets = [b for b in sorted(r0.solve_rate) if b & (b - 1) == 0 or b == r0.cap]
    lines += ["", "solved within B samples: " + "  ".join(f"B={b}" for b in budgets)]
    for r in reports:
        lines.append(f"{r.sampler:>12}  " + "  ".join(f"{r.solve_rate[b][0]:.3f}" for b in budgets))
    for r in reports:
        if r.ratio_capped is not None:
            lines.append(
                f"\n{r.sampler} / iid: samples to {k} correct {_fmt(r.ratio_mean)} on the {r.both} problems both "
                f"solve; {_fmt(r.ratio_capped)} over all {r.problems} (unsolved = cap)"
            )
    return "\n".join(lines)


def until_as_json(reports: list[UntilReport]) -> list[dict[str, Any]]:
    """The reports as JSON-ready dicts (``qmc-eval score --json`` of a sequential run)."""

    def iv(v: Interval | None) -> dict[str, float] | None:
        return None if v is None else {"value": v[0], "ci_low": v[1], "ci_high": v[2]}

    return [
        {
            "sampler": r.sampler, "want": r.want, "cap": r.cap, "round_size": r.round_size,
            "problems": r.problems, "solved": r.solved, "solved_by_every_sampler": r.both,
            "samples_to_want_capped_mean": iv(r.spent_capped),
            "samples_to_want_mean_solved_by_all": iv(r.mean_to_want),
            "samples_to_want_median_solved_by_all": iv(r.median_to_want),
            "generated_per_problem": r.generated,
            "solve_rate": {str(b): iv(v) for b, v in r.solve_rate.items()},
            "ratio_to_iid_capped_mean": iv(r.ratio_capped),
            "ratio_to_iid_mean_solved_by_all": iv(r.ratio_mean),
        }
        for r in reports
    ]  # fmt: skip
