"""benchmarks/rollout_diversity.py's choice of problems, without an engine: distinct prompts, each
at its first occurrence, in the order drawn, and the one-line refusals (the quick form that runs
both paths is tests/benchmarks/test_quick_forms.py's)."""

import json
import sys

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed")

from qmc_sampler.eval.tasks.catalog import get_task


@pytest.fixture(scope="module")
def rollout(benchmark_script):
    """The script as a module (importing it runs nothing)."""
    return benchmark_script("rollout_diversity")


def test_distinct_problems_keep_the_order_drawn_and_each_prompts_first_problem(rollout, tmp_path, capsys):
    # a, b, a's prompt again (c), d: the first three distinct are a, b, d — a first.
    rows = [("a", "1 + 1"), ("b", "2 + 2"), ("c", "1 + 1"), ("d", "3 + 3")]
    path = tmp_path / "repeats.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": text, "answer": 0}) + "\n" for i, text in rows))
    task = get_task(f"jsonl:{path}")
    parser = rollout.OneLineParser(prog="rollout_diversity.py")
    assert [pr.problem_id for pr in rollout._distinct(task, 3, 0, parser)] == ["a", "b", "d"]
    assert [pr.problem_id for pr in rollout._distinct(task, 1, 0, parser)] == ["a"]
    with pytest.raises(SystemExit) as exit_:
        rollout._distinct(task, 4, 0, parser)  # 3 distinct prompts in the 4 problems of the file
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rollout_diversity.py: error: --problems 4: 3 distinct problems in 4 drawn from jsonl:{path}; "
        "ask for fewer, or more with --task-option (e.g. max_digits=2)"
    ]


def test_distinct_arithmetic_problems_are_the_first_occurrences_in_the_order_drawn(rollout):
    task = get_task("basic_arithmetic")  # about 240 prompts: 300 draws repeat many
    first: dict[str, object] = {}
    for pr in task.problems(300, 0):
        first.setdefault(repr(pr.messages), pr)
    chosen = rollout._distinct(task, 100, 0, rollout.OneLineParser(prog="rollout_diversity.py"))
    assert [pr.problem_id for pr in chosen] == [pr.problem_id for pr in list(first.values())[:100]]
    assert chosen[0].problem_id == 0


def test_a_task_option_the_task_does_not_take_is_one_line_and_exit_code_2(rollout, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # (main sets it if unset)
    monkeypatch.setattr(sys, "argv", ["rollout_diversity.py", "--backend", "hf", "--task-option", "no_such_key=2"])
    with pytest.raises(SystemExit) as exit_:
        rollout.main()
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("rollout_diversity.py: error: --task-option: ") and "no_such_key" in lines[0], lines
