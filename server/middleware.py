"""What qmc-serve adds to vLLM's OpenAI server: one pure ASGI middleware (docs/serving.md, "qmc-serve").

On the completion and chat routes, for clients the API key admits (vLLM answers the
others): the body limit; our ``sampler*`` fields mapped onto ``vllm_xargs``
(:mod:`.fields`); the member limit (:mod:`.admission`); a designed ``n > 1`` request
pinned to one data-parallel engine, an auto-group repeat to the engine its prompt
picks (vLLM's ``X-data-parallel-rank``; the plugin numbers children in their engine);
a designed request refused (400) once the plugin stopped drawing in an engine;
``sampler``/``sampler_seed`` added to the response and every streamed chunk; counters
and a log line (:mod:`.observability`). Also the key and the member limit on vLLM's WebSocket
``/v1/realtime`` (one member per open connection), ``GET /stats``, the start-up plugin
check, and a graceful SIGTERM (503 to new requests, ``--shutdown-timeout`` for running
ones, then aborts that still end each response properly).

Longer than our ~400 lines on purpose: one request's state runs through its body, its response
and its stream here; the pure parts live in :mod:`.fields`, :mod:`.admission` and :mod:`.observability`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from qmc_sampler.server.admission import MemberLimiter
from qmc_sampler.server.fields import FIELDS, LEAST_LOADED, FieldError, Plan, plan_other_route, plan_request
from qmc_sampler.server.observability import METRICS, RejectedBy, log_request
from qmc_sampler.vllm_engine.checks import broken_worker
from qmc_sampler.vllm_engine.compat import locate
from starlette.datastructures import Headers

from qmc_sampler import __version__

GUARDED_PREFIX = locate("guarded_prefix")  # vLLM's key-checked prefixes and its key check, wherever it keeps them
AuthenticationMiddleware = locate("authentication")

__all__ = ["QMCServeMiddleware"]

ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}  # path → chat
#: SageMaker's one route: vLLM serves a chat body as chat, else a completion body as a completion.
INVOCATIONS = "/invocations"
#: vLLM's other routes that sample: our fields are not mapped there, so a body that carries them is
#: refused naming the route (never served i.i.d.); without them the server's design still applies
#: through the plugin's drop-in (``QMC_SAMPLER``, set by qmc-serve from ``--sampler``).
OTHER_SAMPLING_ROUTES = (
    "/v1/responses",
    "/v1/messages",
    "/v1/chat/completions/batch",
    "/cohere/v2/chat",
    "/inference/v1/generate",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/generative_scoring",
    "/v1/systemone",
)
#: vLLM's WebSocket routes that run the engine: ``/v1/realtime`` (one streaming generation at a time
#: per connection). A connection holds one member of the limit while it is open, and needs the key.
WEBSOCKET_ROUTES = ("/v1/realtime",)
#: Routes that run the engine which vLLM leaves without its key check (outside ``GUARDED_PREFIX``):
#: qmc-serve asks for the key there too, so that with a key set nothing generates without it.
UNGUARDED_BY_VLLM = (INVOCATIONS, "/generative_scoring")
#: Seconds aborted responses get to send their last chunk and ``[DONE]`` on shutdown.
ABORT_FLUSH_S = 5.0
_ID = re.compile(rb'"id":\s*"([^"]*)"')


@dataclass
class _Server:
    """This API-server process's settings and running state (built from vLLM's parsed args)."""

    args: Any
    limiter: MemberLimiter
    auth: Any  # vLLM's AuthenticationMiddleware for the server's keys, or None (no key)
    responses: int = 0  # designed or not, in progress
    closing: bool = False
    workers: tuple[int, ...] = ()  # the engines' worker pids, from the start-up check (their draw records)
    rotation: itertools.count = field(default_factory=itertools.count)

    def authorized(self, scope: dict[str, Any]) -> bool:
        """vLLM's own decision for this request's ``Authorization`` header (its check, reused);
        vLLM asks for it on the paths under its ``GUARDED_PREFIX`` only, qmc-serve on ``/invocations``
        and ``/stats`` too (see :meth:`key_needed`)."""
        return self.auth is None or self.auth.verify_token(Headers(scope=scope))

    def key_needed(self, path: str) -> bool:
        """Whether a POST to ``path`` needs the key: vLLM's guarded paths, and the routes of
        :data:`UNGUARDED_BY_VLLM` (``/invocations`` not with ``--invocations-without-key``, for a
        deployment that authenticates in front, as SageMaker does)."""
        if path == INVOCATIONS and getattr(self.args, "invocations_without_key", False):
            return False
        return path.startswith(GUARDED_PREFIX) or path in UNGUARDED_BY_VLLM


def _route_path(scope: dict[str, Any]) -> str:
    """The path the app's router matches: ``root_path`` removed only at a ``/`` boundary, as
    Starlette's ``get_route_path`` does (so ``--root-path /`` leaves ``/invocations`` whole)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


