"""Turning groups into completions: every member is its own request, named by its index.

A group of n members is sent as n requests with ``n = 1`` and explicit plugin
arguments (``qmc_group``, ``qmc_index``, ``qmc_n``, ``qmc_seed``), so member i is
member i of the design whichever batch, engine or replica runs it, and the
samples file records each completion under its true member index. The same
group therefore comes out the same from an in-process engine
(:class:`InProcessBackend`) and from any number of OpenAI-compatible servers
running the plugin (:mod:`qmc_sampler.eval.backends.endpoints`) or from Ray Data's vLLM stage on
a Ray cluster (:mod:`qmc_sampler.eval.backends.ray_backend`).

A backend calls ``on_group(job, completions)`` as soon as all members of a job
are done, so results are written and progress moves group by group. A job may ask
for a contiguous range of its group's members only (``first``, ``count``): a round
of a group grown in rounds (:mod:`qmc_sampler.eval.runs.sequential`); backends that
serve such ranges say so with ``supports_rounds = True``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Completion",
    "DrawFailedError",
    "GroupJob",
    "InProcessBackend",
    "OnGroup",
    "member_xargs",
    "prompt_token_ids",
]


@dataclass(frozen=True)
class GroupJob:
    """One group to generate: who it is, what to prompt, how to sample.

    Attributes:
        key: ``(sampler, problem id, group index)`` — the group's identity in the samples file.
        messages: the chat prompt (OpenAI message dicts), or None for a plain prompt.
        prompt: the plain text prompt (when ``messages`` is None).
        n: group size; seed: group seed; method: the design; order: vocabulary order.
        sampling: sampling settings shared by the members (OpenAI / vLLM names:
            ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens``, ``stop``).
        first, count: the members to generate, ``[first, first + count)`` of the group's n
            (default: all n); each is sent as member ``first + j`` of the size-n design.
    """

    key: tuple[str, Any, int]
    messages: list[dict[str, str]] | None
    prompt: str | None
    n: int
    seed: int
    method: str
    order: str
    sampling: dict[str, Any] = field(default_factory=dict)
    first: int = 0
    count: int | None = None

    @property
    def member_ids(self) -> range:
        """The members this job generates, in order (``on_group`` gets their completions in it)."""
        return range(self.first, self.n if self.count is None else self.first + self.count)

    @property
    def group_id(self) -> str:
        sampler, problem, group = self.key
        return f"qmc-eval:{sampler}:{problem}:{group}"


@dataclass(frozen=True)
class Completion:
    """One member's finished sample: its text and vLLM's ``finish_reason`` (``stop`` or ``length``).

    ``token_ids`` are its generated tokens where the backend sees them (in-process and Ray; not
    over HTTP); the samples file records the text only.
    """

    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...] | None = None


OnGroup = Callable[[GroupJob, list[Completion]], None]


def member_xargs(job: GroupJob, member: int) -> dict[str, Any]:
    """The plugin arguments of member ``member`` of ``job`` (``extra_args`` / ``vllm_xargs``)."""
    return {
        "qmc_method": job.method,
        "qmc_seed": job.seed,
        "qmc_order": job.order,
        "qmc_group": job.group_id,
        "qmc_index": member,
        "qmc_n": job.n,
    }


def prompt_token_ids(tokenizer: Any, job: GroupJob) -> list[int]:
    """The prompt's token ids, as an OpenAI server would tokenize it (every backend uses this).

    Args:
        tokenizer: a Hugging Face tokenizer (or vLLM's wrapper of one) of the model.
        job: the group; chat messages are rendered with the model's chat template.
    """
    if job.messages is not None:
        # Chat endpoints render the template, then tokenize without adding special tokens.
        text = tokenizer.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(job.prompt))


class DrawFailedError(RuntimeError):
    """The plugin's draw failed while a group was generated: vLLM sampled some of its rows itself, so the
    group is not the design its job names, and it is not handed on (nor any later one)."""


class InProcessBackend:
    """Generate with a ``vllm.LLM`` in this process, stepping its engine.

    A group is handed to ``on_group`` only if no worker of the engine left a designed row to vLLM
    because its draw failed while the group ran (the workers' records on this machine:
    :func:`qmc_sampler.vllm_engine.checks.draws_failed_since`); otherwise :meth:`run` raises
    :class:`DrawFailedError`, so every group written is what its design says.

    Args:
        llm: the engine (the plugin must be loaded in it).
        max_members_in_flight: how many member requests are in the engine at once;
            groups are admitted whole, in order, while there is room.
    """

    supports_rounds = True  # serves GroupJob.first/count

    def __init__(self, llm: Any, max_members_in_flight: int = 512) -> None:
        self.llm = llm
        self.max_members_in_flight = max_members_in_flight
        self._tokenizer = llm.get_tokenizer()
        self._workers = tuple(w["pid"] for w in llm.collective_rpc("qmc_sampler_stats") if "pid" in w)

    def prompt_ids(self, job: GroupJob) -> list[int]:
        """The prompt's token ids, as an OpenAI server would tokenize it (:func:`prompt_token_ids`)."""
        return prompt_token_ids(self._tokenizer, job)

    def run(self, jobs: Iterable[GroupJob], on_group: OnGroup) -> None:
        """Generate every group of ``jobs``; call ``on_group`` as each completes.

        Raises:
            DrawFailedError: the plugin's draw failed while a group ran (groups handed on before are exact).
        """
        from qmc_sampler.vllm_engine.checks import draws_failed_since
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        tag = uuid.uuid4().hex[:12]
        pending = iter(jobs)
        open_groups: dict[int, tuple[GroupJob, dict[int, Completion]]] = {}
        started: dict[int, int] = {}  # group -> time.time_ns() as its first member was added
        in_flight, serial, exhausted = 0, 0, False
        try:
            while True:
                while not exhausted and in_flight < self.max_members_in_flight:
                    job = next(pending, None)
                    if job is None:
                        exhausted = True
                        break
                    serial += 1
                    open_groups[serial] = (job, {})
                    started[serial] = time.time_ns()
                    prompt = {"prompt_token_ids": self.prompt_ids(job)}
                    sampling = {**job.sampling, "include_stop_str_in_output": True}
                    for member in job.member_ids:
                        params = SamplingParams(n=1, extra_args=member_xargs(job, member), **sampling)
                        engine.add_request(f"{tag}-{serial}-{member}", prompt, params)
                    in_flight += len(job.member_ids)
                if not engine.has_unfinished_requests():
                    return
                for output in engine.step():
                    if not output.finished:
                        continue
                    _, group, member = output.request_id.rsplit("-", 2)
                    job, texts = open_groups[int(group)]
                    choice = output.outputs[0]
                    texts[int(member)] = Completion(choice.text, choice.finish_reason, tuple(choice.token_ids))
                    in_flight -= 1
                    if len(texts) == len(job.member_ids):
                        if draws_failed_since(self._workers, started[int(group)]):
                            raise DrawFailedError(
                                f"the qmc-sampler plugin's draw failed while group {job.key} was generated, so vLLM "
                                f"sampled some of its rows itself and it is not a {job.method} group: the run stops "
                                "before writing it (the groups written are exact). The engine's log says why"
                            )
                        del open_groups[int(group)], started[int(group)]
                        on_group(job, [texts[m] for m in job.member_ids])
        finally:
            # An interrupted run (an error, Ctrl-C) leaves nothing running in a shared engine.
            unfinished = [
                f"{tag}-{s}-{m}" for s, (job, texts) in open_groups.items() for m in job.member_ids if m not in texts
            ]
            if unfinished:
                engine.abort_request(unfinished)
