"""Your own problems (``--task jsonl:PATH``) and the built-in verifiers."""

import json
import subprocess
import sys

import pytest
from qmc_sampler.eval.tasks.catalog import Verdict, get_task
from qmc_sampler.eval.tasks.jsonl_task import JsonlTask, TaskFileError
from qmc_sampler.eval.tasks.verifiers import load_verifier, normalize, numeric_answer


def write(tmp_path, rows, name="task.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_problems_come_from_the_file_with_their_ids(tmp_path):
    path = write(
        tmp_path,
        [
            {"prompt": "2 + 2 =", "answer": 4, "id": "sum"},
            {"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"},
        ],
    )
    task = get_task(f"jsonl:{path}", verifier="exact")
    first, second = task.problems(10, seed=0)
    assert (first.problem_id, first.prompt, first.messages, first.reference) == ("sum", "2 + 2 =", None, "4")
    assert (second.problem_id, second.prompt) == (1, None) and second.messages[0]["role"] == "user"
    assert task.score(second, "  paris. ") == Verdict(True, None)
    assert task.score(second, "Lyon") == Verdict(False, "wrong_answer")


@pytest.mark.parametrize(
    ("verifier", "completion", "answer", "verdict"),
    [
        ("answer_tag", "I think <answer> Paris </answer>", "paris", Verdict(True, None)),
        ("answer_tag", "Paris", "paris", Verdict(False, "no_answer")),
        ("answer_tag", "<answer>Rome</answer>", "Paris", Verdict(False, "wrong_answer")),
        ("exact", "The  Answer.", "the answer", Verdict(True, None)),
        ("numeric", "so it costs $1,250.00 in total", "1250", Verdict(True, None)),
        ("numeric", "<answer>3.5</answer> or 4", "3.5", Verdict(True, None)),
        ("numeric", "about 12", "13", Verdict(False, "wrong_answer")),
        ("numeric", "no idea", "13", Verdict(False, "no_answer")),
        ("regex", "the result is 42!", r"\b42\b", Verdict(True, None)),
        ("regex", "the result is 420", r"\b42\b", Verdict(False, "wrong_answer")),
    ],
)
def test_built_in_verifiers(verifier, completion, answer, verdict):
    assert load_verifier(verifier)(completion, answer, {}) == verdict


def test_normalisation():
    assert normalize("  Ｆｕｌｌ\twidth  Text. ") == "full width text"


def shouting_verifier(completion, answer, problem):
    """A custom verifier for the test below: the answer, in capitals."""
    return completion.strip() == str(answer).upper()


def test_a_custom_verifier_by_module_and_function(tmp_path):
    path = write(tmp_path, [{"prompt": "say hi", "answer": "hi"}])
    task = JsonlTask(str(path), verifier=f"{__name__}:shouting_verifier")
    (problem,) = task.problems(1, 0)
    assert task.score(problem, "HI").correct and task.score(problem, "hi").failure == "wrong_answer"
    with pytest.raises(ValueError, match=r"verifier='nope' is not a verifier; use one of \['answer_tag'"):
        JsonlTask(str(path), verifier="nope")


BAD_LINES = [
    ("not json", r":1: not valid JSON"),
    ('["a list"]', r":1: expected a JSON object"),
    ({"answer": 1}, r":1: give exactly one of fields 'prompt' and 'messages'"),
    ({"prompt": "x", "messages": [], "answer": 1}, r":1: give exactly one of fields 'prompt' and 'messages'"),
    ({"prompt": "", "answer": 1}, r":1: field 'prompt' must be a non-empty string"),
    ({"messages": [{"role": "robot", "content": "x"}], "answer": 1}, r":1: field 'messages' needs objects"),
    ({"prompt": "x"}, r":1: field 'answer' is required"),
    ({"prompt": "x", "answer": [1]}, r":1: field 'answer' is required"),
    ({"prompt": "x", "answer": 1, "id": 1.5}, r":1: field 'id'=1.5 must be a string or an integer"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_bad_line_names_the_line_and_the_field(tmp_path, line, message):
    with pytest.raises(TaskFileError, match=message):
        JsonlTask(str(write(tmp_path, [line])))


NUMBERS = [42, -3.5, 1e-07, " $1,024.5 ", "-7", "+2e3", "1,000,000"]
NOT_NUMBERS = ["Paris", ".5", "3/4", "1,2", "1_000", "\u22123", "42 apples", "1e999", 10**400]


def test_an_answer_that_is_not_one_number_is_refused_for_the_numeric_verifier_before_any_sample(tmp_path):
    rows = [{"prompt": "x", "answer": answer} for answer in NUMBERS]
    task = JsonlTask(str(write(tmp_path, rows)), verifier="numeric")
    got = [numeric_answer(p.reference) for p in task.problems(len(rows), 0)]
    assert got == [42.0, -3.5, 1e-07, 1024.5, -7.0, 2000.0, 1e6]
    for bad in NOT_NUMBERS:
        path = write(tmp_path, [*rows, {"prompt": "z", "answer": bad}])
        with pytest.raises(TaskFileError, match=rf":{len(rows) + 1}: field 'answer'=.* is not one number \(verifier"):
            JsonlTask(str(path), verifier="numeric")
        assert JsonlTask(str(path)).problems(len(rows) + 1, 0)[-1].reference == str(bad)  # any suits answer_tag


def test_repeated_ids_and_empty_files_are_refused(tmp_path):
    with pytest.raises(TaskFileError, match=r":2: field 'id'='a' repeats line 1"):
        JsonlTask(
            str(write(tmp_path, [{"prompt": "x", "answer": 1, "id": "a"}, {"prompt": "y", "answer": 2, "id": "a"}]))
        )
    with pytest.raises(TaskFileError, match="holds no problems"):
        JsonlTask(str(write(tmp_path, [""])))
    with pytest.raises(TaskFileError, match="no such task file"):
        JsonlTask(str(tmp_path / "missing.jsonl"))


def test_the_cli_reports_a_bad_task_file_in_one_line_with_exit_code_2(tmp_path):
    path = write(tmp_path, [{"prompt": "x", "answer": 1}, {"prompt": "y"}])
    done = subprocess.run(
        [sys.executable, "-m", "qmc_sampler.eval", "run", "--task", f"jsonl:{path}", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"qmc-eval: error: {path}:2: field 'answer' is required (a string or a number)"
