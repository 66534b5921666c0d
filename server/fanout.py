"""Fan a request's n choices out into member requests of one group, and merge them back.

Each choice is its own engine request with ``n = 1`` and explicit plugin
arguments (``qmc_group``, ``qmc_index = offset + j``, ``qmc_n = group size``,
``qmc_seed``), so the group is correct whichever batches (or data-parallel
engines) its members land in, and a group can be extended across calls
(members offset..offset+n−1). A lone ``n = 1`` request (no offset, no group size)
is sent with the design only and joins the auto group of its repeats in the
engine, exactly as under ``vllm serve`` with the drop-in; with several
data-parallel engines it is pinned to one by its prompt, so a prompt's repeats
meet in one engine.

Members are first all *added* to the engine (:func:`start_members`, where the
engine validates them: token ids, structured-output grammars, …), so a bad
request is refused as a whole before any response — streaming or not — begins;
then their outputs are consumed (:func:`run_members`, :func:`stream_members`).
Whoever stops early (an error, a client that went away, a shutdown) aborts
every member still in the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "MemberPlan", "abort_members", "plan_members", "run_members", "start_members", "stream_members"]


@dataclass(frozen=True)
class Member:
    """One choice of the response: which prompt, which choice index, which engine request."""

    choice_index: int
    prompt_index: int
    request_id: str
    params: Any  # vllm.SamplingParams
    auto: bool = False  # joins the auto group of its prompt's repeats


@dataclass(frozen=True)
class MemberPlan:
    members: list[Member]
    prompts: list[Any]  # engine prompts, one per prompt_index


def plan_members(
    prompts: list[Any],
    n: int,
    *,
    sampling: dict[str, Any],
    group: Any,
    xargs: dict[str, Any] | None,
    output_kind: Any,
) -> MemberPlan:
    """Build the member requests: ``len(prompts) × n`` of them, choice index ``p·n + j``.

    Args:
        sampling: ``SamplingParams`` keyword arguments shared by every member.
        group: the :class:`~qmc_sampler.server.responses.Group` (method None: greedy, no
            group); prompt p's group has seed ``group.seed + p``.
    """
    from vllm import SamplingParams

    base = uuid.uuid4().hex
    members = []
    for p in range(len(prompts)):
        for j in range(n):
            extra = dict(xargs or {})
            if group.method is not None and group.auto:
                extra["qmc_method"] = group.method
                if group.seed is not None:
                    extra["qmc_seed"] = group.seed
            elif group.method is not None:
                extra.update(
                    {
                        "qmc_method": group.method,
                        "qmc_seed": group.seed + p,
                        "qmc_group": f"{base}-{p}",
                        "qmc_index": group.offset + j,
                        "qmc_n": group.size,
                    }
                )
            params = SamplingParams(n=1, output_kind=output_kind, extra_args=extra or None, **sampling)
            auto = group.method is not None and group.auto
            members.append(Member(p * n + j, p, f"qmc-{base}-{p}-{j}", params, auto))
    return MemberPlan(members, prompts)


def _engine_for(prompt: Any, engines: int) -> int:
    """The data-parallel rank an auto member is pinned to: a hash of its prompt's token ids."""
    digest = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % engines


async def start_members(engine: Any, plan: MemberPlan) -> list[Any]:
    """Add every member request to the engine; return their output queues (member order).

    Raises:
        whatever the engine raises for an invalid member (``ValueError`` and its
        subclasses); the members already added are aborted first.
    """
    queues: list[Any] = []
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    engines = int(getattr(parallel, "data_parallel_size", 1) or 1)
    if engines != int(getattr(parallel, "data_parallel_size_local", engines) or engines):
        engines = 1  # ranks on other nodes: leave routing to vLLM (repeats may then form one group per engine)
    try:
        for member in plan.members:
            prompt = plan.prompts[member.prompt_index]
            rank = _engine_for(prompt, engines) if member.auto and engines > 1 else None
            queues.append(await engine.add_request(member.request_id, prompt, member.params, data_parallel_rank=rank))
    except BaseException:
        await abort_members(engine, queues)
        raise
    return queues


async def _outputs(queue: Any) -> AsyncIterator[Any]:
    from vllm.outputs import STREAM_FINISHED

    finished = False
    while not finished:
        out = queue.get_nowait() or await queue.get()  # as AsyncLLM.generate drains it
        finished = out.finished
        if out is not STREAM_FINISHED:
            yield out


async def abort_members(engine: Any, queues: list[Any]) -> None:
    """Abort the members behind ``queues`` that are still in the engine."""
    if queues:
        await engine.abort([q.request_id for q in queues], internal=True)


async def run_members(engine: Any, plan: MemberPlan, queues: list[Any]) -> dict[int, Any]:
    """Run every member to completion; return ``{choice_index: final RequestOutput}``.

    Cancelling the caller aborts every member still running in the engine.
    """

    async def one(member: Member, queue: Any) -> tuple[int, Any]:
        final = None
        async for output in _outputs(queue):
            final = output
        return member.choice_index, final

    tasks = [asyncio.create_task(one(m, q)) for m, q in zip(plan.members, queues, strict=True)]
    try:
        return dict(await asyncio.gather(*tasks))
    finally:
        await _cancel_unfinished(engine, queues, tasks)


async def stream_members(engine: Any, plan: MemberPlan, queues: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(choice_index, delta RequestOutput)`` as members produce tokens, interleaved.

    Closing the iterator early (a client that went away) aborts every member still
    running in the engine.
    """
    merged: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()

    async def pump(member: Member, queue: Any) -> None:
        try:
            async for output in _outputs(queue):
                await merged.put((member.choice_index, output))
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(m, q)) for m, q in zip(plan.members, queues, strict=True)]
    finished = 0
    try:
        while finished < len(tasks):
            item = await merged.get()
            if item is None:
                finished += 1
                for t in tasks:  # surface a member's failure instead of waiting forever
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                continue
            yield item
    finally:
        await _cancel_unfinished(engine, queues, tasks)


async def _cancel_unfinished(engine: Any, queues: list[Any], tasks: list[asyncio.Task]) -> None:
    pending = [q for q, t in zip(queues, tasks, strict=True) if not t.done()]
    for t in tasks:
        t.cancel()
    await abort_members(engine, pending)
