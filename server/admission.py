"""What a request must pass before it reaches the engine: the key, the body size, the capacity.

* :class:`GuardMiddleware` (pure ASGI, outermost): on every ``/v1/*`` route the
  ``Authorization: Bearer`` key is compared in constant time
  (``hmac.compare_digest``) and a wrong or missing key is a 401 in OpenAI's error
  shape; ``/health`` and ``/metrics`` stay open. Request bodies larger than the
  limit are refused with a 400 naming it — by their ``Content-Length`` before
  anything is read, or as soon as a chunked body passes the limit. Keys are never
  logged or echoed.
* :class:`MemberLimiter`: every choice of a response is one member request in
  the engine; at most ``--max-members-in-flight`` of them run at once. A request
  that does not fit waits up to ``--queue-timeout`` seconds for room, then gets a
  429 with ``Retry-After``; one that could never fit (n × prompts above the
  limit) gets a 400 naming the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from qmc_sampler.server.protocol import RequestError, error_body

__all__ = ["GuardMiddleware", "MemberLimiter", "RejectedBy"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RejectedBy:
    """Reasons a request is refused (the ``reason`` label of the rejection counter)."""

    AUTH = "auth"
    BODY_SIZE = "body_size"
    CAPACITY = "members_in_flight"
    INVALID = "invalid_request"
    MODEL = "model_not_found"


class GuardMiddleware:
    """API-key check on ``/v1/*`` and the request-body limit (see module docstring).

    Args:
        app: the ASGI app behind it.
        api_key: the key clients must send, or None for an open server.
        max_body_bytes: the largest request body accepted.
        on_reject: called with a :class:`RejectedBy` reason for every refusal (metrics).
    """

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int, on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None and scope["path"].startswith("/v1/"):
            sent = dict(scope["headers"]).get(b"authorization", b"")
            # compare_digest takes time independent of where the two differ.
            if not hmac.compare_digest(sent, self.expected):
                self.on_reject(RejectedBy.AUTH)
                message = "Incorrect API key provided." if sent else "Missing API key: send Authorization: Bearer KEY."
                await _respond(send, 401, error_body(message, None, code="invalid_api_key"))
                return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        # Read the body here, at most the limit (a chunked body has no Content-Length),
        # and replay it to the app.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
        await self.app(scope, _replay(chunks, None, receive), send)

    async def _too_large(self, send: Send) -> None:
        self.on_reject(RejectedBy.BODY_SIZE)
        message = f"request body exceeds this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"
        await _respond(send, 400, error_body(message, None, code="request_too_large"))


def _replay(chunks: list[bytes], other: dict[str, Any] | None, receive: Receive | None = None) -> Receive:
    """A ``receive`` that hands out the buffered body once, then what the client sends next (a disconnect)."""
    pending: list[dict[str, Any]] = (
        [{"type": "http.request", "body": b"".join(chunks), "more_body": False}] if other is None else [other]
    )

    async def replay() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        if receive is None:
            return {"type": "http.disconnect"}
        return await receive()

    return replay


async def _respond(send: Send, status: int, body: dict[str, Any], headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": payload})


class CapacityError(RequestError):
    """No room for the request's members within the wait (HTTP 429 with ``Retry-After``)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message, None, status=429)
        self.retry_after = retry_after


class MemberLimiter:
    """At most ``limit`` member requests in the engine at once (see module docstring).

    Args:
        limit: the bound (``--max-members-in-flight``); queue_timeout: how long a
            request may wait for room before a 429.
    """

    def __init__(self, limit: int, queue_timeout: float = 0.0) -> None:
        self.limit = limit
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._room = asyncio.Condition()

    async def acquire(self, members: int) -> None:
        """Reserve room for ``members``; wait at most ``queue_timeout`` for it.

        Raises:
            RequestError: more members than the limit (400); CapacityError: no room in time (429).
        """
        if members > self.limit:
            raise RequestError(
                f"this request needs {members} members (n × prompts), above this server's "
                f"--max-members-in-flight={self.limit}",
                "n",
            )
        async with self._room:
            try:
                if self.in_flight + members > self.limit:
                    if self.queue_timeout <= 0:
                        raise TimeoutError
                    fits = lambda: self.in_flight + members <= self.limit  # noqa: E731
                    await asyncio.wait_for(self._room.wait_for(fits), self.queue_timeout)
            except TimeoutError:
                raise CapacityError(
                    f"the server is at its limit of {self.limit} members in flight (--max-members-in-flight); "
                    f"{self.in_flight} are running. Retry later.",
                    retry_after=max(1.0, math.ceil(self.queue_timeout)),
                ) from None
            self.in_flight += members

    async def release(self, members: int) -> None:
        """Give back the room of ``members`` that finished or were aborted."""
        async with self._room:
            self.in_flight -= members
            self._room.notify_all()
