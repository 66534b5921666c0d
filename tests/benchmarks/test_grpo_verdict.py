"""benchmarks/grpo's plan, verdict, power calculation and stop-string cut: the plan read from its markdown,
the rule's four verdicts and the cases where it states none, the pilot's effect and seeds, and rollouts
cut at the stop string on the tiny model."""

import hashlib
import importlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("trl", reason="TRL not installed")

RULE = {"alpha": 0.05, "margin": 0.02, "threshold": 0.5}


@pytest.fixture(scope="module")
def grpo(benchmark_script):
    """The script's package ``benchmarks/grpo`` (loading the script puts it on ``sys.path``)."""
    benchmark_script("grpo_steps")
    names = ("data", "power", "report", "stop", "verdict")
    return SimpleNamespace(**{name: importlib.import_module(f"grpo.{name}") for name in names})


def plan_text(block) -> str:
    block = f"```json\n{json.dumps(block)}\n```\n"
    return f"# A plan\n\nSome words.\n\n{block}\nMore words, and a python block:\n```python\nx = 1\n```\n"


def test_a_plan_is_its_one_json_block_and_its_hash(grpo, tmp_path):
    path = tmp_path / "plan.md"
    settings = {"steps": 16, "seeds": 10}
    path.write_text(plan_text({"settings": settings, **RULE}))
    plan = grpo.verdict.read_plan(str(path))
    assert plan.settings == settings and (plan.alpha, plan.margin, plan.threshold) == (0.05, 0.02, 0.5)
    assert plan.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert plan.rule() == {"path": str(path), "sha256": plan.sha256, "settings": settings, **RULE}


@pytest.mark.parametrize(
    "text, message",
    [
        ("no block at all", "exactly one ```json block (its settings and rule); found 0"),
        (plan_text({"settings": {}, **RULE}) * 2, "found 2"),
        ("```json\n{not json\n```\n", "its ```json block is not JSON"),
        (plan_text({**RULE}), 'must be an object with "settings"'),
        (plan_text({"settings": {}, **RULE, "alpha": "0.05"}), "the plan's 'alpha' must be a number; got '0.05'"),
        (plan_text({"settings": {}, **RULE, "margin": 0}), "margin > 0"),
        (plan_text({"settings": {"seeds": 5}, **RULE}), "seeds 6 … 20 (with fewer the exact sign-flip test cannot"),
        (plan_text({"settings": {"seeds": 3}, **RULE, "alpha": 0.125}), "seeds 4 … 20"),  # 2/16 = 0.125 reaches it
        (plan_text({"settings": {"seeds": 21}, **RULE}), "more it cannot list); got 21"),
        (plan_text({"settings": {"seeds": "10"}, **RULE}), "got '10'"),
    ],
)
def test_a_plan_that_is_not_one_is_refused_naming_what_is_wrong(grpo, tmp_path, text, message):
    path = tmp_path / "plan.md"
    path.write_text(text)
    with pytest.raises(ValueError, match=None) as error:
        grpo.verdict.read_plan(str(path))
    assert message in str(error.value) and str(path) in str(error.value)


@pytest.mark.parametrize(
    "diffs, verdict",
    [
        ([0.03, 0.05, 0.02, 0.04, 0.06, 0.01, 0.03, 0.05, 0.02, 0.04], "faster"),  # all positive: p = 2/1024
        ([-0.03, -0.05, -0.02, -0.04, -0.06, -0.01, -0.03, -0.05, -0.02, -0.04], "slower"),
        ([0.002, -0.003, 0.001, -0.002, 0.003, -0.001, 0.002, -0.002, 0.001, -0.001], "no difference"),
        ([0.05, -0.04, 0.06, -0.05, 0.03, -0.06, 0.04, -0.03, 0.05, -0.04], "inconclusive"),  # wide: not within ±0.02
        ([0.05, -0.02, 0.04, -0.01, 0.03, 0.0, 0.05, -0.02, 0.02, -0.03], "inconclusive"),  # one end outside
    ],
)
def test_the_rule_calls_a_difference_faster_slower_none_or_inconclusive(grpo, diffs, verdict):
    decision = grpo.verdict.decide(diffs, alpha=0.05, margin=0.02)
    assert decision.verdict == verdict, decision
    assert decision.interval[0] <= decision.mean <= decision.interval[1]


