"""Responses in OpenAI's shapes, built with the official ``openai`` package's models.

Every response carries the extensions ``sampler`` and ``sampler_seed`` (enough to
reproduce the group). Streams interleave the members' deltas as they come, then
send the usage chunk (if asked) and ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from qmc_sampler.server.fanout import stream_members

__all__ = ["Group", "Meta", "final_response", "sse"]


@dataclass(frozen=True)
class Group:
    """The group a request's choices belong to.

    ``auto``: an n = 1 request that joins the auto group of its repeats in the engine
    (the drop-in's meaning); its ``seed`` is the user's (None if none), which keys the
    auto group, and ``offset``/``size`` are unused.
    """

    method: str | None
    seed: int | None
    offset: int
    size: int
    auto: bool = False


@dataclass(frozen=True)
class Meta:
    id: str
    created: int
    model: str
    group: Group
    prompt_tokens: int
    top_logprobs: int = 0
    return_token_ids: bool = False  # vLLM's extension: each choice's token_ids

    def extensions(self) -> dict[str, Any]:
        return {"sampler": self.group.method, "sampler_seed": self.group.seed}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def final_response(outputs: dict[int, Any], meta: Meta, chat: bool) -> dict[str, Any]:
    from openai.types import Completion, CompletionChoice
    from openai.types.chat import ChatCompletion
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_message import ChatCompletionMessage

    choices = []
    completion_tokens = 0
    for index in sorted(outputs):
        out = outputs[index].outputs[0]
        completion_tokens += len(out.token_ids)
        finish = out.finish_reason or "stop"
        # vLLM's "abort" (a member cut off by a shutdown) is outside the client's Literal; like
        # vLLM's own server we send it as it is, so a cut-off member never reads as finished.
        strict = finish in ("stop", "length")
        if chat:
            logprobs = (
                ChoiceLogprobs(content=_chat_logprobs(out, meta.top_logprobs)) if out.logprobs is not None else None
            )
            choices.append(
                (Choice if strict else Choice.model_construct)(
                    index=index,
                    finish_reason=finish,
                    logprobs=logprobs,
                    message=ChatCompletionMessage(role="assistant", content=out.text),
                )
            )
        else:
            choices.append(
                (CompletionChoice if strict else CompletionChoice.model_construct)(
                    index=index, text=out.text, finish_reason=finish, logprobs=_completion_logprobs(out)
                )
            )
    usage = _usage(meta.prompt_tokens, completion_tokens)
    model, kind = (ChatCompletion, "chat.completion") if chat else (Completion, "text_completion")
    response = model(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        object=kind,
        choices=choices,
        usage=usage,
        **meta.extensions(),
    )
    body = response.model_dump(mode="json", exclude_unset=False)
    if meta.return_token_ids:
        for choice in body["choices"]:
            choice["token_ids"] = list(outputs[choice["index"]].outputs[0].token_ids)
    return body


#: What a logprob of -inf (a token excluded by a filter or a grammar) is sent as; JSON has no
#: infinities, and vLLM's own server uses the same floor.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _completion_logprobs(out: Any) -> Any:
    from openai.types.completion_choice import Logprobs

    if out.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, position in zip(out.token_ids, out.logprobs, strict=False):
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(_finite(chosen.logprob))
        top.append({(lp.decoded_token or ""): _finite(lp.logprob) for lp in position.values()})
        offsets.append(offset)
        offset += len(text)
    return Logprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def _chat_logprobs(out: Any, top_k: int) -> list[Any]:
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion_token_logprob import TopLogprob

    content = []
    for token_id, position in zip(out.token_ids, out.logprobs, strict=False):
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        tops = [
            TopLogprob(
                token=lp.decoded_token or "", logprob=_finite(lp.logprob), bytes=list((lp.decoded_token or "").encode())
            )
            # Exactly top_k entries: by rank alone, a sampled token tied with the k-th (equal
            # logprobs, equal rank) would make k + 1.
            for lp in sorted(position.values(), key=lambda lp: lp.rank or 0)[:top_k]
        ]
        content.append(
            ChatCompletionTokenLogprob(
                token=text, logprob=_finite(chosen.logprob), bytes=list(text.encode()), top_logprobs=tops
            )
        )
    return content


async def sse(
    engine: Any,
    plan: Any,
    queues: list[Any],
    meta: Meta,
    chat: bool,
    include_usage: bool,
    on_close: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    """The server-sent events of a streaming response; ``on_close`` runs when the stream ends, however."""
    from openai.types import Completion, CompletionChoice
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

    try:
        started: set[int] = set()
        completion_tokens = 0
        async with contextlib.aclosing(stream_members(engine, plan, queues)) as deltas:
            async for index, output in deltas:
                out = output.outputs[0]
                completion_tokens += len(out.token_ids)
                finish = out.finish_reason  # None until the member's last chunk; "abort" on shutdown
                if chat:
                    delta = ChoiceDelta(content=out.text, role=None if index in started else "assistant")
                    started.add(index)
                    # model_construct: a chunk's finish_reason is null until the last one, which the
                    # strict response models do not allow (the official client parses chunks leniently too).
                    chunk = ChatCompletionChunk.model_construct(
                        id=meta.id,
                        created=meta.created,
                        model=meta.model,
                        object="chat.completion.chunk",
                        choices=[ChunkChoice.model_construct(index=index, delta=delta, finish_reason=finish)],
                        **meta.extensions(),
                    )
                else:
                    chunk = Completion.model_construct(
                        id=meta.id,
                        created=meta.created,
                        model=meta.model,
                        object="text_completion",
                        choices=[
                            CompletionChoice.model_construct(
                                index=index, text=out.text, finish_reason=finish, logprobs=_completion_logprobs(out)
                            )
                        ],
                        **meta.extensions(),
                    )
                yield f"data: {json.dumps(chunk.model_dump(mode='json'))}\n\n"
        if include_usage:
            usage = _usage(meta.prompt_tokens, completion_tokens)
            tail = {
                "id": meta.id,
                "created": meta.created,
                "model": meta.model,
                "choices": [],
                "usage": usage,
                "object": "chat.completion.chunk" if chat else "text_completion",
                **meta.extensions(),
            }
            yield f"data: {json.dumps(tail)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await on_close()
