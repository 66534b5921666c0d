"""A plan's numbers from an i.i.d. pilot: the effect the paper claims, the noise, the seeds to detect it.

    python benchmarks/grpo/power.py PILOT/steps.jsonl [PILOT2/steps.jsonl …] [--floor-sd 0.023] [--alpha 0.05]
        [--power 0.8]

With ``--paired-with B/steps.jsonl …`` (an A/A calibration: the same settings and training seeds, another
``--rollout-stream``) the SD is that of the paired AUC differences of iid runs with the same seed: the SD a
design − iid difference has under no effect, with no √2 bound.

(Several files: pilot runs written side by side into folders of their own — ``--only iid:K``, a seed
in each — with the same settings; a seed in two files is refused: it is one run.)

QuasiMoTTo's claim for GRPO is the i.i.d. held-out reward in half the training steps. With c(t) the
pilot's mean i.i.d. held-out curve (linear between its evaluation points), a design with that
effect has the curve c(min(2t, T)) — held at c(T) past the pilot's last step, where nothing was
observed: conservative — and the effect on the primary metric (the area under the curve over [0, T],
divided by T) is δ = AUC(c(min(2t, T))) − AUC(c). The SD of a seed's paired AUC difference is taken
as the largest of √2 × the SD of the pilot runs' AUCs (differences of independent runs; pairing by
seed can only lower it), and ``--floor-sd`` (a floor from the evaluation's own binomial noise: the
plan says how it is computed). Seeds: the least n at which a two-sided paired t-test has the power
asked (:func:`seeds_needed`), never fewer than :data:`LEAST_SEEDS`, and refused above the rule's
``SIGN_FLIP_MOST`` (the exact test lists every sign pattern of at most that many seeds).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

LEAST_SEEDS = 10


def half_the_steps_effect(curve: dict[int, float], steps: int) -> float:
    """δ: the AUC of the curve run at twice the speed (c(min(2t, T)), sampled at the same evaluation
    points) less the AUC of the curve itself (module docstring)."""
    from grpo.report import auc

    xs = sorted(curve)
    faster = {x: float(np.interp(min(2 * x, steps), xs, [curve[x] for x in xs])) for x in xs}
    return auc(faster, steps) - auc(curve, steps)


def seeds_needed(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Paired seeds for a two-sided test at ``alpha`` to detect ``effect`` with ``power``, at least
    :data:`LEAST_SEEDS`: the least n at which the paired t-test has that power (the noncentral t with
    n − 1 degrees of freedom and noncentrality effect·√n / sd; Cohen 1988, "Statistical Power Analysis",
    ch. 2). The exact sign-flip test the rule uses has about the t-test's power from 10 seeds on (its
    Pitman efficiency against it is 1 for normal differences), and no more.

    Raises:
        ValueError: a non-positive effect or SD, or alpha / power outside (0, 1).
    """
    from scipy.stats import nct, norm, t

    if not (effect > 0 and sd > 0 and 0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"need effect > 0, sd > 0 and alpha, power in (0, 1); got {effect}, {sd}, {alpha}, {power}")
    # From power 0.5 on, the t-test (never more powerful than the z-test) needs at least the normal
    # approximation's n, floored: start there. Below, the approximation can overshoot: start at 2.
    z = norm.ppf(1 - alpha / 2) + norm.ppf(power)
    n = max(2, math.floor((z * sd / effect) ** 2)) if power >= 0.5 else 2
    while True:
        df, shift = n - 1, effect * math.sqrt(n) / sd
        critical = t.ppf(1 - alpha / 2, df)
        if nct.sf(critical, df, shift) + nct.cdf(-critical, df, shift) >= power:
            return max(n, LEAST_SEEDS)
        n += 1


