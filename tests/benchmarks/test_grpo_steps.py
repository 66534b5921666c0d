"""benchmarks/grpo_steps.py's quick form: real TRL GRPO steps, i.i.d. against lattice, on the tiny model.

The tiny model is random, so the task's reward is mostly 0: these tests check the
record (its structure, the pairing of designs by seed and prompts, lattice's groups),
the resume, and the refusals — not the figures. Each run is ``python SCRIPT`` in a fork
of the warm Python (torch and transformers already imported).
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_steps.py"
STEPS, PROMPTS, G = 2, 2, 4  # the script's --quick sizes


def grpo_steps(warm_python, *argv: str):
    return warm_python.run([str(SCRIPT), *argv], cwd=SCRIPT.parents[1], timeout=300)


@pytest.fixture(scope="module")
def quick_runs(tiny_model_dir, warm_python, tmp_path_factory):
    """The quick form run twice into one folder: the first trains, the second resumes."""
    out = tmp_path_factory.mktemp("grpo-steps")
    argv = ("--quick", "--model", tiny_model_dir, "--out", str(out))
    first = grpo_steps(warm_python, *argv)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
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
    ],
)
def test_bad_arguments_get_one_line_and_exit_code_2(warm_python, tmp_path, argv, message):
    done = grpo_steps(warm_python, *argv, "--out", str(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "steps.jsonl").exists()
