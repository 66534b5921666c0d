"""The member limit: at most ``--max-members-in-flight`` member requests (n × prompts) at once.

A request that does not fit waits up to ``--queue-timeout`` seconds, then gets a 429
with ``Retry-After``; one that never could (above the limit) gets a 400 naming it.
"""

from __future__ import annotations

import asyncio
import math

from qmc_sampler.server.fields import FieldError

__all__ = ["MemberLimiter"]


class MemberLimiter:
    """At most ``limit`` member requests in flight; a request waits up to ``queue_timeout`` s for room."""

    def __init__(self, limit: int, queue_timeout: float = 0.0) -> None:
        self.limit = limit
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._room = asyncio.Condition()

    async def acquire(self, members: int) -> None:
        """Reserve room for ``members``; wait at most ``queue_timeout`` for it.

        Raises:
            FieldError: more members than the limit (400), or no room in time (429, ``retry_after``).
        """
        if members > self.limit:
            raise FieldError(
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
                raise FieldError(
                    f"the server is at its limit of {self.limit} members in flight (--max-members-in-flight); "
                    f"{self.in_flight} are running. Retry later.",
                    None, 429, "members_in_flight", retry_after=max(1.0, math.ceil(self.queue_timeout)),
                ) from None  # fmt: skip
            self.in_flight += members

    async def release(self, members: int) -> None:
        """Give back the room of ``members`` that finished or were aborted."""
        async with self._room:
            self.in_flight -= members
            self._room.notify_all()