def test_too_few_seeds_cannot_say_no_difference(grpo):
    # 5 seeds: the sign-flip test can reject nothing at 0.05 (least p 2/32), so the interval is unbounded
    decision = grpo.verdict.decide([0.001, -0.001, 0.0, 0.001, -0.001], alpha=0.05, margin=0.02)
    assert decision.verdict == "inconclusive" and decision.interval == (-np.inf, np.inf)
    with pytest.raises(ValueError, match="2 … 20 paired differences"):
        grpo.verdict.decide([0.1], alpha=0.05, margin=0.02)


def end_line(design, groups=2 * 4, **counters):
    """A finished run's end line as training writes it: patch_generate's counters for ``design``."""
    qmc = {"method": design, "calls": 2, "groups": groups, "members": groups * 8, "unsampleable": 0}
    return {"type": "end", "qmc": qmc | {"copies_only_calls": 0} | counters, "batch_warnings": 0}


def runs_of(seeds, lift):
    curve = lambda x: {0: 0.2, 1: 0.3 + x, 2: 0.4 + x}  # noqa: E731
    run = lambda design, heldout: {"steps": [], "rows": [], "heldout": heldout, "end": end_line(design)}  # noqa: E731
    return {
        "iid": {s: run("iid", curve(0.0)) for s in seeds},
        "lattice": {s: run("lattice", curve(lift + 0.01 * s)) for s in seeds},
    }


def identity(seeds, plan="agree"):
    ident = {"steps": 2, "eval_every": 1, "designs": ["iid", "lattice"], "seeds": seeds, "prompts": 4, "lr": 1e-6}
    if plan is None:
        return ident | {"plan": None}
    settings = dict(ident) if plan == "agree" else ident | {"lr": 1e-5}
    return ident | {"plan": {"path": "docs/plan.md", "sha256": "x", "settings": settings, **RULE}}


def test_the_verdict_is_stated_by_the_plans_rule_from_the_records(grpo):
    line = grpo.report.verdict_line(runs_of(range(10), 0.05), identity(10))
    assert line.startswith("verdict by the plan's rule (docs/plan.md): lattice vs iid on held-out AUC: FASTER "), line


def test_no_verdict_without_a_plan_with_settings_unlike_the_plans_or_with_seeds_missing(grpo):
    assert grpo.report.verdict_line(runs_of(range(10), 0.05), identity(10, plan=None)) == (
        "verdict: none (no --plan: a descriptive run)"
    )
    differ = grpo.report.verdict_line(runs_of(range(10), 0.05), identity(10, plan="differ"))
    assert differ == "verdict: none — this run's settings differ from its plan's (lr); docs/plan.md"
    runs = runs_of(range(10), 0.05)
    del runs["lattice"][9], runs["iid"][8]
    partial = grpo.report.verdict_line(runs, identity(10))
    assert partial == (
        "verdict: none yet — PARTIAL: 8 of 10 paired seeds finished; missing iid:8, lattice:9 (plan docs/plan.md)"
    )
    assert "2 … 20 paired seeds" in grpo.report.verdict_line(runs_of([0], 0.05), identity(1))


@pytest.mark.parametrize(
    "spoil, says",
    [
        (lambda run: run.update(end=end_line("iid")), "lattice:3 ran iid in 8 groups, not 8"),
        (lambda run: run.update(end=end_line("lattice", groups=6)), "lattice:3 ran lattice in 6 groups, not 8"),
        (lambda run: run.update(end=end_line("lattice", unsampleable=2)), "lattice:3 had 2 unsampleable rows"),
        (lambda run: run.update(end=end_line("lattice", copies_only_calls=1)), "1 copies-only calls"),
        (lambda run: run["end"].update(batch_warnings=1), "1 batch warnings"),
        (lambda run: run["end"].update(qmc=None), "lattice:3 has no sampler counters"),
        (lambda run: run["end"].pop("batch_warnings"), "lattice:3's end line lacks a counter"),
        (lambda run: run["end"]["qmc"].pop("unsampleable"), "lattice:3's end line lacks a counter"),
    ],
)
def test_no_verdict_where_a_run_is_not_shown_to_have_sampled_its_design_in_groups(grpo, spoil, says):
    runs = runs_of(range(10), 0.05)
    spoil(runs["lattice"][3])
    line = grpo.report.verdict_line(runs, identity(10))
    assert line.startswith("verdict: none — the design is not shown to have run as planned: ") and says in line, line


