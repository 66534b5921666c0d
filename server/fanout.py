"""Fan a request's n choices out into member requests of one group, and merge them back.

Each choice is its own engine request with ``n = 1`` and explicit plugin
arguments (``qmc_group``, ``qmc_index = offset + j``, ``qmc_n = group size``,
``qmc_seed``), so the group is correct whichever batches (or data-parallel
engines) its members land in, and a group can be extended across calls
(members offset..offset+n−1).

Members are first all *added* to the engine (:func:`start_members`, where the
engine validates them: token ids, structured-output grammars, …), so a bad
request is refused as a whole before any response — streaming or not — begins;
then their outputs are consumed (:func:`run_members`, :func:`stream_members`).
Whoever stops early (an error, a client that went away, a shutdown) aborts
every member still in the engine.
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True)
class MemberPlan:
    members: list[Member]
    prompts: list[Any]  # engine prompts, one per prompt_index


def plan_members(
    prompts: list[Any],
    n: int,
    *,
    sampling: dict[str, Any],
    method: str | None,
    group_seed: int,
    offset: int,
    group_size: int,
    xargs: dict[str, Any] | None,
    output_kind: Any,
) -> MemberPlan:
    """Build the member requests: ``len(prompts) × n`` of them, choice index ``p·n + j``.

    Args:
        sampling: ``SamplingParams`` keyword arguments shared by every member.
        method: the design, or None for plain (greedy) sampling without a group.
        group_seed: the seed of prompt 0's group (prompt p uses ``group_seed + p``).
    """
    from vllm import SamplingParams

    base = uuid.uuid4().hex
    members = []
    for p in range(len(prompts)):
        for j in range(n):
            extra = dict(xargs or {})
            if method is not None:
                extra.update(
                    {
                        "qmc_method": method,
                        "qmc_seed": group_seed + p,
                        "qmc_group": f"{base}-{p}",
                        "qmc_index": offset + j,
                        "qmc_n": group_size,
                    }
                )
            params = SamplingParams(n=1, output_kind=output_kind, extra_args=extra or None, **sampling)
            members.append(Member(p * n + j, p, f"qmc-{base}-{p}-{j}", params))
    return MemberPlan(members, prompts)


async def start_members(engine: Any, plan: MemberPlan) -> list[Any]:
    """Add every member request to the engine; return their output queues (member order).

    Raises:
        whatever the engine raises for an invalid member (``ValueError`` and its
        subclasses); the members already added are aborted first.
    """
    queues: list[Any] = []
    try:
        for member in plan.members:
            prompt = plan.prompts[member.prompt_index]
            queues.append(await engine.add_request(member.request_id, prompt, member.params))
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
