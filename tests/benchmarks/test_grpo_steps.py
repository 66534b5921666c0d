"""benchmarks/grpo_steps.py's quick form: real TRL GRPO steps, i.i.d. against lattice, on the tiny model.

The tiny model is random, so the task's reward is mostly 0: these tests check the
record (its structure, the pairing of designs by seed and prompts, lattice's groups),
the resume, and the refusals — not the figures. Each run is ``python SCRIPT`` in a fork
of the warm Python (torch and transformers already imported). The helpers that need no
training (the comparison, the batch check, the vLLM step seed, …) are called in this process; the
paired statistics (the sign-flip p-value) are tested with their module, tests/eval/stats/test_paired.py.
"""

import argparse
import ast
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl", reason="TRL not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_steps.py"
STEPS, PROMPTS, G = 2, 2, 4  # the script's --quick sizes


@pytest.fixture(scope="module")
def grpo(benchmark_script):
    """The script's package ``benchmarks/grpo``, its modules as attributes, imported as the script imports them:
    loading the script (which runs nothing: numpy only) puts its folder on ``sys.path``."""
    benchmark_script("grpo_steps")
    names = ("data", "plan", "report", "training")
    return SimpleNamespace(**{name: importlib.import_module(f"grpo.{name}") for name in names})


def grpo_steps(warm_python, *argv: str):
    return warm_python.run([str(SCRIPT), *argv], cwd=SCRIPT.parents[1], timeout=300)


@pytest.fixture(scope="module")
def quick_runs(quick_record, warm_python, tmp_path_factory):
    """The quick form run twice into one folder: the first trains, the second resumes."""
    out = tmp_path_factory.mktemp("grpo-steps")
    argv, first, records = quick_record("grpo_steps", out, "steps.jsonl")
    second = grpo_steps(warm_python, *argv)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    return out, argv, first, second, records