def test_no_verdict_where_vllm_sampled_out_of_the_trainers_sight(grpo):
    ident = identity(10)
    ident = ident | {
        "use_vllm": "server",
        "plan": ident["plan"] | {"settings": ident["plan"]["settings"] | {"use_vllm": "server"}},
    }
    line = grpo.report.verdict_line(runs_of(range(10), 0.05), ident)
    assert line == (
        "verdict: none — the design is not shown to have run as planned: "
        "--use-vllm server: the engine's sampler cannot be checked from the trainer"
    )


def test_the_curve_is_rising_where_a_point_is_above_the_one_before(grpo):
    assert grpo.verdict.rising_share({0: 0.2, 2: 0.3, 4: 0.3, 6: 0.5, 8: 0.4}) == 0.5
    assert grpo.verdict.rising_share({0: 0.2}) == 0.0
    assert grpo.verdict.steps_to({0: 0.2, 2: 0.5, 4: 0.7}, 0.5) == 2 and grpo.verdict.steps_to({0: 0.2}, 0.5) is None


def test_distinct_answers_count_the_verifiers_parsed_answers(grpo):
    stats = grpo.data.group_stats([1, 1, 1, 2, 2, 2], [1, 0, 1, 0, 0, 0], [[1], [2], [3], [4], [4], [5]],
                                  ["4", "5", "4", None, None, "7"])  # fmt: skip
    assert stats == {"zero_var_share": 0.5, "distinct_per_group": 2.5, "distinct_answers_per_group": 2.0}


