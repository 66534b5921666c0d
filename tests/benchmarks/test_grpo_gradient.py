"""benchmarks/grpo_gradient.py's quick form on the tiny model: real TRL generation, scoring and loss, the
record and its resume, the refusals; and the error estimates against gradients whose errors are known."""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl", reason="TRL not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_gradient.py"
PROMPTS, G = 2, 4  # --quick


def grpo_gradient(warm_python, *argv: str):
    return warm_python.run([str(SCRIPT), *argv], cwd=SCRIPT.parents[1], timeout=300)


#: Six prompts of the tiny model's corpus (the quick form's 2 training and 4 held-out problems).
PROMPT_TEXTS = ("the quick brown", "sphinx of black quartz", "pack my box with", "how vexingly quick",
                "one two three", "def add(a, b):")  # fmt: skip


@pytest.fixture(scope="module")
def mixed_reward_task(tmp_path_factory, tiny_model_dir, hf_model):
    """A JSONL task (regex verifier) on which the tiny model's rollouts get mixed rewards: each answer
    matches the completions that start with one of the first tokens holding the top ≥ 35% of the
    model's own probability after the prompt. (basic_arithmetic gives the random model 0 on every
    rollout: zero advantages, zero gradients, nothing of the loss path checked.)"""
    import re

    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    special = set(tokenizer.all_special_ids)
    rows = []
    for i, text in enumerate(PROMPT_TEXTS):
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokenizer.encode(text)])).logits[0, -1]
        chosen, mass = [], 0.0
        for q, token in zip(*torch.sort(torch.softmax(logits, -1), descending=True), strict=True):
            if int(token) in special:
                continue
            chosen.append(re.escape(tokenizer.decode([int(token)])))
            mass += float(q)
            if mass >= 0.35:
                break
        rows.append({"id": f"p{i}", "prompt": text, "answer": "^(?:" + "|".join(chosen) + ")"})
    path = tmp_path_factory.mktemp("grpo-gradient-task") / "first_tokens.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["--task", f"jsonl:{path}", "--task-option", "verifier=regex"]


@pytest.fixture(scope="module")
def quick_run(quick_record, tmp_path_factory, mixed_reward_task):
    out = tmp_path_factory.mktemp("grpo-gradient")
    return out, *quick_record("grpo_gradient", out, "gradient.jsonl", *mixed_reward_task)


def test_each_prompt_has_two_groups_per_design_and_their_gradient_distances(quick_run):
    _, _, first, records = quick_run
    header, *lines = records
    assert header["identity"]["designs"] == ["iid", "lattice"] and header["identity"]["trl"]["loss_type"] == "dapo"
    assert len(lines) == PROMPTS and len({ln["problem_id"] for ln in lines}) == PROMPTS
    mixed = 0
    for ln in lines:
        for design in ("iid", "lattice"):
            assert len(ln["groups"][design]) == 2
            for group in ln["groups"][design]:
                assert len(group["rewards"]) == G and 1 <= group["distinct_per_group"] <= G
                assert 1 <= group["distinct_answers_per_group"] <= G and 0 < group["tokens"] <= G * 8
        d = ln["distances"]
        assert len(d["di"]) == 4 and min(d["ii"], d["dd"], *d["di"]) >= 0
        # a group whose rewards are all equal has zero advantages and a gradient of exactly 0; any other,
        # a gradient that reaches the last layer
        for design, key in (("iid", "iid"), ("lattice", "design")):
            for group, norm in zip(ln["groups"][design], d["norms"][key], strict=True):
                assert (norm > 0) == (group["zero_var_share"] < 1.0), (group, norm)
                mixed += group["zero_var_share"] < 1.0
    assert mixed >= 1  # the task gives mixed rewards, so the loss path is checked
    assert (
        "gradient error E‖ĝ − g‖² (last layer): iid " in first.stdout and f"{PROMPTS}/{PROMPTS} prompts" in first.stdout
    )


def test_a_rerun_measures_nothing_and_prints_the_same_report(quick_run, warm_python):
    out, argv, first, records = quick_run
    again = grpo_gradient(warm_python, *argv)
    assert again.returncode == 0 and f"{PROMPTS}/{PROMPTS} prompts" not in again.stdout, again.stdout
    report = lambda text: text[text.index("CPU: ") :]  # noqa: E731
    assert report(again.stdout) == report(first.stdout)
    assert [json.loads(line) for line in (out / "gradient.jsonl").read_text().splitlines()] == records


