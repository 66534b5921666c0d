"""Fan a request's n choices out into member requests of one group, and merge them back.

Each choice is its own engine request with ``n = 1`` and explicit plugin
arguments (``qmc_group``, ``qmc_index = offset + j``, ``qmc_n = group size``,
``qmc_seed``), so the group is correct whichever batches its members land in,
and a group can be extended across calls (members offset..offset+n−1).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "MemberPlan", "plan_members", "run_members", "stream_members"]


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


async def run_members(engine: Any, plan: MemberPlan) -> dict[int, Any]:
    """Run every member to completion; return ``{choice_index: final RequestOutput}``.

    Cancelling the caller aborts every member still running in the engine.
    """

    async def one(member: Member) -> tuple[int, Any]:
        final = None
        async for output in engine.generate(plan.prompts[member.prompt_index], member.params, member.request_id):
            final = output
        return member.choice_index, final

    tasks = [asyncio.create_task(one(m)) for m in plan.members]
    try:
        return dict(await asyncio.gather(*tasks))
    finally:
        await _abort_unfinished(engine, plan, tasks)


async def stream_members(engine: Any, plan: MemberPlan) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(choice_index, delta RequestOutput)`` as members produce tokens, interleaved.

    Closing the iterator early (a client that went away) aborts every member still
    running in the engine.
    """
    queue: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()

    async def pump(member: Member) -> None:
        try:
            async for output in engine.generate(plan.prompts[member.prompt_index], member.params, member.request_id):
                await queue.put((member.choice_index, output))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(m)) for m in plan.members]
    finished = 0
    try:
        while finished < len(tasks):
            item = await queue.get()
            if item is None:
                finished += 1
                for t in tasks:  # surface a member's failure instead of waiting forever
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                continue
            yield item
    finally:
        await _abort_unfinished(engine, plan, tasks)


async def _abort_unfinished(engine: Any, plan: MemberPlan, tasks: list[asyncio.Task]) -> None:
    pending = [m.request_id for m, t in zip(plan.members, tasks, strict=True) if not t.done()]
    for t in tasks:
        t.cancel()
    if pending:
        await engine.abort(pending)
