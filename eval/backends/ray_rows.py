"""A Ray run's members as Ray Data rows and back: the member table rows are made from, the
stage's output rows read back into groups, and what the stage does not return (``finish_reason``,
rows per engine).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from qmc_sampler.eval.backends.generation import Completion, GroupJob, OnGroup, member_xargs, prompt_token_ids
from qmc_sampler.eval.backends.ray_plan import RayBackendError

__all__ = ["PLUGIN_MARKER", "GroupResults", "MemberTable", "finish_reason", "member_output", "member_rows",
           "rows_per_engine"]  # fmt: skip

#: The admission record the plugin writes into a request's ``extra_args`` (``vllm_plugin/request_args.py``).
PLUGIN_MARKER = "'_qmc':"


def rows_per_engine(request_ids: Iterable[int]) -> list[int]:
    """How many rows each vLLM engine served, most first, from the rows' ``request_id``.

    Ray Data's vLLM stage numbers the requests of each engine 0, 1, 2, …, so the number
    of rows numbered ``i`` is the number of engines that served more than ``i`` rows,
    and each engine's count is read off those numbers (the conjugate partition). An
    engine restarted after a crash starts again at 0 and counts as another engine.
    Exact when no engine died mid-batch (a lost batch leaves a gap in its numbers).
    """
    counts = Counter(request_ids)
    return _engine_rows([counts[i] for i in range(max(counts, default=-1) + 1)])


def _engine_rows(numbered: Sequence[int]) -> list[int]:
    """:func:`rows_per_engine` from ``numbered[i]`` = the rows whose ``request_id`` is ``i``."""
    engines = numbered[0] if numbered else 0
    return [sum(1 for c in numbered if c >= e) for e in range(1, engines + 1)]


def finish_reason(tokens: list[int], text: str, max_tokens: int, stop: Iterable[str], stop_ids: set[int]) -> str:
    """vLLM's ``finish_reason`` of a finished member, from its tokens (the stage does not return it).

    vLLM (0.32, ``v1/core/sched/utils.py::check_stop``) stops with ``stop`` on an EOS or
    stop token before it checks the length, and a stop string (kept in the text:
    ``include_stop_str_in_output``) is ``stop`` as well; otherwise a member with
    ``max_tokens`` tokens was cut at the length. (A member cut by the model's context
    length instead is reported ``stop``: the prompts of evaluation tasks are short.)
    """
    if tokens and tokens[-1] in stop_ids:
        return "stop"
    if len(tokens) >= max_tokens and not any(s and text.endswith(s) for s in stop):
        return "length"
    return "stop"


@dataclass(frozen=True)
class MemberTable:
    """The run's members as flat arrays, one entry per group: what the rows are made from, in Ray tasks.

    Member serial ``s`` (``0 ≤ s <`` :attr:`rows`) is member ``s - starts[j]`` of group ``j``, where
    ``starts[j] ≤ s < starts[j + 1]``. Each distinct prompt's token ids are stored once
    (``tokens[bounds[p]:bounds[p + 1]]``, ``p = prompt_of[j]``), not once per member: the samplers
    of a run share their problems' prompts, and a group's n members share one.

    Attributes:
        starts: ``[groups + 1]`` int64, the serial of each group's member 0 (and the total last).
        prompt_of: ``[groups]`` int64, each group's prompt. tokens: ``[Σ prompt lengths]`` int64.
        bounds: ``[prompts + 1]`` int64, each prompt's span in ``tokens``.
        xargs: each group's ``extra_args`` but ``qmc_index`` (:func:`member_xargs`).
        sampling: each group's sampling parameters (``n = 1``, stop strings kept in the text).
    """

    starts: np.ndarray
    prompt_of: np.ndarray
    tokens: np.ndarray
    bounds: np.ndarray
    xargs: tuple[dict[str, Any], ...]
    sampling: tuple[dict[str, Any], ...]

    @classmethod
    def build(cls, jobs: Sequence[GroupJob], tokenizer: Any) -> MemberTable:
        """Tokenize each distinct prompt of ``jobs`` once (:func:`prompt_token_ids`) and number the members."""
        prompts: dict[str, int] = {}
        pieces: list[list[int]] = []
        samplings: dict[int, dict[str, Any]] = {}  # by id(): the runner's jobs share one dict
        prompt_of, xargs, sampling = [], [], []
        for job in jobs:
            key = repr(job.messages) if job.messages is not None else "\0" + str(job.prompt)
            if key not in prompts:
                prompts[key] = len(pieces)
                pieces.append(prompt_token_ids(tokenizer, job))
            prompt_of.append(prompts[key])
            xargs.append({k: v for k, v in member_xargs(job, 0).items() if k != "qmc_index"})
            if id(job.sampling) not in samplings:
                samplings[id(job.sampling)] = {**job.sampling, "n": 1, "include_stop_str_in_output": True}
            sampling.append(samplings[id(job.sampling)])
        return cls(
            starts=np.concatenate([[0], np.cumsum([job.n for job in jobs], dtype=np.int64)]).astype(np.int64),
            prompt_of=np.asarray(prompt_of, dtype=np.int64),
            tokens=np.asarray([t for piece in pieces for t in piece], dtype=np.int64),
            bounds=np.concatenate([[0], np.cumsum([len(piece) for piece in pieces], dtype=np.int64)]).astype(np.int64),
            xargs=tuple(xargs),
            sampling=tuple(sampling),
        )

    @property
    def rows(self) -> int:
        """Members (rows) in all."""
        return int(self.starts[-1])

    def row(self, serial: int) -> dict[str, Any]:
        """Member ``serial``'s row: its prompt's token ids and its sampling parameters.

        ``extra_args`` are the member's explicit place in its group; every row has the same keys, none
        null (Arrow unifies the rows' nested structs). ``qmc_job`` and ``qmc_member`` say which member a
        row is when it comes back.
        """
        j = int(np.searchsorted(self.starts, serial, side="right")) - 1
        member, p = serial - int(self.starts[j]), int(self.prompt_of[j])
        return {
            "qmc_job": j,
            "qmc_member": member,
            "tokenized_prompt": self.tokens[self.bounds[p] : self.bounds[p + 1]].tolist(),
            "sampling_params": {**self.sampling[j], "extra_args": {**self.xargs[j], "qmc_index": member}},
        }


def member_rows(batch: dict[str, np.ndarray], table: MemberTable) -> Any:
    """Ray Data map (runs in a Ray task): a block of member serials (``ray.data.range``) → their rows."""
    import pyarrow as pa

    return pa.Table.from_pylist([table.row(int(serial)) for serial in batch["id"]])


def member_output(row: dict[str, Any]) -> dict[str, Any]:
    """Ray Data postprocess (runs in a Ray task): keep what the driver needs of an output row."""
    return {
        "qmc_job": row["qmc_job"],
        "qmc_member": row["qmc_member"],
        "text": row["generated_text"],
        "tokens": [int(t) for t in row["generated_tokens"]],
        "request_id": row["request_id"],
        "admitted": PLUGIN_MARKER in row["params"],
    }


class GroupResults:
    """The driver's results: the completions of the groups still open, and one byte per finished group.

    A group's completions are handed to ``on_group`` (and dropped) as its last member comes in, so
    what is held is bounded by the rows in flight, not by the run. Request ids are tallied in one
    array (4 bytes per id an engine handed out) for :func:`rows_per_engine`.
    """

    def __init__(self, jobs: Sequence[GroupJob], on_group: OnGroup, stop_ids: set[int]) -> None:
        self.jobs, self.on_group, self.stop_ids = jobs, on_group, stop_ids
        self.finished = bytearray(len(jobs))
        self.open: dict[int, dict[int, Completion]] = {}
        self.numbered = array("I")  # numbered[i]: the rows whose request_id is i
        self.duplicates = 0
        self.kept = 0

    def add(self, row: Mapping[str, Any]) -> None:
        """Take one output row of the stage (after :func:`member_output`)."""
        j, member = int(row["qmc_job"]), int(row["qmc_member"])
        job = self.jobs[j]
        if not row["admitted"]:
            raise RayBackendError(
                f"a Ray replica does not run the qmc-sampler plugin (member {member} of {job.group_id} was "
                f"admitted without it): install qmc-llm-sampler where the replicas run"
            )
        got = self.open.setdefault(j, {}) if not self.finished[j] else None
        if got is None or member in got:
            self.duplicates += 1
            return
        request = int(row["request_id"])
        if request >= len(self.numbered):
            self.numbered.extend([0] * (request + 1 - len(self.numbered)))
        self.numbered[request] += 1
        text, tokens = row["text"], list(row["tokens"])
        reason = finish_reason(tokens, text, job.sampling["max_tokens"], job.sampling.get("stop", ()), self.stop_ids)
        got[member] = Completion(text, reason, tuple(tokens))
        self.kept += 1
        if len(got) == job.n:
            del self.open[j]
            self.finished[j] = 1
            self.on_group(job, [got[m] for m in range(job.n)])

    def engine_rows(self) -> list[int]:
        return _engine_rows(self.numbered)
