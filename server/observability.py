"""qmc-serve's counters, on vLLM's ``/metrics`` (prometheus_client's default registry), and its
one JSON log line per request (``id``, ``endpoint``, ``design``, ``n``, ``seed``, ``status``,
``latency_s`` — never the prompt, the completion or a header).
"""

from __future__ import annotations

import json
import logging
import sys

from prometheus_client import Counter, Gauge

__all__ = ["METRICS", "RejectedBy", "log_request"]

_log = logging.getLogger("qmc_sampler.server.requests")


class RejectedBy:
    """Reasons a request is refused (the ``reason`` label of the rejection counter)."""

    AUTH = "auth"
    BODY_SIZE = "body_size"
    CAPACITY = "members_in_flight"
    INVALID = "invalid_request"
    CLOSING = "shutting_down"
    UNAVAILABLE = "sampler_unavailable"  # the plugin stopped drawing in an engine (its draw fails on every backend)


class METRICS:
    members = Counter("qmc_serve_members", "Member requests sent to the engines", ["design"])
    groups = Counter("qmc_serve_groups", "Groups sent to the engines", ["design"])
    rejected = Counter("qmc_serve_rejected", "Requests refused", ["reason"])
    in_flight = Gauge("qmc_serve_members_in_flight", "Member requests in the engines now", multiprocess_mode="livesum")


def log_request(request_id: str | None, endpoint: str, design: str, n: int, seed: int | None, status: int,
                latency_s: float) -> None:  # fmt: skip
    """Write the request's log line (see the module docstring)."""
    if not _log.handlers:  # vLLM configures its own loggers only
        _log.addHandler(logging.StreamHandler(_Undecorated()))  # the default format: the message alone
        _log.setLevel(logging.INFO)
        _log.propagate = False
    line = {"event": "request", "id": request_id, "endpoint": endpoint, "design": design, "n": n, "seed": seed,
            "status": status, "latency_s": round(latency_s, 4)}  # fmt: skip
    _log.info(json.dumps(line))


class _Undecorated:
    """stderr as it was before vLLM < 0.31 prefixed every line of the API server's output with
    ``(APIServer pid=N)`` (``vllm.utils.system_utils.decorate_logs``): each request line stays JSON."""

    def write(self, text: str) -> int:
        write = getattr(sys.stderr, "_original_write", sys.stderr.write)
        return write(text) or 0

    def flush(self) -> None:
        sys.stderr.flush()
