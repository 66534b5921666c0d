"""The report of the finished runs, from ``steps.jsonl`` alone: the table, the paired comparison, the verdict."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from grpo.records import END, STEP, read_lines, run_cpu
from grpo.verdict import decide, differing_settings, rising_share, steps_to


def curves(records: list[dict[str, Any]], designs: list[str], seeds: list[int]) -> dict[str, dict[int, dict]]:
    """design → seed → {"steps": [...], "rows": [...], "heldout": {step: reward}, "end": its end line}, from
    finished runs."""
    ends = {(r["design"], r["seed"]): r for r in records if r.get("type") == END}
    finished = set(ends)
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
        run["end"] = ends[(r["design"], r["seed"])]
    return out


def auc(heldout: dict[int, float], steps: int) -> float:
    """Trapezoid area under the held-out curve over [0, steps], divided by steps (a mean reward)."""
    xs = sorted(heldout)
    ys = [heldout[x] for x in xs]
    return float(np.sum((np.diff(xs)) * (np.array(ys[1:]) + np.array(ys[:-1])) / 2) / steps)


def table(runs: dict[str, dict[int, dict]], steps: int) -> str:
    """Per design, means over seeds: final and mean held-out reward, training figures, cost."""
    head = (
        f"{'design':>10}  {'seeds':>5}  {'final held-out':>14}  {'held-out AUC':>12}  {'train reward':>12}  "
        f"{'zero-var':>8}  {'distinct/group':>14}  {'answers/group':>13}  {'tokens/step':>11}  {'s/step':>6}"
    )
    lines = [head, "-" * len(head)]
    for design, by_seed in runs.items():
        if not by_seed:
            continue
        rows = [row for run in by_seed.values() for row in run["rows"]]
        final = np.mean([run["heldout"][steps] for run in by_seed.values()])
        area = np.mean([auc(run["heldout"], steps) for run in by_seed.values()])
        keys = ("reward_mean", "zero_var_share", "distinct_per_group", "distinct_answers_per_group", "tokens", "wall_s")
        mean = {k: np.mean([row.get(k, np.nan) for row in rows]) for k in keys}
        lines.append(
            f"{design:>10}  {len(by_seed):>5}  {final:14.3f}  {area:12.3f}  {mean['reward_mean']:12.3f}  "
            f"{mean['zero_var_share']:8.3f}  {mean['distinct_per_group']:14.2f}  "
            f"{mean['distinct_answers_per_group']:13.2f}  {mean['tokens']:11.0f}  {mean['wall_s']:6.1f}"
        )
    return "\n".join(lines)


def comparison(runs: dict[str, dict[int, dict]], identity: dict[str, Any]) -> str:
    """Each design against iid, paired by seed: the primary metric (held-out AUC) and the secondary
    ones (final held-out reward; steps to the plan's threshold, for iid and the design alike), then
    whether iid's curve was still rising, then the verdict by the plan's rule — or why there is none.

    Args:
        runs: :func:`curves` of the finished runs. identity: the header's (its ``plan``: the rule, or None).
    """
    steps, every, plan = identity["steps"], identity["eval_every"], identity.get("plan")
    alpha = plan["alpha"] if plan else 0.05
    lines = []
    base = runs["iid"]
    for design, by_seed in runs.items():
        if design == "iid":
            continue
        seeds = sorted(set(base) & set(by_seed))
        if not seeds:
            lines.append(f"{design} − iid: no seed finished for both")
            continue
        for name, value in (
            ("held-out AUC (primary)", lambda run: auc(run["heldout"], steps)),
            ("final held-out reward", lambda run: run["heldout"][steps]),
        ):
            diffs = np.array([value(by_seed[s]) - value(base[s]) for s in seeds])
            lines.append(f"{design} − iid, {name}: {paired(diffs, alpha)}")
        if plan:
            threshold, never = plan["threshold"], steps + every
            reach = {d: [steps_to(runs[d][s]["heldout"], threshold) for s in seeds] for d in ("iid", design)}
            for d in ("iid", design):
                shown = ", ".join("-" if r is None else str(r) for r in reach[d])
                lines.append(
                    f"{d}: steps to held-out reward {threshold:g}, per seed (of {steps}; - never): {shown}; "
                    f"reached by {sum(r is not None for r in reach[d])} of {len(seeds)}"
                )
            counted = {d: [never if r is None else r for r in reach[d]] for d in reach}
            diffs = np.array(counted[design]) - np.array(counted["iid"])
            lines.append(
                f"{design} − iid, steps to {threshold:g} (never counted as {never}): {paired(diffs, alpha, '+.1f')}"
            )
        else:
            lines.append("steps to a threshold: the threshold is the plan's (--plan); none given")
    lines.append(still_rising(base, every))
    lines.append(verdict_line(runs, identity))
    return "\n".join(lines)


def paired(diffs: np.ndarray, alpha: float, fmt: str = "+.3f") -> str:
    """Mean, exact sign-flip p, the inverted test's interval at 1 − alpha, and each seed's difference."""
    from qmc_sampler.eval.stats.paired import sign_flip_interval, sign_flip_p

    n = len(diffs)
    p_value = sign_flip_p(diffs) if n else None
    test = f"exact sign-flip p = {p_value:.3f} (least possible {2 / 2**n:.3f})" if p_value is not None else "no p"
    interval = sign_flip_interval(diffs, level=1 - alpha) if 2 <= n else None
    where = f"{1 - alpha:.0%} interval [{interval[0]:{fmt}}, {interval[1]:{fmt}}]" if interval else "no interval"
    per_seed = ", ".join(f"{d:{fmt}}" for d in diffs)
    return f"{diffs.mean():{fmt}} over {n} seed{'s' * (n != 1)} ({test}; {where}; per seed {per_seed})"


def still_rising(base: dict[int, dict], every: int) -> str:
    """Whether iid's mean held-out curve rose at at least half of its evaluation points (the plan's setting)."""
    if not base:
        return "iid: no finished run"
    points = sorted(next(iter(base.values()))["heldout"])
    mean = {x: float(np.mean([run["heldout"][x] for run in base.values()])) for x in points}
    share = rising_share(mean)
    ups = round(share * (len(points) - 1))
    curve = ", ".join(f"{x}: {mean[x]:.3f}" for x in points)
    return (
        f"iid's mean held-out curve rose at {ups} of its {len(points) - 1} evaluation points after step 0 "
        f"({'at least half: learning took most of the run' if share >= 0.5 else 'fewer than half'}); {curve}"
    )


def verdict_line(runs: dict[str, dict[int, dict]], identity: dict[str, Any]) -> str:
    """The verdict by the plan's rule on the primary metric, or why none is stated: no plan, settings that
    differ from the plan's, seeds still missing (a partial result, with the missing pairs), or a run
    not shown to have sampled as planned (:func:`sampler_problems`). With several designs, each is
    tested against iid at the plan's alpha, uncorrected: the plan names its primary design."""
    plan = identity.get("plan")
    if not plan:
        return "verdict: none (no --plan: a descriptive run)"
    differ = differing_settings(identity)
    if differ:
        return f"verdict: none — this run's settings differ from its plan's ({', '.join(differ)}); {plan['path']}"
    if not 2 <= identity["seeds"] <= 20:
        return f"verdict: none — {identity['seeds']} seeds: the rule's sign-flip test takes 2 … 20 paired seeds"
    designs, seeds = identity["designs"], range(identity["seeds"])
    missing = [f"{d}:{s}" for s in seeds for d in designs if s not in runs[d]]
    if missing:
        done = sum(all(s in runs[d] for d in designs) for s in seeds)
        return (
            f"verdict: none yet — PARTIAL: {done} of {identity['seeds']} paired seeds finished; "
            f"missing {', '.join(missing)} (plan {plan['path']})"
        )
    unchecked = sampler_problems(runs, identity)
    if unchecked:
        return f"verdict: none — the design is not shown to have run as planned: {'; '.join(unchecked)}"
    out = []
    steps = identity["steps"]
    for design in designs[1:]:
        diffs = [auc(runs[design][s]["heldout"], steps) - auc(runs["iid"][s]["heldout"], steps) for s in seeds]
        d = decide(diffs, plan["alpha"], plan["margin"])
        out.append(
            f"verdict by the plan's rule ({plan['path']}): {design} vs iid on held-out AUC: {d.verdict.upper()} "
            f"(mean {d.mean:+.3f}, p = {d.p:.4f}, alpha {plan['alpha']:g}; {1 - plan['alpha']:.0%} interval "
            f"[{d.interval[0]:+.3f}, {d.interval[1]:+.3f}], margin ±{plan['margin']:g})"
        )
    return "\n".join(out)


