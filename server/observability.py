"""``/metrics`` (Prometheus text format) and one structured log line per request.

Metrics (``prometheus_client``, in its default registry — where vLLM's engine
registers its own ``vllm:*`` metrics when stats logging is on, so one scrape
gets both):

* ``qmc_serve_requests_total{endpoint, status}`` — requests answered;
* ``qmc_serve_members_total{design}`` / ``qmc_serve_groups_total{design}`` —
  member requests and groups sent to the engine (``design="greedy"`` for
  temperature 0);
* ``qmc_serve_request_latency_seconds{endpoint}`` — until the last byte, streams included;
* ``qmc_serve_rejected_total{reason}`` — refusals: auth, body_size,
  members_in_flight, invalid_request, model_not_found;
* ``qmc_serve_members_in_flight`` — members in the engine now.

The request log (logger ``qmc_sampler.server.requests``) writes one JSON object
per request: ``id``, ``endpoint``, ``design``, ``n``, ``seed``, ``status``,
``latency_s`` — never the prompt, the completion or any header.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["METRICS", "ObservabilityMiddleware", "RequestRecord", "request_log"]

request_log = logging.getLogger("qmc_sampler.server.requests")


class _Metrics:
    def __init__(self) -> None:
        self.requests = Counter("qmc_serve_requests", "Requests answered", ["endpoint", "status"])
        self.members = Counter("qmc_serve_members", "Member requests sent to the engine", ["design"])
        self.groups = Counter("qmc_serve_groups", "Groups sent to the engine", ["design"])
        self.latency = Histogram(
            "qmc_serve_request_latency_seconds",
            "Request latency until the last byte",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160),
        )
        self.rejected = Counter("qmc_serve_rejected", "Requests refused", ["reason"])
        self.in_flight = Gauge("qmc_serve_members_in_flight", "Member requests in the engine now")


METRICS = _Metrics()


class RequestRecord:
    """What the handler learned about a request, for its log line (set on ``request.state.record``)."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.design: str | None = None
        self.n: int | None = None
        self.seed: int | None = None


class ObservabilityMiddleware:
    """Time every ``/v1/*`` request to its last byte, count it, and log one line (pure ASGI)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        record = RequestRecord()
        scope.setdefault("state", {})["record"] = record
        status = 500

        async def observed_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            endpoint = scope["path"]
            latency = time.monotonic() - start
            METRICS.requests.labels(endpoint, str(status)).inc()
            METRICS.latency.labels(endpoint).observe(latency)
            request_log.info(
                json.dumps(
                    {
                        "event": "request",
                        "id": record.id,
                        "endpoint": endpoint,
                        "design": record.design,
                        "n": record.n,
                        "seed": record.seed,
                        "status": status,
                        "latency_s": round(latency, 4),
                    }
                )
            )