def test_the_stop_position_is_the_token_that_completes_the_stop_string(grpo):
    pieces = {1: "<ans", 2: "wer>4</", 3: "answer>", 4: " and more"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert grpo.stop.stop_position([1, 2, 3, 4, 4], decode, ("</answer>",)) == 3
    assert grpo.stop.stop_position([1, 2, 4], decode, ("</answer>",)) == 3  # no stop: all kept
    assert grpo.stop.stop_position([1, 2, 3], decode, ()) == 3


def test_generate_is_cut_at_the_stop_string_and_padded_with_eos(grpo, tiny_model_dir):
    """The tiny model's own greedy completion, with a stop string taken from its third token's text:
    the wrapped generate keeps the tokens up to that one and turns the rest into EOS, where TRL's
    mask ends the completion; restore() gives back the generate it had."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    inputs = tokenizer(["Hello there", "Hello there"], return_tensors="pt")
    kwargs = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=tokenizer.eos_token_id)
    plain = model.generate(**inputs, **kwargs)
    prompt = inputs["input_ids"].shape[1]
    completion = plain[0, prompt:].tolist()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    k = next(k for k in range(3, 9) if decode(completion[:k]) != decode(completion[: k - 1]))
    stop = decode(completion[:k])[len(decode(completion[: k - 1])) :]  # the text the k-th token adds
    keep = grpo.stop.stop_position(completion, decode, (stop,))
    assert 1 <= keep <= k
    original = model.generate
    restore = grpo.stop.cut_generate_at_stop(model, tokenizer, (stop,))
    cut = model.generate(**inputs, **kwargs)
    assert cut[:, : prompt + keep].tolist() == plain[:, : prompt + keep].tolist()
    assert (cut[:, prompt + keep :] == tokenizer.eos_token_id).all() and keep < 8
    restore()
    assert model.generate == original


def test_half_the_steps_of_a_linear_curve_adds_a_quarter_to_its_area(grpo):
    """c(t) = t/16 has area 1/2 over [0, 16]; c(min(2t, 16)) rises to 1 by step 8 and stays: area 3/4."""
    curve = {t: t / 16 for t in range(0, 17, 2)}
    assert grpo.power.half_the_steps_effect(curve, 16) == pytest.approx(0.25)
    assert grpo.power.half_the_steps_effect({t: 0.5 for t in range(0, 17, 2)}, 16) == 0  # a plateau: no effect


def test_seeds_needed_is_the_paired_t_tests_power_and_at_least_ten(grpo):
    """Against the normal approximation n = ((z + z)·SD/δ)² it adds the t's heavier tails: 31.4 → 34."""
    assert grpo.power.seeds_needed(0.05, 0.05) == 10  # the t-test needs 10 here (normal: 7.85); floor 10
    assert grpo.power.seeds_needed(0.1, 0.05) == 34  # normal approximation 31.4
    assert grpo.power.seeds_needed(0.1, 0.05, power=0.9) == 44  # normal approximation 42.0
    assert grpo.power.seeds_needed(0.03, 0.05) == 10  # the t-test needs 6: the floor
    with pytest.raises(ValueError, match="effect > 0"):
        grpo.power.seeds_needed(0.05, 0.0)


@pytest.mark.parametrize(
    "sd, power", [(sd, power) for sd in (0.03, 0.05, 0.08, 0.12) for power in (0.01, 0.5, 0.8, 0.95)] + [(0.5, 0.01)]
)
def test_seeds_needed_is_the_least_n_whose_t_test_has_the_power_searched_from_two(grpo, sd, power):
    from scipy.stats import nct, t

    def t_power(n):
        critical, shift = t.ppf(0.975, n - 1), 0.05 * np.sqrt(n) / sd
        return nct.sf(critical, n - 1, shift) + nct.cdf(-critical, n - 1, shift)

    least = next(n for n in range(2, 1000) if t_power(n) >= power)
    assert grpo.power.seeds_needed(sd, 0.05, power=power) == max(least, grpo.power.LEAST_SEEDS)


def pilot_file(path, curves_by_seed, steps=4, only=None, stream=0, cpus=None):
    """A pilot's steps.jsonl: a header (CPU A) and, per seed (those of ``only``, or all), its held-out
    points and an end line (naming ``cpus[seed]``, where given, as the run's CPU)."""
    ident = {"designs": ["iid", "lattice"], "seeds": len(curves_by_seed), "steps": steps, "rollout_stream": stream}
    lines = [{"type": "header", "identity": ident, "cpu": "CPU: A"}]
    for seed, curve in enumerate(curves_by_seed):
        if only is not None and seed not in only:
            continue
        lines += [{"type": "step", "design": "iid", "seed": seed, "step": t, "heldout_reward": r} for t, r in curve]
        lines.append({"type": "end", "design": "iid", "seed": seed} | ({"cpu": cpus[seed]} if cpus else {}))
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_the_power_calculation_pools_files_side_by_side_and_counts_a_seed_once(grpo, tmp_path, capsys):
    """Pilot folders of one seed each (``--only iid:K``) pool; a seed in two files is one run, refused."""
    curves = [[(0, 0.2), (2, 0.4), (4, 0.5)], [(0, 0.2), (2, 0.3), (4, 0.5)], [(0, 0.2), (2, 0.5), (4, 0.6)]]
    first = pilot_file(tmp_path / "a.jsonl", curves, only=[0, 1])
    second = pilot_file(tmp_path / "b.jsonl", curves, only=[2])
    assert grpo.power.main([first, second]) == 0
    out = capsys.readouterr().out
    areas = [grpo.report.auc(dict(curve), 4) for curve in curves]
    assert "iid runs: 3; mean held-out curve: 0: 0.200, 2: 0.400, 4: 0.533" in out
    assert f"√2·SD {np.sqrt(2) * np.std(areas, ddof=1):.4f}" in out
    with pytest.raises(SystemExit) as exited:
        grpo.power.main([first, first])
    assert exited.value.code == 2 and "iid seed 0 is also in an earlier file" in capsys.readouterr().err


def test_an_a_a_calibration_takes_the_sd_of_the_paired_differences_of_two_streams(grpo, tmp_path, capsys):
    """Stream 1 lifts every seed's curve alike (+0.1 at the last point): its paired differences barely
    vary, so their SD is far below √2 × the runs' SD — the pairing's gain that the √2 bound ignores."""
    curves = [[(0, 0.2), (2, 0.4), (4, 0.5)], [(0, 0.2), (2, 0.3), (4, 0.4)], [(0, 0.2), (2, 0.5), (4, 0.6)]]
    lifted = [[(t, r + (0.1 if t == 4 else 0.0) + 0.01 * seed) for t, r in c] for seed, c in enumerate(curves)]
    a = pilot_file(tmp_path / "a.jsonl", curves)
    b = pilot_file(tmp_path / "b.jsonl", lifted, stream=1)
    assert grpo.power.main([a, "--paired-with", b]) == 0
    out = capsys.readouterr().out
    diffs = [grpo.report.auc(dict(x), 4) - grpo.report.auc(dict(y), 4)
             for x, y in zip(lifted, curves, strict=True)]  # fmt: skip
    assert f"their SD {np.std(diffs, ddof=1):.4f}" in out and "iid runs: 6;" in out, out
    for other, message in (
        (a, "the same --rollout-stream"),
        (pilot_file(tmp_path / "c.jsonl", curves, steps=6, stream=1), "other settings"),
    ):
        with pytest.raises(SystemExit):
            grpo.power.main([a, "--paired-with", other])
        assert message in capsys.readouterr().err


def test_a_plan_beyond_the_rules_twenty_seeds_or_without_an_sd_is_refused_in_one_line(grpo, tmp_path, capsys):
    """A slowly rising pilot (small δ) with a wide floor needs more seeds than the exact test takes."""
    slow = pilot_file(tmp_path / "slow.jsonl", [[(0, 0.2), (2, 0.21), (4, 0.22)]] * 2)
    one = pilot_file(tmp_path / "one.jsonl", [[(0, 0.2), (2, 0.4), (4, 0.5)]])
    for argv, message in (([slow, "--floor-sd", "0.05"], "more than the 20"), ([one], "give no SD")):
        with pytest.raises(SystemExit) as exited:
            grpo.power.main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_pilot_whose_curve_does_not_rise_gets_one_line_and_exit_code_2(grpo, tmp_path, capsys):
    flat = pilot_file(tmp_path / "flat.jsonl", [[(0, 0.5), (2, 0.5), (4, 0.4)]] * 2)
    with pytest.raises(SystemExit) as exited:
        grpo.power.main([flat])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("power.py: error: the pilot's mean curve does not rise") and err.count("\n") == 1


def test_an_a_a_pair_run_on_two_cpus_is_named_in_a_warning(grpo, tmp_path, capsys):
    """A run's CPU is its end line's, else its file header's: seed 1 of stream 1 ran on CPU B, so its pair
    (the other on A, by its header) mixes machines; the pairs on one CPU are not named."""
    curves = [[(0, 0.2), (2, 0.4), (4, 0.5)], [(0, 0.2), (2, 0.3), (4, 0.4)], [(0, 0.2), (2, 0.5), (4, 0.6)]]
    other = [[(t, r + 0.02 * seed) for t, r in c] for seed, c in enumerate(curves)]
    a = pilot_file(tmp_path / "a.jsonl", curves)
    b = pilot_file(tmp_path / "b.jsonl", other, stream=1, cpus=["CPU: A", "CPU: B", "CPU: A"])
    assert grpo.power.main([a, "--paired-with", b]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: 1 of 3 pairs ran on two CPUs (seed 1: CPU: A and CPU: B): their differences hold the machines' "
        "difference too"
    ]
    assert grpo.power.main([a, "--paired-with", pilot_file(tmp_path / "c.jsonl", other, stream=1)]) == 0
    assert "warning:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("cpus", "title"),
    [
        (["CPU: B", "CPU: B"], "CPU: B; model"),  # the runs' own CPU, not the header's machine that started the file
        (["CPU: A", "CPU: B"], "CPU: A (1 runs) + CPU: B (1 runs); model"),
    ],
)
def test_the_reports_title_names_the_cpus_its_runs_ran_on(grpo, tmp_path, capsys, cpus, title):
    ident = {"model": None, "task": "basic_arithmetic", "task_options": {}, "designs": ["iid", "lattice"],
             "seeds": 1, "steps": 2, "generations": 4, "prompts": 2, "learning_rate": 1e-6, "heldout": 8,
             "eval_every": 2}  # fmt: skip
    lines = [{"type": "header", "identity": ident, "cpu": "CPU: A"}]
    for design, cpu in zip(ident["designs"], cpus, strict=True):
        lines += [{"type": "step", "design": design, "seed": 0, "step": t, "heldout_reward": 0.2 + 0.1 * t}
                  for t in (0, 2)]  # fmt: skip
        lines.append({"type": "end", "design": design, "seed": 0, "cpu": cpu})
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    grpo.report.report(path)
    assert f"\n{title} " in capsys.readouterr().out