def sampler_problems(runs: dict[str, dict[int, dict]], identity: dict[str, Any]) -> list[str]:
    """Why the runs may not have sampled as planned (empty: they did): each run's end line must show
    patch_generate's counters for its own design, one group per prompt and step, no unsampleable row,
    no copies-only call, no batch warning. With ``--use-vllm`` the engine samples where this process
    cannot count (the plugin may not have run): nothing can be shown."""
    if identity.get("use_vllm"):
        return [f"--use-vllm {identity['use_vllm']}: the engine's sampler cannot be checked from the trainer"]
    groups = identity["prompts"] * identity["steps"]
    problems = []
    for design, by_seed in runs.items():
        for seed, run in sorted(by_seed.items()):
            end = run.get("end") or {}
            qmc = end.get("qmc")
            if qmc is None:
                problems.append(f"{design}:{seed} has no sampler counters")
            elif qmc.get("method") != design or qmc.get("groups") != groups:
                problems.append(f"{design}:{seed} ran {qmc.get('method')} in {qmc.get('groups')} groups, not {groups}")
            elif any(k not in qmc for k in ("unsampleable", "copies_only_calls")) or "batch_warnings" not in end:
                problems.append(
                    f"{design}:{seed}'s end line lacks a counter (unsampleable, copies-only, batch warnings)"
                )
            elif qmc["unsampleable"] or qmc["copies_only_calls"] or end["batch_warnings"]:
                problems.append(
                    f"{design}:{seed} had {qmc['unsampleable']} unsampleable rows, {qmc['copies_only_calls']} "
                    f"copies-only calls, {end['batch_warnings']} batch warnings"
                )
    return problems


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