def test_a_cut_off_file_resumes_with_the_seeds_an_uninterrupted_run_drew(quick_run, warm_python, tmp_path):
    """--quick measures its 2 prompts in 2 chunks: with the second line cut, the rerun skips the first
    chunk and redoes the second with its own group seeds (keyed by the chunk's first prompt)."""
    out, argv, _, records = quick_run
    cut = tmp_path / "gradient.jsonl"
    cut.write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    argv = [a if a != str(out) else str(tmp_path) for a in argv]
    again = grpo_gradient(warm_python, *argv)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"{PROMPTS}/{PROMPTS} prompts" in again.stdout and f"1/{PROMPTS} prompts" not in again.stdout
    resumed = [json.loads(line) for line in cut.read_text().splitlines()]
    assert resumed[:-1] == records[:-1] and resumed[-1]["problem_id"] == records[-1]["problem_id"]
    assert resumed[-1]["group_seeds"] == records[-1]["group_seeds"] != records[1]["group_seeds"]


def test_other_arguments_on_the_same_file_are_refused(quick_run, warm_python):
    out, argv, *_ = quick_run
    done = grpo_gradient(warm_python, *argv, "--seed", "1")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"grpo_gradient.py: error: {out / 'gradient.jsonl'} was written with other arguments (seed); "
        "use another --out or the same ones"
    ], done.stderr


#: A command line's words → what its one-line error must say.
REFUSALS = {
    "--designs lattice,iid": "--designs 'lattice,iid': give iid and one other design",
    "--prompts 0": "--prompts 0: must be an integer >= 1",
    "--generations 1": "--generations 1: must be an integer >= 2",
    "--task-option nope=1": "--task-option: BasicArithmeticDatasetConfig.__init__() got an unexpected",
    "--model no/such/folder --prompts 8": "--model: ",
}


def test_bad_arguments_get_one_line_and_exit_code_2(refused, tmp_path):
    for i, (words, message) in enumerate(REFUSALS.items()):  # each into a folder of its own, left empty
        refused("grpo_gradient", words.split(), tmp_path / str(i), "gradient.jsonl", message)


def test_the_error_estimates_are_unbiased_for_known_variances_and_bias(benchmark_script):
    """Gradients drawn around g: i.i.d. with variance 1 per coordinate, the design with variance 0.25
    and bias b (‖b‖² = 0.5): the per-prompt estimates average to i.i.d.'s error d·1, the design's
    d·0.25 + 0.5 and its variance d·0.25, within 4 standard errors over 4000 prompts."""
    gradient = benchmark_script("grpo_gradient")
    rng = np.random.default_rng(3)
    d, prompts = 8, 4000
    g, b = rng.normal(size=d), np.full(d, 0.25)
    lines = []
    for _ in range(prompts):
        iid = [g + rng.normal(size=d) for _ in range(2)]
        design = [g + b + 0.5 * rng.normal(size=d) for _ in range(2)]
        lines.append({"distances": gradient.distances(iid, design)})
    err = gradient.errors(lines)
    for key, expected in (("iid", d * 1.0), ("design", d * 0.25 + 0.5), ("design_variance", d * 0.25)):
        values = err[key]
        assert abs(values.mean() - expected) < 4 * values.std() / np.sqrt(prompts), (key, values.mean(), expected)


#: The committed mechanism runs and their commands' arguments (docs/performance.md): a later run resumes them.
COMMITTED = {
    "initial": ["--task-option", "max_terms=3", "--prompts", "256"],
}


@pytest.mark.parametrize("name", COMMITTED)
def test_the_committed_runs_can_be_resumed_by_their_commands(benchmark_script, name):
    """Today's identity of each documented command is its committed file's header: a change to the
    identity (a key, a TRL setting) would make the resume of a half-measured file refuse it."""
    script = benchmark_script("grpo_gradient")
    path = SCRIPT.parents[1] / "docs" / "results" / "grpo_gradient" / name / "gradient.jsonl"
    header = json.loads(path.read_text().splitlines()[0])
    args, _ = script.parse_args(COMMITTED[name])
    assert script.identity(args) == header["identity"]