def comparison_lines(stdout: str) -> list[str]:
    """The report: from its title line (the CPU, the model, …) on — the table, the comparison, the plot's path."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("CPU: ") and "; model " in line), len(lines))
    return lines[start:]


def test_the_record_has_a_header_a_line_per_design_seed_and_step_and_an_end_per_run(quick_runs):
    out, _, first, _, records = quick_runs
    header, *rest = records
    assert header["type"] == "header" and header["identity"]["designs"] == ["iid", "lattice"]
    assert header["cpu"].startswith("CPU: ") and header["versions"]["trl"]
    steps = [(r["design"], r["seed"], r["step"]) for r in rest if r["type"] == "step"]
    assert steps == [(d, 0, s) for d in ("iid", "lattice") for s in range(STEPS + 1)]  # step 0: before training
    assert [(r["design"], r["seed"]) for r in rest if r["type"] == "end"] == [("iid", 0), ("lattice", 0)]
    assert {r["cpu"] for r in rest if r["type"] == "end"} == {header["cpu"]}  # each run names its machine
    for r in rest:
        if r["type"] == "step" and r["step"] > 0:
            assert 0 <= r["reward_mean"] <= 1 and 0 <= r["zero_var_share"] <= 1, r
            assert 1 <= r["distinct_per_group"] <= G and 0 < r["tokens"] <= PROMPTS * G * 8, r
            assert r["wall_s"] > 0 and r["cpu_s"] > 0 and len(r["prompt_ids"]) == PROMPTS, r
        if r["type"] == "step":  # held-out at the evaluation steps of --quick: 0 and the last
            assert (r["heldout_reward"] is not None) == (r["step"] in (0, STEPS)), r
    assert (out / "reward.png").stat().st_size > 0
    assert "lattice seed 0 step 2/2: reward " in first.stdout  # progress per step


def test_both_designs_trained_on_the_same_prompts_with_the_same_seeds(quick_runs):
    records = quick_runs[4]
    prompts = {
        d: [(r["seed"], r["prompt_ids"]) for r in records if r.get("design") == d and "prompt_ids" in r]
        for d in ("iid", "lattice")
    }
    assert prompts["iid"] == prompts["lattice"] and len(prompts["iid"]) == STEPS


def test_the_lattice_rollouts_were_groups_of_g_one_per_prompt(quick_runs):
    records = quick_runs[4]
    for design in ("iid", "lattice"):  # both through patch_generate: only the design differs
        (end,) = [r for r in records if r["type"] == "end" and r["design"] == design]
        expected = {"method": design, "calls": STEPS, "groups": PROMPTS * STEPS, "members": PROMPTS * G * STEPS}
        assert end["qmc"] == expected | {"unsampleable": 0, "copies_only_calls": 0}, end


def test_a_rerun_trains_nothing_and_prints_the_same_comparison(quick_runs):
    out, _, first, second, records = quick_runs
    assert "nothing to train" in second.stdout and " step 1/2: " not in second.stdout, second.stdout
    assert comparison_lines(second.stdout) == comparison_lines(first.stdout) != []
    assert [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()] == records


def test_a_cut_off_run_restarts_cleanly(quick_runs, warm_python, tmp_path):
    _, argv, first, _, records = quick_runs
    cut = [r for r in records if not (r.get("design") == "lattice" and r["type"] == "end")][:-1]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cut) + '{"type": "st')
    done = grpo_steps(warm_python, *argv[:-1], str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dropped 2 lines of unfinished runs" in done.stdout and "iid seed 0 step 1/2" not in done.stdout
    again = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs[1:]]  # noqa: E731
    assert strip(again) == strip(records)  # the same run again: seeded groups, seeded training
    paired = [line for line in comparison_lines(done.stdout) if line.startswith("lattice")]  # (timings differ)
    assert paired == [line for line in comparison_lines(first.stdout) if line.startswith("lattice")] != []


def test_a_cut_off_line_right_after_a_finished_run_is_dropped_and_the_file_repaired(quick_runs, warm_python, tmp_path):
    # The last run finished, then the next invocation was cut off while writing its first line:
    # nothing to train, but the fragment must go, or the next line appended would be glued to it.
    _, argv, first, _, records = quick_runs
    whole = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "steps.jsonl").write_text(whole + '{"type": "step", "des')
    done = grpo_steps(warm_python, *argv[:-1], str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dropped a last line cut off mid-write" in done.stdout and "nothing to train" in done.stdout, done.stdout
    assert (tmp_path / "steps.jsonl").read_text() == whole
    assert comparison_lines(done.stdout)[:-1] == comparison_lines(first.stdout)[:-1] != []  # (not the paths)


def test_a_line_that_is_not_json_before_the_last_is_refused_in_one_line(quick_runs, warm_python, tmp_path):
    _, argv, _, _, records = quick_runs
    lines = [json.dumps(r) for r in records]
    text = "\n".join([lines[0], '{"type": "st', *lines[1:]]) + "\n"
    (tmp_path / "steps.jsonl").write_text(text)
    done = grpo_steps(warm_python, *argv[:-1], str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"grpo_steps.py: error: {tmp_path / 'steps.jsonl'}, line 2: not a JSON record (only the last line may be "
        "cut off); use another --out"
    ]
    assert (tmp_path / "steps.jsonl").read_text() == text  # left as it was


def test_only_runs_one_run_and_reports_and_is_not_part_of_the_identity(quick_runs, warm_python):
    _, argv, first, *_ = quick_runs
    done = grpo_steps(warm_python, *argv, "--only", "lattice:0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run lattice:0 finished in " in done.stdout and "nothing to train" in done.stdout, done.stdout
    assert comparison_lines(done.stdout) == comparison_lines(first.stdout) != []


def test_a_run_prints_its_batch_warnings_count(quick_runs):
    first = quick_runs[2]
    assert "reward function called more than once in a step): 0 in the 2 runs trained now" in first.stdout
    assert "WARNING" not in first.stdout, first.stdout


def test_a_file_written_with_other_arguments_is_refused(quick_runs, warm_python):
    out, argv, *_ = quick_runs
    done = grpo_steps(warm_python, *argv, "--learning-rate", "0.001")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"grpo_steps.py: error: {out / 'steps.jsonl'} was written with other arguments (learning_rate); "
        "use another --out or the same ones"
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--designs", "iid,lattic"], "--designs 'lattic' is not a design; use some of "),
        (["--designs", "lattice,sobol"], "--designs 'lattice,sobol': give iid and at least one other design"),
        (["--steps", "0"], "--steps 0: must be an integer >= 1"),
        (["--generations", "1"], "--generations 1: must be an integer >= 2"),
        (["--seeds", "two"], "argument --seeds: invalid int value: 'two'"),
        (["--data-seed", "-1"], "--data-seed -1: must be an integer >= 0"),
        (["--rollout-stream", "-1"], "--rollout-stream -1: must be an integer >= 0"),
        (["--heldout", "1000"], "--heldout 1000: the task gives "),
        (["--heldout", "200", "--prompts", "100"], "for training, fewer than --prompts 100; use fewer"),
        (["--task", "nope"], "--task: task='nope' is not a task"),
        (["--only", "lattice:3"], "--only 'lattice:3': give DESIGN:SEED, a design of --designs (iid,lattice)"),
        (["--use-vllm", "colocate"], "--use-vllm colocate: one (design, seed) run per invocation; add --only"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_code_2(refused, tmp_path, argv, message):
    refused("grpo_steps", argv, tmp_path, "steps.jsonl", message)


TASK_AND_PLAN_ERRORS = {
    "--task-option max_digits": "--task-option 'max_digits' must look like key=value",
    "--task-option nope=1": "--task-option: BasicArithmeticDatasetConfig.__init__() got an unexpected keyword",
    "--task-option max_digits=0": "--task-option: max_digits must be >= min_digits",
    "--task-option max_digits=1 --task-option max_digits=2": "--task-option max_digits: given twice",
    "--save-at 17": "--save-at 17: must be a step 1 … --steps (16)",
    "--plan no/such/plan.md": "--plan: no/such/plan.md: cannot read the plan",
}


@pytest.mark.parametrize("argv", TASK_AND_PLAN_ERRORS)
def test_bad_task_options_save_steps_and_plans_get_one_line_and_exit_code_2(refused, tmp_path, argv):
    refused("grpo_steps", argv.split(), tmp_path, "steps.jsonl", TASK_AND_PLAN_ERRORS[argv])


def run_curve(heldout):
    return {"steps": [], "rows": [], "heldout": heldout}


def identity(plan=None, seeds=3):
    return {"steps": 2, "eval_every": 1, "designs": ["iid", "lattice"], "seeds": seeds, "plan": plan}


def test_the_comparison_pairs_by_seed_with_the_exact_p_value_and_the_inverted_tests_interval(grpo):
    runs = {
        "iid": {s: run_curve({0: 0.25, 2: 0.5}) for s in range(3)},
        "lattice": {s: run_curve({0: 0.25, 2: 0.5 + 0.125 * (s + 1)}) for s in range(3)},
    }
    primary, final = grpo.report.comparison(runs, identity()).splitlines()[:2]
    assert primary == (
        "lattice − iid, held-out AUC (primary): +0.125 over 3 seeds (exact sign-flip p = 0.250 (least possible "
        "0.250); 95% interval [-inf, +inf]; per seed +0.062, +0.125, +0.188)"
    ), primary
    assert final.startswith("lattice − iid, final held-out reward: +0.250 over 3 seeds (exact sign-flip p = 0.250")


def test_steps_to_the_plans_threshold_are_counted_alike_for_iid_and_the_design(grpo):
    plan = {"alpha": 0.05, "margin": 0.05, "threshold": 0.5, "path": "plan.md", "settings": {}}
    runs = {  # seed 0: both reach 0.5 at step 2; seed 1: iid at step 1, lattice never (counted as 2 + 1)
        "iid": {0: run_curve({0: 0.25, 1: 0.25, 2: 0.5}), 1: run_curve({0: 0.5, 1: 0.75, 2: 0.5})},
        "lattice": {0: run_curve({0: 0.25, 1: 0.25, 2: 0.5}), 1: run_curve({0: 0.25, 1: 0.25, 2: 0.25})},
    }
    runs["iid"][1]["heldout"][0] = 0.25
    lines = grpo.report.comparison(runs, identity(plan, seeds=2)).splitlines()
    assert "iid: steps to held-out reward 0.5, per seed (of 2; - never): 2, 1; reached by 2 of 2" in lines
    assert "lattice: steps to held-out reward 0.5, per seed (of 2; - never): 2, -; reached by 1 of 2" in lines
    steps = next(line for line in lines if line.startswith("lattice − iid, steps to 0.5"))
    assert steps.startswith("lattice − iid, steps to 0.5 (never counted as 3): +1.0 over 2 seeds"), steps
    assert steps.endswith("per seed +0.0, +2.0)"), steps


def test_a_batch_not_in_groups_of_g_or_a_second_reward_call_is_warned_about_and_counted(grpo, capsys):
    task = SimpleNamespace(stop=("\n",), score=lambda problem, text: SimpleNamespace(correct=text == "4"))
    args = SimpleNamespace(prompts=2, generations=2)
    ctx = {"task": task, "by_id": {7: None, 3: None}, "args": args, "design": "iid", "seed": 0}
    recorder = grpo.training.Recorder(ctx, None)
    call = lambda ids: recorder(None, ["4"] * len(ids), [[1]] * len(ids), ids)  # noqa: E731
    recorder.on_step_begin()
    assert call([7, 7, 3, 3]) == [1.0] * 4 and recorder.warnings == 0 and capsys.readouterr().out == ""
    call([7, 7, 3, 3])
    assert recorder.warnings == 1
    recorder.on_step_begin()
    call([7, 3, 7, 3])  # interleaved: not groups of G
    assert recorder.warnings == 2
    assert capsys.readouterr().out.splitlines() == [
        "WARNING iid seed 0: the reward function was called 2 times in this step (once expected)",
        "WARNING iid seed 0: the batch has 4 rows of 2 problems, not 2 prompts × G = 2 rows in groups of G "
        "by problem id",
    ]
    assert grpo.data.grouped([7, 7, 3, 3], 2, 2) and not grpo.data.grouped([7, 7, 7, 7], 2, 2)
    assert not grpo.data.grouped([7, 7, 3, 3, 5, 5], 2, 2) and not grpo.data.grouped([7, 7, 3], 2, 2)


def test_with_vllm_every_step_gets_its_own_seed_in_the_kwargs_trl_reads_at_each_generation(grpo):
    from qmc_sampler.counter_rng import Purpose, counter_seed

    server = {"vllm_xargs": {"qmc_method": "iid", "qmc_seed": 5}}
    seeds = []
    for call in range(3):
        grpo.training.vllm_step_seed(server, "server", 5, call)
        seeds.append(server["vllm_xargs"]["qmc_seed"])
    assert len(set(seeds)) == 3 and server["vllm_xargs"]["qmc_method"] == "iid"
    assert seeds[0] == counter_seed(5, Purpose.HF_CALL_SEED, 0, 0)  # patch_generate's call seed
    colocate = {"extra_args": {"qmc_method": "lattice", "qmc_seed": 5}}
    grpo.training.vllm_step_seed(colocate, "colocate", 5, 2)
    assert colocate["extra_args"]["qmc_seed"] == seeds[2]
    # TRL (read, not imported: vLLM's import is slow) keeps its VLLMGeneration as trainer.vllm_generation
    # and reads self.generation_kwargs inside generate, at every generation.
    trl = Path(importlib.util.find_spec("trl").origin).parent
    assert "self.vllm_generation = VLLMGeneration(" in (trl / "trainer" / "grpo_trainer.py").read_text()
    tree = ast.parse((trl / "generation" / "vllm_generation.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VLLMGeneration"]
    (generate,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "generate"]
    assert ast.unparse(generate).count("self.generation_kwargs") == 2  # server mode and colocate mode


def test_a_task_that_cannot_give_its_problems_is_one_line_naming_task_and_data_seed(grpo, capsys):
    class Dry:  # as basic_arithmetic where its one-shot example pool runs dry: next() raises StopIteration
        def problems(self, count, seed):
            raise StopIteration

    args = argparse.Namespace(task="basic_arithmetic", heldout=4, prompts=2, data_seed=7)
    with pytest.raises(SystemExit) as exit_:
        grpo.data.split_problems(Dry(), args, grpo.plan.OneLineParser(prog="grpo_steps.py"))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "grpo_steps.py: error: --task basic_arithmetic --data-seed 7: the task could not give its problems "
        "(StopIteration: no message); try another --data-seed"
    ]


PLAN_ARGS = ("--seeds", "10", "--task-option", "max_terms=3", "--learning-rate", "2e-6")


def write_plan(path, settings, threshold=0.3):
    rule = {"settings": settings, "alpha": 0.05, "margin": 0.01, "threshold": threshold}
    path.write_text(f"# Plan\n\n```json\n{json.dumps(rule)}\n```\n")
    return str(path)


def test_print_settings_gives_a_plan_its_settings_and_a_plan_that_differs_is_refused_before_anything_runs(
    warm_python, tmp_path
):
    printed = grpo_steps(warm_python, *PLAN_ARGS, "--print-settings")
    assert printed.returncode == 0, printed.stderr[-2000:]
    settings = json.loads(printed.stdout[printed.stdout.index("{") :])
    assert settings["seeds"] == 10 and settings["task_options"] == {"max_terms": 3} and "plan" not in settings
    assert settings["trl"]["loss_type"] == "dapo" and settings["learning_rate"] == 2e-6
    plan = write_plan(tmp_path / "plan.md", settings | {"learning_rate": 1e-5})
    done = grpo_steps(warm_python, *PLAN_ARGS, "--plan", plan, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "these arguments differ from the plan's settings (learning_rate)" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_plan_written_from_the_printed_settings_is_accepted_and_its_rule_gives_a_verdict(grpo, tmp_path):
    """The plan path end to end in this process: the arguments' settings as the plan's, the header's
    identity with the plan's path and hash, and the verdict from runs with their end lines."""
    args, _ = grpo.plan.parse_args([*PLAN_ARGS, "--print-settings"], "")
    settings = grpo.plan.settings(args)
    plan = write_plan(tmp_path / "plan.md", settings)
    args, _ = grpo.plan.parse_args([*PLAN_ARGS, "--plan", plan], "")
    ident = grpo.plan.identity(args)
    assert ident["plan"]["path"] == plan and len(ident["plan"]["sha256"]) == 64
    points = grpo.plan.eval_steps(16, 2)
    qmc = lambda design: {"method": design, "groups": 4 * 16, "unsampleable": 0, "copies_only_calls": 0}  # noqa: E731
    runs = {
        design: {
            s: {
                "heldout": {t: 0.2 + t / 100 + lift * (s + 1) for t in points},
                "end": {"qmc": qmc(design), "batch_warnings": 0},
            }
            for s in range(10)
        }
        for design, lift in (("iid", 0.0), ("lattice", 0.01))
    }
    line = grpo.report.verdict_line(runs, ident)
    assert line.startswith(f"verdict by the plan's rule ({plan}): lattice vs iid on held-out AUC: FASTER "), line


def test_rollout_streams_give_one_training_seed_independent_rollout_seeds(grpo):
    """Stream 0 is the training seed's own (the runs before streams existed); others hash (seed, stream)."""
    seeds = {(s, k): grpo.training.rollout_seed(s, k) for s in range(3) for k in range(3)}
    assert all(seeds[(s, 0)] == s for s in range(3))
    assert len(set(seeds.values())) == len(seeds)


def test_a_plan_that_leaves_out_a_setting_is_refused_even_where_the_arguments_give_none(grpo, tmp_path, capsys):
    """ "model": null (the default model) is a setting like any other: a plan without it differs."""
    args, _ = grpo.plan.parse_args([*PLAN_ARGS, "--print-settings"], "")
    settings = {k: v for k, v in grpo.plan.settings(args).items() if k != "model"}
    plan = write_plan(tmp_path / "plan.md", settings)
    with pytest.raises(SystemExit) as exited:
        grpo.plan.parse_args([*PLAN_ARGS, "--plan", plan], "")
    assert exited.value.code == 2 and "differ from the plan's settings (model)" in capsys.readouterr().err