async def _unauthorized(send: Any) -> None:
    """vLLM's 401 (its body), counted as refused for the key."""
    METRICS.rejected.labels(RejectedBy.AUTH).inc()
    await _respond(send, 401, {"error": "Unauthorized"})


class QMCServeMiddleware:
    """qmc-serve's layer over vLLM's OpenAI app (see the module docstring); vLLM adds it from ``--middleware``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server: _Server | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(scope, send))
            return
        if scope["type"] == "websocket" and _route_path(scope) in WEBSOCKET_ROUTES:
            await self._serve_websocket(self._server(scope), scope, receive, send, _route_path(scope))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = self._server(scope)
        path = _route_path(scope)
        if path == "/stats" and scope["method"] == "GET":
            if not server.authorized(scope):  # it reaches every engine: behind the key like /v1
                await _unauthorized(send)
                return
            await _respond(send, 200, await self._stats(scope))
            return
        mapped = path in ENDPOINTS or path == INVOCATIONS
        if scope["method"] != "POST" or not (mapped or path in OTHER_SAMPLING_ROUTES):
            await self.app(scope, receive, send)
            return
        if server.key_needed(path) and not server.authorized(scope):
            # Answered here, not left to vLLM's check, which misses its own routes under some
            # --root-path values ("/") and never sees UNGUARDED_BY_VLLM.
            await _unauthorized(send)
            return
        if server.closing:
            await _refuse(send, FieldError("the server is shutting down", None, status=503), RejectedBy.CLOSING)
            return
        server.responses += 1
        try:
            await self._serve(server, scope, receive, send, path)
        finally:
            server.responses -= 1

    async def _serve(self, server: _Server, scope: dict[str, Any], receive: Any, send: Any, path: str) -> None:
        started = time.monotonic()
        if path not in ENDPOINTS and path != INVOCATIONS and not _is_json(scope):
            # A form upload (audio): no JSON fields to map or refuse; one member, counted like any other.
            await self._pass_on(server, scope, receive, send, Plan({}, None, None, 1, 1, 1, None), path, started)
            return
        raw = await _read_body(scope, receive, server.args.max_body_bytes)
        if raw is None:
            limit = server.args.max_body_bytes
            error = FieldError(f"request body exceeds this server's limit of {limit} bytes (--max-body-bytes)", None,
                               code="request_too_large")  # fmt: skip
            await _refuse(send, error, RejectedBy.BODY_SIZE)
            return
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # a nesting too deep for Python is vLLM's 400 too
            body = None
        if not isinstance(body, dict):  # vLLM's own 400
            await self.app(scope, _replay(raw, receive), send)
            return
        chat = ENDPOINTS.get(path, "messages" in body)
        if path not in ENDPOINTS and (path != INVOCATIONS or not ("messages" in body or "prompt" in body)):
            sent = [f for f in FIELDS if f in body]
            if sent:
                error = FieldError(
                    f"{sent[0]} is not taken on {path}: qmc-serve's sampler fields apply to /v1/completions, "
                    f"/v1/chat/completions and /invocations (a completion or chat body); on {path} the server's "
                    f"default design ({server.args.sampler}) applies, or send vllm_xargs where vLLM takes them",
                    sent[0],
                )
                await _refuse(send, error, RejectedBy.INVALID)
                return
            try:
                other = plan_other_route(path, body, max_n=server.args.max_n)
            except FieldError as e:
                await _refuse(send, e, RejectedBy.INVALID)
                return
            await self._pass_on(server, scope, _replay(raw, receive), send, other, path, started)
            return
        try:
            try:
                plan = plan_request(body, chat=chat, default_sampler=server.args.sampler, max_n=server.args.max_n)
                payload = json.dumps(plan.body).encode()
            except RecursionError:  # parsed at the edge of Python's depth, not one level deeper
                raise FieldError("the request body is nested too deeply", None) from None
            if plan.design is not None and (broken := broken_worker(server.workers)):
                raise FieldError(
                    f"sampler {plan.design!r} is unavailable: the qmc-sampler plugin stopped drawing in an engine of "
                    f"this server ({broken}), so designed requests are refused until it is restarted; send the "
                    "request with temperature 0 for greedy decoding",
                    "sampler", code=RejectedBy.UNAVAILABLE,
                )  # fmt: skip
            await server.limiter.acquire(plan.members)
        except FieldError as e:
            reason = RejectedBy.UNAVAILABLE if e.code == RejectedBy.UNAVAILABLE else RejectedBy.INVALID
            await _refuse(send, e, RejectedBy.CAPACITY if e.status == 429 else reason)
            return
        design = plan.design or "greedy"
        METRICS.in_flight.inc(plan.members)
        reply = _Reply(send, plan)
        try:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            headers.append((b"content-length", str(len(payload)).encode()))
            rank = self._engine_for(scope, plan)
            if rank is not None:
                headers.append((b"x-data-parallel-rank", str(rank).encode()))
            await self.app(dict(scope, headers=headers), _replay(payload, receive), reply.send)
        finally:
            METRICS.in_flight.dec(plan.members)
            await server.limiter.release(plan.members)
            if reply.status == 200:
                METRICS.members.labels(design).inc(plan.members)
                METRICS.groups.labels(design).inc(plan.groups)
            log_request(reply.id, path, design, plan.n, plan.seed, reply.status, time.monotonic() - started)

    async def _pass_on(self, server: _Server, scope: dict[str, Any], receive: Any, send: Any, plan: Plan, path: str,
                       started: float) -> None:  # fmt: skip
        """vLLM's route with the body as sent, under the member limit and the engine pinning of
        ``/v1/completions`` (the server's design applies there through the plugin's drop-in)."""
        try:
            await server.limiter.acquire(plan.members)
        except FieldError as e:
            await _refuse(send, e, RejectedBy.CAPACITY if e.status == 429 else RejectedBy.INVALID)
            return
        METRICS.in_flight.inc(plan.members)
        status: list[int] = []

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            rank = self._engine_for(scope, plan)
            if rank is not None:
                scope = dict(scope, headers=[*scope["headers"], (b"x-data-parallel-rank", str(rank).encode())])
            await self.app(scope, receive, watched)
        finally:
            METRICS.in_flight.dec(plan.members)
            await server.limiter.release(plan.members)
            log_request(None, path, server.args.sampler, plan.n, None, status[0] if status else 0,
                        time.monotonic() - started)  # fmt: skip

    async def _serve_websocket(self, server: _Server, scope: dict[str, Any], receive: Any, send: Any,
                               path: str) -> None:  # fmt: skip
        """vLLM's WebSocket route with the key asked for and one member of ``--max-members-in-flight``
        held while the connection is open (it runs one generation at a time, whenever the client asks);
        a connection refused is denied before vLLM accepts it, with the status and body of a POST's."""
        if server.key_needed(path) and not server.authorized(scope):
            METRICS.rejected.labels(RejectedBy.AUTH).inc()
            await _deny_websocket(scope, receive, send, FieldError("Unauthorized", None, status=401))
            return
        if server.closing:
            METRICS.rejected.labels(RejectedBy.CLOSING).inc()
            await _deny_websocket(scope, receive, send, FieldError("the server is shutting down", None, status=503))
            return
        started = time.monotonic()
        try:
            await server.limiter.acquire(1)
        except FieldError as e:
            METRICS.rejected.labels(RejectedBy.CAPACITY if e.status == 429 else RejectedBy.INVALID).inc()
            await _deny_websocket(scope, receive, send, e)
            return
        METRICS.in_flight.inc(1)
        status: list[int] = []

        async def watched(message: dict[str, Any]) -> None:
            if not status and message["type"] in ("websocket.accept", "websocket.http.response.start",
                                                  "websocket.close"):  # fmt: skip
                status.append({"websocket.accept": 101, "websocket.close": 403}.get(message["type"])
                              or message["status"])  # fmt: skip
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            METRICS.in_flight.dec(1)
            await server.limiter.release(1)
            log_request(None, path, server.args.sampler, 1, None, status[0] if status else 0,
                        time.monotonic() - started)  # fmt: skip

    def _engine_for(self, scope: dict[str, Any], plan: Plan) -> int | None:
        """The data-parallel engine to pin a group to, or None (one engine, or nothing to keep together)."""
        if plan.placement is None or any(k == b"x-data-parallel-rank" for k, _ in scope["headers"]):
            return None
        core = getattr(scope["app"].state.engine_client, "engine_core", None)
        engines = getattr(core, "core_engines", None) or []
        if len(engines) < 2:
            return None
        if plan.placement != LEAST_LOADED:  # the same engine for every repeat of the prompt
            return int(plan.placement, 16) % len(engines)
        inflight = getattr(core, "engine_inflight", None)  # vLLM's exact count of this client's requests
        # Ties: rotate, from this API server's own place (as vLLM's balancer does), so that several
        # API-server processes (--api-server-count) do not all start at engine 0.
        start = getattr(core, "client_index", 0) + next(self._server(scope).rotation)
        order = [(start + i) % len(engines) for i in range(len(engines))]
        if inflight is None:
            return order[0]
        return min(order, key=lambda i: inflight[engines[i]])

    async def _stats(self, scope: dict[str, Any]) -> dict[str, Any]:
        from qmc_sampler.vllm_engine.checks import engine_stats_async

        engine = scope["app"].state.engine_client
        return {
            "engines": await engine_stats_async(engine),
            "unfinished_requests": engine.get_num_unfinished_requests(),
            "members_in_flight": self._server(scope).limiter.in_flight,
        }

    def _server(self, scope: dict[str, Any]) -> _Server:
        if self.server is None:
            args = scope["app"].state.args
            from vllm import envs

            keys = [k for k in (args.api_key or [envs.VLLM_API_KEY]) if k]  # as vLLM takes them
            limit = args.max_members_in_flight // max(getattr(args, "api_server_count", None) or 1, 1)
            auth = AuthenticationMiddleware(None, keys) if keys else None  # type: ignore[arg-type]
            self.server = _Server(args, MemberLimiter(max(limit, 1), args.queue_timeout), auth)
        return self.server

    def _lifespan_send(self, scope: dict[str, Any], send: Any) -> Any:
        async def lifespan_send(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self._start(scope)
            await send(message)

        return lifespan_send

    async def _start(self, scope: dict[str, Any]) -> None:
        """Check the plugin runs in every engine, and make the engine's shutdown graceful."""
        from qmc_sampler.vllm_engine.checks import engine_stats_async, require_plugin_async

        engine = scope["app"].state.engine_client
        try:
            await require_plugin_async(engine)  # never label i.i.d. samples "lattice"
            workers = tuple(w["pid"] for w in await engine_stats_async(engine) if "pid" in w)
        except RuntimeError as e:
            sys.stderr.write(f"qmc-serve: error: {e}\n")
            sys.stderr.flush()
            engine.shutdown()
            os._exit(1)  # one line, not a start-up traceback
        server, loop, stop = self._server(scope), asyncio.get_running_loop(), engine.shutdown
        server.workers = workers

        def shutdown(timeout: float | None = None) -> None:
            # vLLM's SIGTERM handler calls this from a worker thread, so the drain can run on the
            # server's loop; vLLM calls it again on its way out (on the loop: nothing left to drain).
            if not server.closing and threading.current_thread() is not threading.main_thread():
                grace = float(server.args.shutdown_timeout)
                future = asyncio.run_coroutine_threadsafe(_drain(engine, server, grace), loop)
                future.result(timeout=grace + ABORT_FLUSH_S + 10)
            stop(timeout=0)

        engine.shutdown = shutdown


async def _drain(engine: Any, server: _Server, grace: float) -> None:
    server.closing = True
    deadline = time.monotonic() + grace
    while server.responses and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + ABORT_FLUSH_S
    while server.responses and time.monotonic() < deadline:
        # Again and again: a request admitted before the close may reach the engine only now.
        left = list(engine.output_processor.request_states)
        if left:
            await engine.abort(left, internal=True)  # their responses end with finish_reason "abort"
        await asyncio.sleep(0.05)
    print(f"qmc-serve: stopped; {engine.get_num_unfinished_requests()} engine requests unfinished", flush=True)


class _Reply:
    """``send`` for vLLM's response: adds ``sampler``/``sampler_seed`` and ``sampler_release`` (the
    qmc-sampler release that drew the group: the same seed gives the same group with the same release)
    to a 200's JSON body or each SSE chunk."""

    def __init__(self, send: Any, plan: Plan) -> None:
        self._send = send
        self.status = 0
        self.id: str | None = None
        self._extension = json.dumps(
            {"sampler": plan.design, "sampler_seed": plan.seed, "sampler_release": __version__}
        )[1:-1].encode() + b","
        self._mode = ""  # "json", "sse", or "" (passed on as it is)
        self._start: dict[str, Any] | None = None
        self._held = b""
        self._finishes = _Finishes(plan)

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            kind = dict(message.get("headers", [])).get(b"content-type", b"")
            if self.status == 200:
                self._mode = "sse" if kind.startswith(b"text/event-stream") else "json" if b"json" in kind else ""
            if self._mode == "json":  # held until the body is complete: its length changes
                self._start = message
                return
            await self._send(message)
            return
        if message["type"] != "http.response.body" or not self._mode:
            await self._send(message)
            return
        self._held += message.get("body", b"")
        more = message.get("more_body", False)
        if self._mode == "json":
            if more:
                return
            body = self._insert(self._held, b"{", None)
            assert self._start is not None
            headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
            await self._send(dict(self._start, headers=[*headers, (b"content-length", str(len(body)).encode())]))
            await self._send({"type": "http.response.body", "body": body})
            return
        cut = len(self._held) if not more else self._held.rfind(b"\n\n") + 2  # whole events only
        if more and cut < 2:
            return
        ready, self._held = self._held[:cut], self._held[cut:]
        events = self._insert(self._finishes.complete(ready), b"data: {", b"\n\ndata: {")
        await self._send({"type": "http.response.body", "body": events, "more_body": more})

    def _insert(self, data: bytes, first: bytes, later: bytes | None) -> bytes:
        # Our fields after the first object's brace and each later event's: ``later`` starts
        # with a blank line, which no JSON string holds raw, so the model's text is never touched.
        if self.id is None and (found := _ID.search(data)):
            self.id = found.group(1).decode()
        if data.startswith(first):
            data = first + self._extension + data[len(first) :]
        return data if later is None else data.replace(later, later + self._extension)


class _Finishes:
    """Gives every member of a stream a last chunk: vLLM sends none for a member that ends
    before its first token (an abort: its empty last output is skipped as a prefill step).

    Each member without a ``finish_reason`` when the stream ends (before the usage chunk or
    ``[DONE]``) gets a chunk with ``finish_reason: "abort"`` in vLLM's shape; not after an
    error event, which ends the whole response.
    """

    _FINISH = b'"finish_reason":"'  # a set finish_reason; model text holds no raw quote

    def __init__(self, plan: Plan) -> None:
        self._members = plan.n * plan.groups  # choice indices: prompt × n + member
        self._chat = "messages" in plan.body
        self._model = plan.body.get("model")
        # vLLM's empty logprobs where they were asked for, so a client can read them as always
        self._logprobs = bool(plan.body.get("logprobs")) if self._chat else plan.body.get("logprobs") is not None
        self._finished: set[int] = set()
        self._first: dict[str, Any] | None = None  # id, created, model of the stream's chunks
        self._done = False

    def complete(self, events: bytes) -> bytes:
        """``events`` (whole SSE events, as vLLM sent them) with the missing last chunks added."""
        if self._done or not events:
            return events
        if self._first is None and events.startswith(b"data: {"):
            first = json.loads(events[6:].split(b"\n\n", 1)[0])
            self._first = {k: first[k] for k in ("id", "created", "model") if k in first}
        if not any(mark in events for mark in (self._FINISH, b"data: [DONE]", b'"choices":[]', b'{"error"')):
            return events  # no event that matters here (the filter is cheap; the loop below is exact)
        parts = events.split(b"\n\n")
        for at, event in enumerate(parts):
            if event.startswith(b'data: {"error"'):
                self._done = True
                return events
            if event == b"data: [DONE]" or (event.startswith(b"data: {") and b'"choices":[]' in event):
                self._done = True
                return b"\n\n".join([*parts[:at], *self._aborts(), *parts[at:]])
            if self._FINISH in event:
                self._finished.update(c["index"] for c in json.loads(event[6:])["choices"] if c["finish_reason"])
        return events

    def _aborts(self) -> list[bytes]:
        first = self._first or {"id": f"{'chatcmpl' if self._chat else 'cmpl'}-{uuid.uuid4().hex}",
                                "created": int(time.time()), "model": self._model}  # fmt: skip
        if self._chat:
            first, choice = {**first, "object": "chat.completion.chunk"}, {"delta": {}}
            logprobs: dict[str, list[Any]] = {"content": []}
        else:
            first, choice = {**first, "object": "text_completion"}, {"text": "", "stop_reason": None}
            logprobs = {key: [] for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
        choice["logprobs"] = logprobs if self._logprobs else None
        chunks = []
        for index in range(self._members):
            if index not in self._finished:
                last = {**first, "choices": [{"index": index, **choice, "finish_reason": "abort"}]}
                chunks.append(b"data: " + json.dumps(last, separators=(",", ":")).encode())
        return chunks


def _is_json(scope: dict[str, Any]) -> bool:
    kind = dict(scope["headers"]).get(b"content-type", b"application/json").split(b";")[0].strip().lower()
    return kind == b"application/json" or kind.endswith(b"+json")


async def _read_body(scope: dict[str, Any], receive: Any, limit: int) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` (by Content-Length, or as it arrives)."""
    length = dict(scope["headers"]).get(b"content-length", b"")
    if length.isdigit() and int(length) > limit:
        return None
    body, more = bytearray(), True
    while more and len(body) <= limit:
        message = await receive()
        body += message.get("body", b"")
        more = message["type"] == "http.request" and message.get("more_body", False)
    return bytes(body) if len(body) <= limit else None


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands out ``body`` once, then what the client sends next (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay


async def _refuse(send: Any, error: FieldError, reason: str) -> None:
    METRICS.rejected.labels(reason).inc()
    headers = [(b"retry-after", str(int(error.retry_after)).encode())] if error.retry_after else []
    await _respond(send, error.status, error.body(), headers)


async def _deny_websocket(scope: dict[str, Any], receive: Any, send: Any, error: FieldError) -> None:
    """Refuse a WebSocket connection before it is accepted: the HTTP status and body a POST would get
    (with ``Retry-After`` where it applies) where the server can send a response instead (ASGI's
    ``websocket.http.response`` extension: uvicorn's), else a close (the handshake's 403), whose code
    says which (1008: the key or the request, 1013: try again later)."""
    await receive()  # the client's websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        payload = json.dumps(error.body() if error.status != 401 else {"error": "Unauthorized"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if error.retry_after:
            headers.append((b"retry-after", str(int(error.retry_after)).encode()))
        await send({"type": "websocket.http.response.start", "status": error.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": payload})
        return
    code = 1013 if error.status in (429, 503) else 1008
    await send({"type": "websocket.close", "code": code, "reason": str(error)[:120]})


async def _respond(send: Any, status: int, body: dict[str, Any], headers: list[Any] | None = None) -> None:
    payload = json.dumps(body).encode()
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": start_headers + (headers or [])})
    await send({"type": "http.response.body", "body": payload})
