"""Evaluation tasks: prompts in the model's chat format, answer extraction, verifiers.

Reasoning tasks come from reasoning-gym's seeded generators and are scored with
each dataset's own ``score_answer`` on the text of the *last*
``<answer>…</answer>`` of the completion (strict: a completion without one is
wrong; only a full score of 1.0 counts as correct). Prompts are one-shot: a system
instruction, then one solved example drawn from the same generator with a
different seed (never from the test set) as a user/assistant pair, then the
question. For arithmetic families the example's answer is *worked*
(``5 - 3 = 2\\n<answer>2</answer>``), which measurably helps a 135M model
(``../shared/design/assets.md``).

The QuasiMoTTo paper's four families are here (countdown, maze, mini_sudoku,
arc_1d) plus easier ones on which the default model succeeds a few to fifty
percent of the time (basic_arithmetic — the default — and products).
HumanEval lives in :mod:`qmc_sampler.eval.tasks.humaneval`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAILURES",
    "TASKS",
    "Problem",
    "ReasoningGymTask",
    "Task",
    "Verdict",
    "extract_answer",
    "get_task",
    "positive_option",
]

SYSTEM_PROMPT = (
    "You are a careful assistant. Solve the problem, then give the final answer between <answer> and </answer> tags."
)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    """One problem of a task.

    Attributes:
        task: the task's name. problem_id: the problem's id within the task (an
            index for built-in tasks; the file's ``id`` for your own).
        messages: the chat prompt (OpenAI message dicts), or None for a plain prompt.
        reference: the gold answer (for reports). data: what the verifier needs.
        prompt: the plain text prompt, for problems without ``messages``.
    """

    task: str
    problem_id: int | str
    messages: list[dict[str, str]] | None
    reference: str
    data: dict[str, Any] = field(default_factory=dict, compare=False)
    prompt: str | None = None


#: Why a sample failed, as recorded in the samples file's ``failure`` field.
FAILURES = (
    "no_answer",  # no <answer>…</answer> (reasoning tasks) or no code (code tasks)
    "wrong_answer",  # an answer that the verifier rejects / a failed test assertion
    "syntax_error",  # code that does not compile
    "runtime_error",  # code that raised before its tests could pass
    "timeout",  # code that ran past the wall-clock limit
    "limit",  # code stopped by a resource limit (CPU time, memory, file size, processes)
)


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one completion.

    Attributes:
        correct: True iff the completion solves the problem.
        failure: why not (one of :data:`FAILURES`), None when correct.
    """

    correct: bool
    failure: str | None = None

    @classmethod
    def passed(cls) -> Verdict:
        return cls(True, None)

    @classmethod
    def failed(cls, why: str) -> Verdict:
        return cls(False, why)


class Task(ABC):
    """A family of problems with a verifier."""

    name: str
    #: Generation budget per sample (tokens).
    max_tokens: int = 32
    #: Stop strings (kept in the completion, so the verifier sees them).
    stop: tuple[str, ...] = ("</answer>",)

    @abstractmethod
    def problems(self, count: int, seed: int) -> list[Problem]:
        """``count`` problems, reproducible from ``seed``."""

    @abstractmethod
    def score(self, problem: Problem, completion: str) -> Verdict:
        """Whether ``completion`` solves ``problem``, and if not, why."""


def positive_option(name: str, value: Any, kind: type = int) -> Any:
    """A task option that must be an integer >= 1 (``kind`` int) or a finite number > 0 (``kind`` float).

    Raises:
        ValueError: naming ``--task-option NAME`` and the value, when it is not such a number.
    """
    try:
        number = kind(value)
        ok = not isinstance(value, bool) and 0 < number < float("inf") and (kind is float or number == float(value))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        what = "an integer >= 1" if kind is int else "a finite number > 0"
        raise ValueError(f"--task-option {name}={value!r} must be {what}")
    return number


def extract_answer(completion: str) -> str | None:
    """The text of the last ``<answer>…</answer>`` (a missing closing tag ends at the end)."""
    matches = _ANSWER.findall(completion)
    return matches[-1].strip() if matches else None


def _worked_arithmetic(question: str, answer: str) -> str:
    # "Calculate 5 - 3." -> "5 - 3 = 2"; "...: 4 * 7. Give only..." -> "4 * 7 = 28"
    expression = re.search(r"(-?\d[\d\s+\-*/().]*\d\)?)", question)
    worked = f"{expression.group(1).strip()} = {answer}\n" if expression else ""
    return f"{worked}<answer>{answer}</answer>"


@dataclass(frozen=True)
class _Family:
    dataset: str
    config: dict[str, Any]
    worked: bool
    max_tokens: int


FAMILIES: dict[str, _Family] = {
    "basic_arithmetic": _Family(
        "basic_arithmetic",
        dict(
            min_terms=2,
            max_terms=2,
            min_digits=1,
            max_digits=1,
            operators=("+", "-"),
            allow_parentheses=False,
            allow_negation=False,
        ),
        worked=True,
        max_tokens=24,
    ),
    "products": _Family("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), True, 24),
    "countdown": _Family("countdown", dict(min_numbers=3, max_numbers=3, min_target=10, max_target=100), False, 48),
    "maze": _Family("maze", dict(min_grid_size=5, max_grid_size=5, min_dist=1, max_dist=2), False, 24),
    "mini_sudoku": _Family("mini_sudoku", dict(min_empty=2, max_empty=4), False, 64),
    "arc_1d": _Family("arc_1d", dict(min_size=8, max_size=8), False, 48),
    # GSM8K-style grade-school math, generated offline from GSM8K templates (reasoning-gym).
    "gsm_symbolic": _Family("gsm_symbolic", {}, False, 256),
}


class ReasoningGymTask(Task):
    """A reasoning-gym family with a one-shot prompt and the dataset's own scorer.

    Args:
        name: a key of :data:`FAMILIES`.
        **overrides: generator settings (difficulty) replacing the family's defaults.
    """

    def __init__(self, name: str, **overrides: Any) -> None:
        family = FAMILIES[name]
        self.name = name
        self.family = family
        self.config = family.config | overrides
        self.max_tokens = family.max_tokens
        self._datasets: dict[tuple[int, int], Any] = {}

    def _dataset(self, count: int, seed: int) -> Any:
        import reasoning_gym

        key = (count, seed)
        if key not in self._datasets:
            self._datasets[key] = reasoning_gym.create_dataset(
                self.family.dataset, size=count, seed=seed, **self.config
            )
        return self._datasets[key]

    def problems(self, count: int, seed: int) -> list[Problem]:
        data = self._dataset(count, seed)
        questions = {data[i]["question"] for i in range(count)}
        # The example comes from another seed of the same generator, never from the test set.
        pool = self._dataset(64, seed + 1_000_003)
        example = next(pool[i] for i in range(64) if pool[i]["question"] not in questions)
        shown = (
            _worked_arithmetic(example["question"], example["answer"])
            if self.family.worked
            else f"<answer>{example['answer']}</answer>"
        )
        problems = []
        for i in range(count):
            entry = data[i]
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": example["question"]},
                {"role": "assistant", "content": shown},
                {"role": "user", "content": entry["question"]},
            ]
            problems.append(Problem(self.name, i, messages, str(entry["answer"]), {"seed": seed, "count": count}))
        return problems

    def score(self, problem: Problem, completion: str) -> Verdict:
        answer = extract_answer(completion)
        if answer is None:
            return Verdict.failed("no_answer")
        data = self._dataset(problem.data["count"], problem.data["seed"])
        if data.score_answer(answer, data[problem.problem_id]) == 1.0:
            return Verdict.passed()
        return Verdict.failed("wrong_answer")


def _humaneval(**overrides: Any) -> Task:
    from qmc_sampler.eval.tasks.humaneval import HumanEvalTask

    return HumanEvalTask(**overrides)


TASKS: tuple[str, ...] = (*FAMILIES, "humaneval")
#: Prefix of your own task files: ``jsonl:PATH`` (see :mod:`qmc_sampler.eval.tasks.jsonl_task`).
JSONL_PREFIX = "jsonl:"


def get_task(name: str, **overrides: Any) -> Task:
    """The task registered under ``name`` (one of :data:`TASKS`, or ``jsonl:PATH``).

    Raises:
        ValueError: an unknown task name (or a bad task file: ``TaskFileError``).
    """
    if name.startswith(JSONL_PREFIX):
        from qmc_sampler.eval.tasks.jsonl_task import JsonlTask

        return JsonlTask(name.removeprefix(JSONL_PREFIX), **overrides)
    if name == "humaneval":
        return _humaneval(**overrides)
    if name not in FAMILIES:
        raise ValueError(f"task={name!r} is not a task; use one of {list(TASKS)} or jsonl:PATH")
    return ReasoningGymTask(name, **overrides)
