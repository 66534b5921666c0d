"""The OpenAI-compatible app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``.

Request handling, in order: validate the body (:mod:`qmc_sampler.server.protocol`;
any failure is a 400 in OpenAI's shape naming the field), resolve the group
(design, seed, offset, size), render and tokenize the prompt and check it fits the
context, fan the n choices out into member requests (:mod:`.fanout`), and answer
with the official ``openai`` response models plus the extensions ``sampler`` and
``sampler_seed`` (enough to reproduce the group). A client that disconnects gets
its member requests aborted in the engine, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from qmc_sampler.server.fanout import plan_members, run_members, stream_members
from qmc_sampler.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body
from qmc_sampler.vllm_plugin.request_args import check_extra_args

from qmc_sampler.processing import SAMPLING_EPS

__all__ = ["ServerSettings", "build_app"]


@dataclass(frozen=True)
class ServerSettings:
    """What the app needs to know about its engine and its defaults."""

    model_name: str
    max_model_len: int
    default_sampler: str = "lattice"
    max_n: int = 128


@dataclass(frozen=True)
class _Group:
    method: str | None
    seed: int
    offset: int
    size: int


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine`` (a ``vllm.v1.engine.async_llm.AsyncLLM``)."""
    app = FastAPI(title="qmc-sampler", version="0.1.0")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"request body is not valid JSON: {first.get('msg')}", None), 400)
        param = loc[0] if loc else None
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        where = ".".join(loc) or "body"
        return JSONResponse(error_body(f"{where}: {message}", param), 400)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.param), exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "unfinished_requests": engine.get_num_unfinished_requests()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        from openai.types import Model

        card = Model(id=settings.model_name, created=int(time.time()), object="model", owned_by="qmc-sampler")
        return {"object": "list", "data": [card.model_dump()]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.echo:
            raise RequestError("echo=true is not supported", "echo")
        tokenizer = engine.get_tokenizer()
        prompts = _completion_prompts(body.prompt, tokenizer)
        return await _serve(engine, settings, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        tokenizer = engine.get_tokenizer()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template that rejects these roles/orders
            raise RequestError(f"messages cannot be rendered with the model's chat template: {e}", "messages") from e
        # The template already placed any special tokens (BOS) it wants.
        ids = tokenizer.encode(text, add_special_tokens=False)
        return await _serve(engine, settings, request, body, [list(ids)], chat=True)

    return app


def _completion_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    out = []
    for p in prompt:
        ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise RequestError("prompt must not be empty", "prompt")
        out.append(ids)
    return out


def _resolve_group(body: Any, settings: ServerSettings, temperature: float) -> _Group:
    if not 1 <= body.n <= settings.max_n:
        raise RequestError(f"n={body.n} must be between 1 and {settings.max_n} (this server's maximum)", "n")
    xargs = body.vllm_xargs or {}
    try:
        check_extra_args(xargs)
    except ValueError as e:
        raise RequestError(str(e), "vllm_xargs") from None
    managed = sorted(k for k in ("qmc_group", "qmc_index", "qmc_n") if k in xargs)
    if managed:
        raise RequestError(
            f"vllm_xargs {managed[0]!r} is set by this server, which fans groups out itself; "
            "use sampler_offset and sampler_group_size to extend a group",
            "vllm_xargs",
        )
    method = body.sampler or xargs.get("qmc_method") or settings.default_sampler
    if temperature < SAMPLING_EPS:
        asked = body.sampler or xargs.get("qmc_method")
        if asked not in (None, "iid"):
            raise RequestError(
                f"temperature={temperature} is greedy decoding, which has nothing to correlate: "
                f"use temperature > 0 with sampler={asked!r}, or sampler='iid'",
                "temperature",
            )
        method = None
    offset = body.sampler_offset
    size = body.sampler_group_size if body.sampler_group_size is not None else offset + body.n
    if offset < 0:
        raise RequestError(f"sampler_offset={offset} must be >= 0", "sampler_offset")
    if offset > 0 and body.sampler_group_size is None:
        raise RequestError(
            "sampler_offset needs sampler_group_size (the size of the group being extended)", "sampler_group_size"
        )
    if size < offset + body.n:
        raise RequestError(
            f"sampler_group_size={size} must be >= sampler_offset + n = {offset + body.n}", "sampler_group_size"
        )
    seed = next((s for s in (body.sampler_seed, xargs.get("qmc_seed"), body.seed) if s is not None), None)
    return _Group(method, seed if seed is not None else secrets.randbits(63), offset, size)


def _sampling_kwargs(body: Any, prompts: list[list[int]], settings: ServerSettings, chat: bool) -> dict[str, Any]:
    temperature = 1.0 if body.temperature is None else body.temperature
    longest = max(len(p) for p in prompts)
    room = settings.max_model_len - longest
    max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
    field = "messages" if chat else "prompt"
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens={max_tokens} must be >= 1", "max_tokens")
    if room < 1 or (max_tokens is not None and max_tokens > room):
        wanted = longest + (max_tokens or 1)
        raise RequestError(
            f"This model's maximum context length is {settings.max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({longest} in the {field}, {max_tokens or 1} for the completion). Please reduce the "
            f"length of the {field} or of the completion.",
            field,
        )
    kwargs: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens or room}
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.top_k is not None:
        kwargs["top_k"] = max(body.top_k, 0)
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if chat:
        if body.logprobs:
            kwargs["logprobs"] = body.top_logprobs or 0
    elif body.logprobs is not None:
        kwargs["logprobs"] = body.logprobs
    return kwargs


async def _serve(
    engine: Any, settings: ServerSettings, request: Request, body: Any, prompts: list[list[int]], chat: bool
) -> Any:
    from vllm.sampling_params import RequestOutputKind

    sampling = _sampling_kwargs(body, prompts, settings, chat)
    group = _resolve_group(body, settings, sampling["temperature"])
    plan = plan_members(
        [{"prompt_token_ids": p} for p in prompts],
        body.n,
        sampling=sampling,
        method=group.method,
        group_seed=group.seed,
        offset=group.offset,
        group_size=group.size,
        xargs=body.vllm_xargs,
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
    )
    meta = _Meta(
        ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        int(time.time()),
        settings.model_name,
        group,
        sum(len(p) for p in prompts),
        (body.top_logprobs or 0) if chat else 0,
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(engine, plan, meta, chat, include_usage), media_type="text/event-stream")
    outputs = await _until_done_or_disconnected(request, run_members(engine, plan))
    return JSONResponse(_final_response(outputs, meta, chat))


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str
    group: _Group
    prompt_tokens: int
    top_logprobs: int = 0

    def extensions(self) -> dict[str, Any]:
        return {"sampler": self.group.method, "sampler_seed": self.group.seed}


async def _until_done_or_disconnected(request: Request, work: Any) -> Any:
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # run_members aborts its engine requests
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise RequestError("client disconnected", None, status=499)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _final_response(outputs: dict[int, Any], meta: _Meta, chat: bool) -> dict[str, Any]:
    from openai.types import Completion, CompletionChoice
    from openai.types.chat import ChatCompletion
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_message import ChatCompletionMessage

    choices = []
    completion_tokens = 0
    for index in sorted(outputs):
        out = outputs[index].outputs[0]
        completion_tokens += len(out.token_ids)
        finish = out.finish_reason if out.finish_reason in ("stop", "length") else "stop"
        if chat:
            logprobs = (
                ChoiceLogprobs(content=_chat_logprobs(out, meta.top_logprobs)) if out.logprobs is not None else None
            )
            choices.append(
                Choice(
                    index=index,
                    finish_reason=finish,
                    logprobs=logprobs,
                    message=ChatCompletionMessage(role="assistant", content=out.text),
                )
            )
        else:
            choices.append(
                CompletionChoice(index=index, text=out.text, finish_reason=finish, logprobs=_completion_logprobs(out))
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
    return response.model_dump(mode="json", exclude_unset=False)


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
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in position.values()})
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
            TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob, bytes=list((lp.decoded_token or "").encode()))
            for lp in sorted(position.values(), key=lambda lp: lp.rank or 0)
            if (lp.rank or 0) <= top_k
        ]
        content.append(
            ChatCompletionTokenLogprob(token=text, logprob=chosen.logprob, bytes=list(text.encode()), top_logprobs=tops)
        )
    return content


async def _sse(engine: Any, plan: Any, meta: _Meta, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    from openai.types import Completion, CompletionChoice
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

    started: set[int] = set()
    completion_tokens = 0
    async with contextlib.aclosing(stream_members(engine, plan)) as deltas:
        async for index, output in deltas:
            out = output.outputs[0]
            completion_tokens += len(out.token_ids)
            finish = out.finish_reason if out.finish_reason in ("stop", "length") else None
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
