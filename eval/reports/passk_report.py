"""pass@k tables and plots from samples (``qmc-eval score`` / ``qmc-eval passk``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from qmc_sampler.eval.runs.samples import ProblemGroups, SampleFileError
from qmc_sampler.eval.stats.passk import (
    SamplesSaved,
    bootstrap_pass_at_k,
    bootstrap_samples_saved,
    per_group_pass_at_k,
    union_bound,
    valid_ks,
)

from qmc_sampler.designs import METHODS

__all__ = ["SamplerReport", "as_json", "format_table", "plot", "summarize"]


@dataclass(frozen=True)
class SamplerReport:
    """One sampler's pass@k curve over the problems, with CIs and the union bound.

    ``saved`` maps an i.i.d. budget k to how many fewer samples this sampler
    needs to reach i.i.d.'s pass@k (with its interval,
    :func:`qmc_sampler.eval.stats.passk.bootstrap_samples_saved`), where there is a
    real crossing (:func:`qmc_sampler.eval.stats.passk.samples_saved`).
    """

    sampler: str
    n: int
    problems: int
    groups: int
    p_hat: float
    curve: dict[int, tuple[float, float, float]]  # k -> (value, low, high)
    bound: dict[int, float]
    saved: dict[int, SamplesSaved] = field(default_factory=dict)

    @property
    def saved_percent(self) -> float | None:
        """Fewer samples than i.i.d. needs for its pass@N, in percent (None: no real crossing)."""
        figure = self.saved.get(self.n)
        return None if figure is None else figure.value


def summarize(cells: list[ProblemGroups], ks: list[int] | None = None, resamples: int = 2000) -> list[SamplerReport]:
    """Estimate each sampler's pass@k (its own estimator) over the shared problems.

    Each pass@k carries the interval of a mean of [0, 1] values
    (:func:`qmc_sampler.eval.stats.passk.bootstrap_pass_at_k`), each samples-saved figure its own
    (:func:`qmc_sampler.eval.stats.passk.bootstrap_samples_saved`).

    Args:
        cells: per-(sampler, problem) correctness arrays.
        ks: the k to report (default: every power of two the design allows, and N).
        resamples: Monte Carlo draws of each interval.

    Raises:
        SampleFileError: k > N, or a k the design cannot estimate.
    """
    by_sampler: dict[str, list[ProblemGroups]] = {}
    pooled: dict[str, list[np.ndarray]] = {}
    for c in cells:
        by_sampler.setdefault(c.sampler, []).append(c)
        pooled.setdefault(c.problem, []).append(c.correct.ravel())
    # Every design is an exact sampler, so p̂ of a problem pools all its samples.
    p_pooled = {problem: float(np.concatenate(parts).mean()) for problem, parts in pooled.items()}
    reports = []
    values: dict[str, dict[str, dict[int, np.ndarray]]] = {}  # sampler -> problem -> k -> per-group values
    for sampler, problems in sorted(by_sampler.items(), key=lambda kv: (kv[0] != "iid", kv[0])):
        sizes = {p.correct.shape[1] for p in problems}
        if len(sizes) != 1:
            raise SampleFileError(f"sampler {sampler!r} has groups of sizes {sorted(sizes)} across problems")
        n = sizes.pop()
        design = _design(sampler)
        wanted = ks or [k for k in valid_ks(design, n) if k & (k - 1) == 0 or k == n]
        for k in wanted:
            if k > n:
                raise SampleFileError(f"k={k} exceeds the group size N={n} of sampler {sampler!r}")
        try:
            values[sampler] = {
                p.problem: {k: per_group_pass_at_k(p.correct, k, design) for k in wanted} for p in problems
            }
        except ValueError as e:
            raise SampleFileError(str(e)) from None
        curve, bound = {}, {}
        for k in wanted:
            est = bootstrap_pass_at_k([values[sampler][p.problem][k] for p in problems], k, resamples=resamples)
            curve[k] = (est.value, est.low, est.high)
            bound[k] = union_bound([p_pooled[p.problem] for p in problems], k)
        p_hat = float(np.mean([p.correct.mean() for p in problems]))
        groups = int(np.mean([p.correct.shape[0] for p in problems]))
        reports.append(SamplerReport(sampler, n, len(problems), groups, p_hat, curve, bound))
    return [_with_savings(r, reports, values, resamples) for r in reports]


def _design(sampler: str) -> str:
    # Samplers from elsewhere with names that are not designs are scored as i.i.d.
    return sampler if sampler in METHODS else "iid"


def _with_savings(
    report: SamplerReport,
    reports: list[SamplerReport],
    values: dict[str, dict[str, dict[int, np.ndarray]]],
    resamples: int,
) -> SamplerReport:
    """Attach samples-saved figures against i.i.d. at each k both curves have (k ≥ 2)."""
    baseline = next((r for r in reports if r.sampler == "iid"), None)
    if baseline is None or report.sampler == "iid" or report.n != baseline.n:
        return report
    shared = sorted(set(values[report.sampler]) & set(values["iid"]))
    if not shared:
        return report
    saved = {}
    for k in sorted(set(baseline.curve) & set(report.curve)):
        if k < 2:
            continue
        figure = bootstrap_samples_saved(
            [{kk: v for kk, v in values[report.sampler][p].items() if kk <= k} for p in shared],
            [values["iid"][p][k] for p in shared],
            k,
            resamples=resamples,
            same_model=report.sampler in METHODS,  # a design of qmc-sampler: exact draws of the same model
        )
        if figure is not None:
            saved[k] = figure
    return replace(report, saved=saved)


def format_table(reports: list[SamplerReport]) -> str:
    """A fixed-width table: one row per k, a column per sampler, and the union bound."""
    ks = sorted({k for r in reports for k in r.curve})
    head = f"{'k':>4}  " + "  ".join(f"{r.sampler:>22}" for r in reports) + f"  {'bound min(1,k·p̂)':>18}"
    lines = [head, "-" * len(head)]
    for k in ks:
        cells = []
        for r in reports:
            v = r.curve.get(k)
            cells.append(f"{v[0]:.3f} [{v[1]:.3f},{v[2]:.3f}]".rjust(22) if v else " " * 22)
        bound = next((r.bound[k] for r in reports if k in r.bound), float("nan"))
        lines.append(f"{k:>4}  " + "  ".join(cells) + f"  {bound:>18.3f}")
    lines.append("")
    for r in reports:
        figure = r.saved.get(r.n)
        saved = (
            ""
            if figure is None
            else f"; reaches i.i.d.'s pass@{r.n} with {figure.value:.0f}% fewer samples "
            f"[{figure.low:.0f}%, {figure.high:.0f}%]"
        )
        if r.sampler != "iid" and figure is None and any(x.sampler == "iid" and x.n == r.n for x in reports):
            saved = f"; no samples-saved claim against i.i.d.'s pass@{r.n} (no crossing below k = {r.n})"
        lines.append(
            f"{r.sampler}: p̂ = {r.p_hat:.3f} over {r.problems} problems × {r.groups} group(s) of n = {r.n}{saved}"
        )
    return "\n".join(lines)


def as_json(reports: list[SamplerReport]) -> list[dict[str, Any]]:
    """The reports as JSON-ready dicts (``qmc-eval score --json``)."""
    return [
        {
            "sampler": r.sampler,
            "n": r.n,
            "problems": r.problems,
            "groups": r.groups,
            "p_hat": r.p_hat,
            "pass_at_k": {str(k): {"value": v[0], "ci_low": v[1], "ci_high": v[2]} for k, v in r.curve.items()},
            "union_bound": {str(k): b for k, b in r.bound.items()},
            "samples_saved_percent": r.saved_percent,
            "samples_saved": {
                str(k): {
                    "target": f.target,
                    "percent": f.value,
                    "ci_low": f.low,
                    "ci_high": f.high,
                }
                for k, f in r.saved.items()
            },
        }
        for r in reports
    ]


def plot(reports: list[SamplerReport], path: str, title: str = "") -> None:
    """pass@k against k (log axis) with CI bands and the union bound; written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in reports:
        ks = sorted(r.curve)
        values = [r.curve[k][0] for k in ks]
        ax.plot(ks, values, marker="o", label=r.sampler)
        ax.fill_between(ks, [r.curve[k][1] for k in ks], [r.curve[k][2] for k in ks], alpha=0.2)
    ref = max(reports, key=lambda r: len(r.bound))
    ks = sorted(ref.bound)
    ax.plot(ks, [ref.bound[k] for k in ks], "k--", label="union bound min(1, k·p̂)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (attempts)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