def report(path: Path) -> None:
    """Print the table, the paired comparison and the verdict, and draw the plot, from the file alone:
    its header's identity (sizes, designs, seeds, the plan's rule) and its finished runs."""
    records, _ = read_lines(path)
    ident = records[0]["identity"]
    runs = curves(records, ident["designs"], list(range(ident["seeds"])))
    options = "".join(f", {k}={v}" for k, v in (ident.get("task_options") or {}).items())
    cpus = Counter(run_cpu(run.get("end"), records[0]) for by_seed in runs.values() for run in by_seed.values())
    # The runs' own CPUs: a file started on one machine may hold only runs finished on another. With no
    # finished run, the header's (run_cpu's own fallback).
    if len(cpus) > 1:
        machines = " + ".join(f"{cpu} ({n} runs)" for cpu, n in cpus.items())
    else:
        machines = next(iter(cpus), run_cpu(None, records[0]))
    title = (
        f"{machines}; model {ident['model'] or 'SmolLM2-135M-Instruct'}, {ident['task']}{options}, "
        f"G = {ident['generations']}, {ident['prompts']} prompts/step, lr {ident['learning_rate']:g}, "
        f"{ident['heldout']} held-out problems"
    )
    print(f"\n{title}\n{table(runs, ident['steps'])}\n\n{comparison(runs, ident)}")
    plot(runs, path.with_name("reward.png"), title)
    print(f"plot: {path.with_name('reward.png')}; lines: {path}", flush=True)
