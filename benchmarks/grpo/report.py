"""The report of the finished runs: per-design table, the pre-registered paired comparison with iid, the plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from grpo.records import END, STEP, read_lines

BOOTSTRAP = 10_000  # resampled means of the descriptive interval
LEVEL = 0.95


def curves(records: list[dict[str, Any]], designs: list[str], seeds: list[int]) -> dict[str, dict[int, dict]]:
    """design → seed → {"steps": [...], "train": [...], "heldout": {step: reward}} from finished runs."""
    finished = {(r["design"], r["seed"]) for r in records if r.get("type") == END}
    out: dict[str, dict[int, dict]] = {d: {} for d in designs}
    for r in records:
        if r.get("type") != STEP or (r["design"], r["seed"]) not in finished or r["design"] not in out:
            continue
        run = out[r["design"]].setdefault(r["seed"], {"steps": [], "rows": [], "heldout": {}})
        if "reward_mean" in r:
            run["steps"].append(r["step"])
            run["rows"].append(r)
        if r["heldout_reward"] is not None:
            run["heldout"][r["step"]] = r["heldout_reward"]
    return out


def auc(heldout: dict[int, float], steps: int) -> float:
    """Trapezoid area under the held-out curve over [0, steps], divided by steps (a mean reward)."""
    xs = sorted(heldout)
    ys = [heldout[x] for x in xs]
    return float(np.sum((np.diff(xs)) * (np.array(ys[1:]) + np.array(ys[:-1])) / 2) / steps)


def reach_step(heldout: dict[int, float], target: float) -> int | None:
    """The first evaluation step whose held-out reward is at least ``target`` (None: never)."""
    return next((s for s in sorted(heldout) if heldout[s] >= target - 1e-12), None)


def table(runs: dict[str, dict[int, dict]], steps: int) -> str:
    """Per design, means over seeds: final and mean held-out reward, training figures, cost."""
    head = (
        f"{'design':>10}  {'seeds':>5}  {'final held-out':>14}  {'held-out AUC':>12}  {'train reward':>12}  "
        f"{'zero-var':>8}  {'distinct/group':>14}  {'tokens/step':>11}  {'s/step':>6}  {'CPU s/step':>10}"
    )
    lines = [head, "-" * len(head)]
    for design, by_seed in runs.items():
        if not by_seed:
            continue
        rows = [row for run in by_seed.values() for row in run["rows"]]
        final = np.mean([run["heldout"][steps] for run in by_seed.values()])
        area = np.mean([auc(run["heldout"], steps) for run in by_seed.values()])
        mean = {
            k: np.mean([row[k] for row in rows])
            for k in ("reward_mean", "zero_var_share", "distinct_per_group", "tokens", "wall_s", "cpu_s")
        }
        lines.append(
            f"{design:>10}  {len(by_seed):>5}  {final:14.3f}  {area:12.3f}  {mean['reward_mean']:12.3f}  "
            f"{mean['zero_var_share']:8.3f}  {mean['distinct_per_group']:14.2f}  {mean['tokens']:11.0f}  "
            f"{mean['wall_s']:6.1f}  {mean['cpu_s']:10.1f}"
        )
    return "\n".join(lines)


def comparison(runs: dict[str, dict[int, dict]], steps: int) -> str:
    """The pre-registered comparison of each design with iid, paired by seed (the script's docstring)."""
    from qmc_sampler.eval.stats.paired import bootstrap_mean_interval, sign_flip_p

    lines = []
    base = runs["iid"]
    for design, by_seed in runs.items():
        if design == "iid":
            continue
        seeds = sorted(set(base) & set(by_seed))
        if not seeds:
            lines.append(f"{design} − iid: no seed finished for both")
            continue
        rng = np.random.default_rng(0)  # the same resamples on every rerun
        for name, value in (
            ("final held-out reward", lambda run: run["heldout"][steps]),
            ("held-out AUC", lambda run: auc(run["heldout"], steps)),
        ):
            diffs = np.array([value(by_seed[s]) - value(base[s]) for s in seeds])
            ci = bootstrap_mean_interval(diffs, rng, resamples=BOOTSTRAP, level=LEVEL)
            n = f"{len(seeds)} seed{'s' * (len(seeds) > 1)}"
            p_value = sign_flip_p(diffs)
            test = (
                f"exact sign-flip p = {p_value:.3f} (two-sided, 2^{len(seeds)} flips; least possible "
                f"{2 / 2 ** len(seeds):.3f})"
                if p_value is not None
                else "sign-flip p not computed (over 20 seeds)"
            )
            where = (
                f"descriptive percentile bootstrap [{ci[0]:+.3f}, {ci[1]:+.3f}], not a {LEVEL:.0%} interval"
                if ci
                else "no interval with 1 seed"
            )
            per_seed = ", ".join(f"{d:+.3f}" for d in diffs)
            lines.append(f"{design} − iid, {name}: {diffs.mean():+.3f} over {n} ({test}; {where}; per seed {per_seed})")
        shown = []
        for s in seeds:
            target = base[s]["heldout"][steps]
            if target <= base[s]["heldout"][0] + 1e-12:  # nothing to reach: the design's step 0 is as good
                shown.append("iid did not improve")
            else:
                reached = reach_step(by_seed[s]["heldout"], target)
                shown.append("-" if reached is None else str(reached))
        lines.append(f"{design}: steps to reach iid's final held-out reward, per seed (of {steps}): {', '.join(shown)}")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    """Training and held-out reward against step: mean over seeds, band from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for design, by_seed in runs.items():
        if not by_seed:
            continue
        for ax, pick in ((axes[0], "train"), (axes[1], "heldout")):
            if pick == "train":
                xs = next(iter(by_seed.values()))["steps"]
                ys = np.array([[row["reward_mean"] for row in run["rows"]] for run in by_seed.values()])
            else:
                xs = sorted(next(iter(by_seed.values()))["heldout"])
                ys = np.array([[run["heldout"][x] for x in xs] for run in by_seed.values()])
            (line,) = ax.plot(
                xs, ys.mean(axis=0), marker="o" if pick == "heldout" else None, label=f"{design} ({len(by_seed)} seeds)"
            )
            ax.fill_between(xs, ys.min(axis=0), ys.max(axis=0), color=line.get_color(), alpha=0.2)
    axes[0].set(title="training reward (rollouts of the step)", xlabel="step", ylabel="reward (mean over seeds)")
    axes[1].set(title="held-out reward (greedy)", xlabel="step")
    axes[1].legend(title="band: min–max over seeds")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(path: Path, args: argparse.Namespace) -> None:
    """Print the table and the paired comparison, and draw the plot, from the file's finished runs."""
    records, _ = read_lines(path)
    runs = curves(records, args.designs, list(range(args.seeds)))
    header = records[0]
    title = (
        f"{header['cpu']}; model {args.model or 'SmolLM2-135M-Instruct'}, {args.task}, G = {args.generations}, "
        f"{args.prompts} prompts/step, lr {args.learning_rate:g}, {args.heldout} held-out problems"
    )
    print(f"\n{title}\n{table(runs, args.steps)}\n\n{comparison(runs, args.steps)}")
    plot(runs, path.with_name("reward.png"), title)
    print(f"plot: {path.with_name('reward.png')}; lines: {path}", flush=True)
