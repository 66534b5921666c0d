"""pass@k tables and plots from samples (``qmc-eval score`` / ``qmc-eval passk``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from qmc_sampler.eval.passk import bootstrap_pass_at_k, per_group_pass_at_k, samples_saved, union_bound, valid_ks
from qmc_sampler.eval.samples import ProblemGroups, SampleFileError

from qmc_sampler.designs import METHODS

__all__ = ["SamplerReport", "as_json", "format_table", "plot", "summarize"]


@dataclass(frozen=True)
class SamplerReport:
    """One sampler's pass@k curve over the problems, with CIs and the union bound."""

    sampler: str
    n: int
    problems: int
    groups: int
    p_hat: float
    curve: dict[int, tuple[float, float, float]]  # k -> (value, low, high)
    bound: dict[int, float]
    saved_percent: float | None  # fewer samples than i.i.d. needs for its pass@N


def summarize(cells: list[ProblemGroups], ks: list[int] | None = None, resamples: int = 2000) -> list[SamplerReport]:
    """Estimate each sampler's pass@k (its own estimator) over the shared problems.

    Args:
        cells: per-(sampler, problem) correctness arrays.
        ks: the k to report (default: every k the design allows, powers of two for i.i.d.).

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
    for sampler, problems in sorted(by_sampler.items(), key=lambda kv: (kv[0] != "iid", kv[0])):
        sizes = {p.correct.shape[1] for p in problems}
        if len(sizes) != 1:
            raise SampleFileError(f"sampler {sampler!r} has groups of sizes {sorted(sizes)} across problems")
        n = sizes.pop()
        # Samplers from elsewhere with names that are not designs are scored as i.i.d.
        design = sampler if sampler in METHODS else "iid"
        wanted = ks or [k for k in valid_ks(design, n) if k & (k - 1) == 0 or k == n]
        for k in wanted:
            if k > n:
                raise SampleFileError(f"k={k} exceeds the group size N={n} of sampler {sampler!r}")
        p_hat = np.array([p.correct.mean() for p in problems])
        curve, bound = {}, {}
        for k in wanted:
            try:
                per_group = [per_group_pass_at_k(p.correct, k, design) for p in problems]
            except ValueError as e:
                raise SampleFileError(str(e)) from None
            est = bootstrap_pass_at_k(per_group, k, resamples=resamples)
            curve[k] = (est.value, est.low, est.high)
            bound[k] = union_bound([p_pooled[p.problem] for p in problems], k)
        reports.append(
            SamplerReport(
                sampler,
                n,
                len(problems),
                int(np.mean([p.correct.shape[0] for p in problems])),
                float(p_hat.mean()),
                curve,
                bound,
                None,
            )
        )
    baseline = next((r for r in reports if r.sampler == "iid"), None)
    if baseline is None or baseline.n not in baseline.curve:
        return reports
    target = baseline.curve[baseline.n][0]
    return [
        r
        if r.sampler == "iid" or r.n != baseline.n
        else SamplerReport(
            **(asdict(r) | {"saved_percent": samples_saved({k: v[0] for k, v in r.curve.items()}, target, r.n)})
        )
        for r in reports
    ]


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
        saved = (
            ""
            if r.saved_percent is None
            else f"; reaches i.i.d.'s pass@{r.n} with {r.saved_percent:.0f}% fewer samples"
        )
        if r.sampler != "iid" and r.saved_percent is None and any(x.sampler == "iid" for x in reports):
            saved = f"; does not reach i.i.d.'s pass@{r.n} below k = {r.n}"
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