def main(argv: list[str] | None = None) -> int:
    """Print the pilot's curve, δ, the SDs and the seeds needed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from qmc_sampler.eval.stats.paired import SIGN_FLIP_MOST

    from grpo.plan import OneLineParser
    from grpo.report import auc

    p = OneLineParser(prog="power.py", description=__doc__.splitlines()[0])
    p.add_argument("steps_jsonl", nargs="+", help="pilot files (several: distinct iid seeds, the same settings)")
    p.add_argument(
        "--paired-with",
        nargs="+",
        default=None,
        metavar="STEPS_JSONL",
        help="an A/A calibration: files of the same settings but another --rollout-stream; the SD is then that "
        "of the paired differences of iid runs with the same seed (no √2 bound)",
    )
    p.add_argument("--floor-sd", type=float, default=0.0)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--power", type=float, default=0.8)
    args = p.parse_args(argv)
    ident, runs = _iid_runs(args.steps_jsonl, p)
    steps = ident["steps"]
    if args.paired_with:
        other_ident, others = _iid_runs(args.paired_with, p)
        if {**other_ident, "rollout_stream": None} != {**ident, "rollout_stream": None}:
            p.error("--paired-with: its files were written with other settings than the pilot's (not only the stream)")
        if other_ident.get("rollout_stream") == ident.get("rollout_stream"):
            p.error("--paired-with: its files draw the same --rollout-stream as the pilot's: the same runs")
        pairs = sorted(set(runs) & set(others))
        if len(pairs) < 2:
            p.error(f"--paired-with: {len(pairs)} seed(s) run in both streams; an SD needs 2 pairs")
        mixed = [s for s in pairs if runs[s]["cpu"] != others[s]["cpu"]]
        if mixed:  # a machine's own numerics move a run too: that noise is then in the differences and their SD
            cpus = "; ".join(f"seed {s}: {runs[s]['cpu']} and {others[s]['cpu']}" for s in mixed)
            print(f"warning: {len(mixed)} of {len(pairs)} pairs ran on two CPUs ({cpus}): their differences "
                  "hold the machines' difference too", flush=True)  # fmt: skip
        diffs = [auc(others[s]["heldout"], steps) - auc(runs[s]["heldout"], steps) for s in pairs]
        pilot_sd = float(np.std(diffs, ddof=1))
        where = f"A/A differences (seeds {pairs}): {', '.join(f'{d:+.4f}' for d in diffs)}; their SD {pilot_sd:.4f}"
        runs = {**{("a", s): r for s, r in runs.items()}, **{("b", s): r for s, r in others.items()}}
    else:
        areas = [auc(run["heldout"], steps) for run in runs.values()]
        pilot_sd = math.sqrt(2) * float(np.std(areas, ddof=1)) if len(areas) > 1 else 0.0
        where = f"AUC per run: {', '.join(f'{a:.4f}' for a in areas)}; √2·SD {pilot_sd:.4f}"
    points = sorted(next(iter(runs.values()))["heldout"])
    mean = {x: float(np.mean([run["heldout"][x] for run in runs.values()])) for x in points}
    sd = max(pilot_sd, args.floor_sd)
    effect = half_the_steps_effect(mean, steps)
    if effect <= 0:
        p.error(f"the pilot's mean curve does not rise (δ = {effect:+.4f}): no effect to plan for")
    if sd <= 0:
        p.error(f"{len(runs)} pilot run(s) give no SD and --floor-sd is {args.floor_sd}: give two runs or a floor")
    print(f"iid runs: {len(runs)}; mean held-out curve: " + ", ".join(f"{x}: {mean[x]:.3f}" for x in points))
    print(f"{where}; floor {args.floor_sd:.4f}")
    print(f"δ (the curve in half the steps) = {effect:+.4f}; planning SD {sd:.4f}")
    n = seeds_needed(sd, effect, args.alpha, args.power)
    if n > SIGN_FLIP_MOST:
        p.error(
            f"{n} seeds needed for α = {args.alpha}, power {args.power}: more than the {SIGN_FLIP_MOST} the rule's "
            "exact sign-flip test takes; plan a larger effect or less noise (more held-out problems)"
        )
    print(f"seeds for α = {args.alpha}, power {args.power} (paired t-test's power): {n}")
    return 0


def _iid_runs(names: list[str], p: Any) -> tuple[dict[str, Any], dict[int, dict]]:
    """The identity and the finished iid runs (by seed) of files written with the same settings; a seed
    in two files is refused (the same settings and seed are the same run: counted twice, it lowers the SD)."""
    from grpo.records import read_lines, run_cpu
    from grpo.report import curves

    runs: dict[int, dict] = {}
    idents = []
    for name in names:
        try:
            records, _ = read_lines(Path(name))
        except (OSError, ValueError) as e:
            p.error(f"{name}: {e}")
        if not records or records[0].get("type") != "header":
            p.error(f"{name}: no header line: not a grpo_steps.py file")
        ident = records[0]["identity"]
        idents.append(ident)
        found = curves(records, ident["designs"], list(range(ident["seeds"])))["iid"]
        for run in found.values():
            run["cpu"] = run_cpu(run.get("end"), records[0])
        twice = sorted(set(found) & set(runs))
        if twice:
            p.error(f"{name}: iid seed {twice[0]} is also in an earlier file: the same run, counted once only")
        runs |= found
    if any(other != idents[0] for other in idents):
        p.error("the pilot files were written with different settings")
    if not runs:
        p.error(f"{', '.join(names)}: no finished iid run")
    return idents[0], runs


if __name__ == "__main__":
    sys.exit(main())
