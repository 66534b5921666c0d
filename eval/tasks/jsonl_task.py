"""Your own problems: ``--task jsonl:PATH``, one problem per line.

Each line is a JSON object with

* ``prompt`` (a string, sent to ``/v1/completions`` as it is) **or** ``messages``
  (OpenAI chat messages, rendered with the model's chat template);
* ``answer`` — the reference the verifier compares against (a string or a number);
* ``id`` (optional) — a unique id, string or integer (default: the line's index among problems).

The verifier is chosen with ``--task-option verifier=…`` (default ``answer_tag``;
see :mod:`qmc_sampler.eval.tasks.verifiers`), the generation budget with
``--max-tokens`` (default 256). The whole file is checked when the task is
built: a bad line is an error ``PATH:LINE: …`` naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qmc_sampler.eval.tasks.catalog import Problem, Task, Verdict, positive_option
from qmc_sampler.eval.tasks.verifiers import load_verifier, numeric_answer

__all__ = ["JsonlTask", "TaskFileError"]

_ROLES = {"system", "developer", "user", "assistant", "tool"}


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file, the line and the field."""


class JsonlTask(Task):
    """Problems from a JSONL file, scored by a verifier (see module docstring).

    Args:
        path: the file; verifier: a verifier name (see :func:`qmc_sampler.eval.tasks.verifiers.load_verifier`);
        max_tokens: the generation budget per sample.

    Raises:
        TaskFileError: the file is missing, or a line is malformed.
        ValueError: an unknown verifier, or ``max_tokens`` not an integer >= 1.
    """

    def __init__(self, path: str, verifier: str = "answer_tag", max_tokens: int = 256) -> None:
        self.path = Path(path)
        self.name = f"jsonl:{path}"
        self.verifier_name = verifier
        self.verify = load_verifier(verifier)
        self.max_tokens = positive_option("max_tokens", max_tokens)
        self.stop = ("</answer>",) if verifier in ("answer_tag", "numeric") else ()
        self._rows = _read(self.path, numeric=verifier == "numeric")

    def problems(self, count: int, seed: int) -> list[Problem]:
        """The first ``count`` problems of the file (all of them if it has fewer)."""
        out = []
        for row in self._rows[:count]:
            messages = row.get("messages")
            out.append(
                Problem(self.name, row["id"], messages, str(row["answer"]), {"row": row}, prompt=row.get("prompt"))
            )
        return out

    def score(self, problem: Problem, completion: str) -> Verdict:
        result = self.verify(completion, problem.reference, problem.data["row"])
        if isinstance(result, Verdict):
            return result
        return Verdict.passed() if result else Verdict.failed("wrong_answer")


def _read(path: Path, numeric: bool) -> list[dict[str, Any]]:
    # numeric: every answer must be one number (verifier 'numeric'), refused here rather than
    # when a sample is scored, after minutes of generation.
    if not path.is_file():
        raise TaskFileError(f"{path}: no such task file")
    rows: list[dict[str, Any]] = []
    seen: dict[Any, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TaskFileError(f"{where}: expected a JSON object with 'prompt' or 'messages' and 'answer'")
        _check_row(row, where)
        if numeric:
            try:
                numeric_answer(str(row["answer"]))
            except ValueError:
                message = f"{where}: field 'answer'={row['answer']!r} is not one number (verifier 'numeric')"
                raise TaskFileError(message) from None
        row.setdefault("id", len(rows))
        if row["id"] in seen:
            raise TaskFileError(f"{where}: field 'id'={row['id']!r} repeats line {seen[row['id']]}")
        seen[row["id"]] = number
        rows.append(row)
    if not rows:
        raise TaskFileError(f"{path}: the task file holds no problems")
    return rows


def _check_row(row: dict[str, Any], where: str) -> None:
    if ("prompt" in row) == ("messages" in row):
        raise TaskFileError(f"{where}: give exactly one of fields 'prompt' and 'messages'")
    if "prompt" in row and (not isinstance(row["prompt"], str) or not row["prompt"]):
        raise TaskFileError(f"{where}: field 'prompt' must be a non-empty string")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise TaskFileError(f"{where}: field 'messages' must be a non-empty list of chat messages")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise TaskFileError(
                    f"{where}: field 'messages' needs objects with 'role' (one of {sorted(_ROLES)}) and 'content' text"
                )
    if "answer" not in row or isinstance(row["answer"], (dict, list, bool)) or row["answer"] is None:
        raise TaskFileError(f"{where}: field 'answer' is required (a string or a number)")
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int))):
        raise TaskFileError(f"{where}: field 'id'={row['id']!r} must be a string or an integer")
