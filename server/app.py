"""The OpenAI-compatible app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics`` and ``/stats`` (the plugin's counters in every engine).

Request handling, in order: the API key and the body size
(:mod:`.admission`, before anything is parsed); validate the body
(:mod:`.protocol`; any failure is a 400 in OpenAI's shape naming the field) and
the model name (404 ``model_not_found``); resolve the group (design, seed,
offset, size); render and tokenize the prompt and check it fits the context and
the vocabulary; reserve room for the members (``--max-members-in-flight``, 429
beyond it); add every member request to the engine (:mod:`.fanout`; the engine's
own validation failures are 400s before any response starts); answer with the
official ``openai`` response models (:mod:`.responses`). A client that
disconnects gets its member requests aborted in the engine, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from qmc_sampler.server.admission import CapacityError, GuardMiddleware, MemberLimiter, RejectedBy
from qmc_sampler.server.fanout import abort_members, plan_members, run_members, start_members
from qmc_sampler.server.observability import METRICS, ObservabilityMiddleware
from qmc_sampler.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body
from qmc_sampler.server.responses import Group, Meta, final_response, sse
from qmc_sampler.vllm_plugin.request_args import check_extra_args

from qmc_sampler.processing import SAMPLING_EPS

__all__ = ["ServerSettings", "build_app"]


@dataclass(frozen=True)
class ServerSettings:
    """What the app needs to know about its engine, its defaults and its limits."""

    model_name: str
    max_model_len: int
    vocab_size: int
    default_sampler: str = "lattice"
    max_n: int = 128
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_members_in_flight: int = 1024
    queue_timeout: float = 0.0


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The app serving ``engine`` (a ``vllm.v1.engine.async_llm.AsyncLLM``).

    ``app.state.abort_all()`` aborts every member request still in the engine (shutdown).
    """
    app = FastAPI(title="qmc-sampler", version="0.1.0")
    limiter = MemberLimiter(settings.max_members_in_flight, settings.queue_timeout)
    running: dict[int, list[Any]] = {}  # the output queues of every response in progress

    async def abort_all() -> None:
        queues = [q for qs in running.values() for q in qs]
        running.clear()
        await abort_members(engine, queues)

    app.state.limiter, app.state.running, app.state.abort_all = limiter, running, abort_all

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        METRICS.rejected.labels(RejectedBy.INVALID).inc()
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, RequestError):  # raised by a model-level check: it names its field
            return JSONResponse(error_body(str(cause), cause.param), 400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"request body is not valid JSON: {first.get('msg')}", None), 400)
        param = loc[0] if loc else None
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        where = ".".join(loc) or "body"
        return JSONResponse(error_body(f"{where}: {message}", param), 400)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        if exc.status == 404:
            reason = RejectedBy.MODEL
        elif isinstance(exc, CapacityError):
            reason = RejectedBy.CAPACITY
        else:
            reason = RejectedBy.INVALID
        METRICS.rejected.labels(reason).inc()
        headers = {"Retry-After": str(int(exc.retry_after))} if isinstance(exc, CapacityError) else None
        return JSONResponse(error_body(str(exc), exc.param, code=exc.code), exc.status, headers=headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "unfinished_requests": engine.get_num_unfinished_requests(),
            "members_in_flight": limiter.in_flight,
        }

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The plugin's counters in each engine (one entry per data-parallel engine's worker)."""
        from qmc_sampler.vllm_plugin.checks import engine_stats_async

        return {"engines": await engine_stats_async(engine)}

    @app.get("/metrics")
    async def metrics() -> Any:
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict[str, Any]:
        from openai.types import Model

        return Model(
            id=settings.model_name, created=int(time.time()), object="model", owned_by="qmc-sampler"
        ).model_dump()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        _check_model(model, settings)
        return card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, settings)
        if body.echo:
            raise RequestError("echo=true is not supported", "echo")
        prompts = _completion_prompts(body.prompt, engine.get_tokenizer(), settings.vocab_size)
        return await _serve(engine, settings, app.state, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(body.model, settings)
        tokenizer = engine.get_tokenizer()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **body.template_kwargs())
        except Exception as e:  # a template that rejects these roles/orders
            raise RequestError(f"messages cannot be rendered with the model's chat template: {e}", "messages") from e
        # The template already placed any special tokens (BOS) it wants.
        ids = tokenizer.encode(text, add_special_tokens=False)
        return await _serve(engine, settings, app.state, request, body, [list(ids)], chat=True)

    # Outermost first: time and log everything, then the key and the body size.
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        on_reject=lambda reason: METRICS.rejected.labels(reason).inc(),
    )
    app.add_middleware(ObservabilityMiddleware)
    return app


def _check_model(name: str, settings: ServerSettings) -> None:
    if name != settings.model_name:
        raise RequestError(
            f"The model `{name}` does not exist; this server serves `{settings.model_name}`",
            "model",
            status=404,
            code="model_not_found",
        )


def _completion_prompts(prompt: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
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
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is out of vocabulary (valid ids: 0..{vocab_size - 1})", "prompt")
        out.append(ids)
    return out


def _resolve_group(body: Any, settings: ServerSettings, temperature: float) -> Group:
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
    seed = next((s for s in (body.sampler_seed, xargs.get("qmc_seed"), body.seed) if s is not None), None)
    if method is not None and body.n == 1 and offset == 0 and body.sampler_group_size is None:
        # As `vllm serve` with the drop-in: repeats of a prompt form one auto group in the
        # engine, a seeded repeat being its next member (never a copy of member 0).
        return Group(method, seed, 0, 1, auto=True)
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
    if offset > 0 and seed is None:
        raise RequestError(
            "sampler_offset extends an existing group, which needs its seed: send sampler_seed "
            "(the sampler_seed of the response that started the group)",
            "sampler_seed",
        )
    return Group(method, seed if seed is not None else secrets.randbits(63), offset, size)


def _structured_outputs(body: Any) -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    if body.structured_outputs is not None:
        s = body.structured_outputs
        return StructuredOutputsParams(
            json=s.json_, regex=s.regex, choice=s.choice, grammar=s.grammar, json_object=s.json_object
        )
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _sampling_kwargs(body: Any, prompts: list[list[int]], settings: ServerSettings, chat: bool) -> dict[str, Any]:
    temperature = 1.0 if body.temperature is None else body.temperature
    longest = max(len(p) for p in prompts)
    room = settings.max_model_len - longest
    max_tokens = body.max_tokens
    if chat and body.max_completion_tokens is not None:  # 0 must be refused, not read as "unset"
        max_tokens = body.max_completion_tokens
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
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.top_k is not None:
        kwargs["top_k"] = max(body.top_k, 0)
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.min_tokens > kwargs["max_tokens"]:
        raise RequestError(f"min_tokens={body.min_tokens} must be <= max_tokens={kwargs['max_tokens']}", "min_tokens")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(body, name)
        if ids is not None:
            bad = next((i for i in ids if not 0 <= i < settings.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    f"{name} has {bad}, which is out of vocabulary (valid ids: 0..{settings.vocab_size - 1})", name
                )
            kwargs[name] = ids
    for name, default in (("min_tokens", 0), ("ignore_eos", False), ("skip_special_tokens", True),
                          ("spaces_between_special_tokens", True)):  # fmt: skip
        if getattr(body, name) != default:
            kwargs[name] = getattr(body, name)
    if body.bad_words:
        kwargs["bad_words"] = body.bad_words
    if body.include_stop_str_in_output:
        kwargs["include_stop_str_in_output"] = True
    if body.logit_bias:
        bad = next((k for k in body.logit_bias if int(k) >= settings.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"logit_bias key {bad} is out of vocabulary (valid ids: 0..{settings.vocab_size - 1})", "logit_bias"
            )
        kwargs["logit_bias"] = {int(k): float(v) for k, v in body.logit_bias.items()}
    structured = _structured_outputs(body)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    if chat:
        if body.logprobs:
            kwargs["logprobs"] = body.top_logprobs or 0
    elif body.logprobs is not None:
        kwargs["logprobs"] = body.logprobs
    return kwargs


def _engine_error_param(body: Any, chat: bool) -> str | None:
    if getattr(body, "structured_outputs", None) is not None:
        return "structured_outputs"
    if getattr(body, "response_format", None) is not None:
        return "response_format"
    return "messages" if chat else "prompt"


async def _serve(
    engine: Any,
    settings: ServerSettings,
    state: Any,
    request: Request,
    body: Any,
    prompts: list[list[int]],
    chat: bool,
) -> Any:
    from vllm.sampling_params import RequestOutputKind

    sampling = _sampling_kwargs(body, prompts, settings, chat)
    group = _resolve_group(body, settings, sampling["temperature"])
    meta = Meta(
        ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        int(time.time()),
        settings.model_name,
        group,
        sum(len(p) for p in prompts),
        (body.top_logprobs or 0) if chat else 0,
        body.return_token_ids,
    )
    record = request.state.record if hasattr(request.state, "record") else None
    if record is not None:
        record.id, record.design, record.n, record.seed = meta.id, group.method or "greedy", body.n, group.seed
    plan = plan_members(
        [{"prompt_token_ids": p} for p in prompts],
        body.n,
        sampling=sampling,
        group=group,
        xargs=body.vllm_xargs,
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
    )
    members = len(plan.members)
    await state.limiter.acquire(members)
    METRICS.in_flight.inc(members)
    released = False

    async def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.running.pop(id(plan), None)
            METRICS.in_flight.dec(members)
            await state.limiter.release(members)

    from vllm.exceptions import VLLMClientError

    try:
        queues = await start_members(engine, plan)
    except (ValueError, VLLMClientError) as e:  # the engine's own validation (token ids, grammars, …)
        await release()
        raise RequestError(str(e), _engine_error_param(body, chat)) from None
    except BaseException:
        await release()
        raise
    state.running[id(plan)] = queues
    design = group.method or "greedy"
    METRICS.members.labels(design).inc(members)
    METRICS.groups.labels(design).inc(len(prompts))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse(engine, plan, queues, meta, chat, include_usage, on_close=release)
        return StreamingResponse(events, media_type="text/event-stream")
    try:  # run_members aborts its own unfinished members if it is cancelled
        outputs = await _until_done_or_disconnected(request, run_members(engine, plan, queues))
    finally:
        await release()
    return JSONResponse(final_response(outputs, meta, chat))


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
