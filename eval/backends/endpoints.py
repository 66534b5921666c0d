"""Generating groups on served models: any number of OpenAI-compatible endpoints running the plugin.

Every member of every group is its own HTTP request carrying its place in the
design, so a group is the same whichever endpoint serves each member — the
counter-based draws need no coordination between replicas:

``vllm_xargs`` = ``qmc_method``, ``qmc_seed``, ``qmc_order``, ``qmc_group``,
``qmc_index``, ``qmc_n`` (:func:`~qmc_sampler.eval.backends.generation.member_xargs`) — which
``vllm serve`` with the plugin and ``qmc-serve`` (the same server) both take.

:class:`EndpointBackend` first checks each endpoint (reachable, the API key
accepted, the model served, the plugin running — a vLLM server without it would
silently sample i.i.d.), then sends the members with at most ``concurrency``
requests in flight, spread round-robin over the endpoints that answer.
Connection errors, 429 and 5xx are retried with exponential backoff (honouring
``Retry-After``) on another endpoint where there is one, so a run survives
losing a replica; so is a member that comes back cut off (``finish_reason``
neither ``stop`` nor ``length``: a replica shutting down aborts what it runs) —
never recorded as a sample. Any other error stops the run with one line. A group is
handed to ``on_group`` once, when all its members are in.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qmc_sampler.eval.backends.generation import Completion, GroupJob, OnGroup, member_xargs
from qmc_sampler.vllm_engine.checks import PROBE_METHOD  # the design no server admits: the plugin says so

__all__ = ["Endpoint", "EndpointBackend", "EndpointError"]

_RETRYABLE_STATUS = {429, 500, 502, 503, 504}
#: Finish reasons of a whole sample; any other (vLLM's "abort", "error") is a member cut off and retried.
_COMPLETE = ("stop", "length")


class EndpointError(RuntimeError):
    """An endpoint that cannot be used as asked; the message is one line naming it."""


@dataclass
class Endpoint:
    """One server: where it is, and when it may be tried again."""

    url: str  # without /v1
    down_until: float = 0.0


class EndpointBackend:
    """Generate groups on OpenAI-compatible servers (see module docstring).

    Serves member ranges (``GroupJob.first``/``count``: rounds of a sequential group).

    Args:
        urls: the endpoints' base URLs (``http://host:port``, with or without ``/v1``).
        model: the served model name (default: the first one the endpoints list).
        api_key: sent as ``Authorization: Bearer``.
        concurrency: member requests in flight at once.
        max_attempts: tries per member request before the run stops.
        timeout: seconds one request may take.
    """

    supports_rounds = True

    def __init__(
        self,
        urls: list[str],
        model: str | None = None,
        api_key: str | None = None,
        concurrency: int = 32,
        max_attempts: int = 8,
        timeout: float = 600.0,
    ) -> None:
        self.endpoints = [Endpoint(u.rstrip("/").removesuffix("/v1")) for u in urls]
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.retries = 0  # requests retried (connection errors, 429, 5xx)
        self._turn = 0

    # ---- start-up checks --------------------------------------------------
    def connect(self) -> str:
        """Check every endpoint; return one line describing the fleet.

        Raises:
            EndpointError: unreachable, key refused, model not served, or no plugin.
        """
        import httpx

        with httpx.Client(timeout=30, headers=self.headers) as http:
            for endpoint in self.endpoints:
                served = self._models(http, endpoint)
                if self.model is None:
                    self.model = served[0]
                if self.model not in served:
                    raise EndpointError(f"model {self.model!r} is not served by {endpoint.url} (it serves {served})")
                self._probe_plugin(http, endpoint)
        urls = ", ".join(e.url for e in self.endpoints)
        return f"{self.model} on {len(self.endpoints)} endpoint(s): {urls}"

    def _models(self, http: Any, endpoint: Endpoint) -> list[str]:
        import httpx

        try:
            response = http.get(f"{endpoint.url}/v1/models")
        except httpx.HTTPError as e:
            raise EndpointError(f"endpoint {endpoint.url} is unreachable ({type(e).__name__}: {e})") from None
        if response.status_code == 401:
            raise EndpointError(
                f"endpoint {endpoint.url} refused the API key (HTTP 401); pass --api-key or set QMC_EVAL_API_KEY"
            )
        if response.status_code != 200:
            raise EndpointError(f"endpoint {endpoint.url} answered /v1/models with HTTP {response.status_code}")
        try:
            data = response.json()["data"]
            return [m["id"] for m in data]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"endpoint {endpoint.url} is not an OpenAI-compatible server (/v1/models)") from None

    def _probe_plugin(self, http: Any, endpoint: Endpoint) -> None:
        body = {"model": self.model, "prompt": "x", "max_tokens": 1, "vllm_xargs": {"qmc_method": PROBE_METHOD}}
        response = http.post(f"{endpoint.url}/v1/completions", json=body)
        if response.status_code == 400 and PROBE_METHOD not in response.text and "qmc_method" in response.text:
            raise EndpointError(f"endpoint {endpoint.url} refuses designs: {response.text[:500]}")
        if response.status_code != 400 or PROBE_METHOD not in response.text:
            raise EndpointError(
                f"endpoint {endpoint.url} does not run the qmc-sampler plugin (a bad qmc_method was accepted): "
                "install qmc-llm-sampler where the server runs"
            )

    # ---- generation -------------------------------------------------------
    def run(self, jobs: Iterable[GroupJob], on_group: OnGroup) -> None:
        """Generate every group of ``jobs``; call ``on_group`` as each completes (see module docstring).

        Raises:
            EndpointError: a request failed for good (the groups finished before it are written).
        """
        if self.model is None:
            self.connect()
        asyncio.run(self._run(list(jobs), on_group))

    async def _run(self, jobs: list[GroupJob], on_group: OnGroup) -> None:
        import httpx

        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # filled once, in group order
        texts: list[dict[int, Completion]] = [{} for _ in jobs]
        for j, job in enumerate(jobs):
            for member in job.member_ids:
                queue.put_nowait((j, member))
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers, limits=limits) as http:

            async def worker() -> None:
                while not queue.empty():
                    j, member = queue.get_nowait()
                    texts[j][member] = await self._member(http, jobs[j], member)
                    if len(texts[j]) == len(jobs[j].member_ids):
                        on_group(jobs[j], [texts[j][m] for m in jobs[j].member_ids])

            workers = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()

    def _payload(self, job: GroupJob, member: int) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model, "n": 1, "include_stop_str_in_output": True, **job.sampling}
        body["vllm_xargs"] = member_xargs(job, member)
        if job.messages is not None:
            return "/v1/chat/completions", body | {"messages": job.messages}
        return "/v1/completions", body | {"prompt": job.prompt}

    async def _member(self, http: Any, job: GroupJob, member: int) -> Completion:
        import httpx

        last = "no attempt"
        for attempt in range(self.max_attempts):
            endpoint = self._pick()
            path, body = self._payload(job, member)
            wait = min(8.0, 0.5 * 2**attempt) * (0.5 + random.random())  # jitter: replicas do not retry in step
            try:
                response = await http.post(endpoint.url + path, json=body)
            except httpx.HTTPError as e:  # connection refused or dropped, timeouts: try another replica
                endpoint.down_until = time.monotonic() + 5.0
                last = f"{endpoint.url}: {type(e).__name__}"
            else:
                choice = response.json()["choices"][0] if response.status_code == 200 else None
                if choice is not None and choice.get("finish_reason") in _COMPLETE:
                    text = choice["message"]["content"] if job.messages is not None else choice["text"]
                    return Completion(text, choice["finish_reason"])
                if choice is not None:  # cut off (a replica shutting down aborts what it runs): not a sample
                    endpoint.down_until = time.monotonic() + 5.0
                    last = f"{endpoint.url}: member cut off (finish_reason {choice.get('finish_reason')!r})"
                elif response.status_code not in _RETRYABLE_STATUS:
                    raise EndpointError(f"{endpoint.url}{path} refused member {member} of {job.group_id}: "
                                        f"HTTP {response.status_code} {_message(response)}")  # fmt: skip
                else:
                    last = f"{endpoint.url}: HTTP {response.status_code} {_message(response)}"
                    if response.status_code == 429:
                        wait = max(wait, float(response.headers.get("Retry-After", 1)))
                    else:
                        endpoint.down_until = time.monotonic() + 2.0
            self.retries += 1
            await asyncio.sleep(wait)
        raise EndpointError(f"member {member} of {job.group_id} failed {self.max_attempts} times; last: {last}")

    def _pick(self) -> Endpoint:
        """The next endpoint, round-robin over those not marked down (all of them if every one is)."""
        now = time.monotonic()
        up = [e for e in self.endpoints if e.down_until <= now] or self.endpoints
        self._turn += 1
        return up[self._turn % len(up)]


def _message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"]).splitlines()[0][:300]
    except (ValueError, KeyError, TypeError, IndexError):
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else ""
