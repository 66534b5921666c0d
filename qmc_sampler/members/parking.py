"""The parked-member index: members out of the batch, found again by group key, history and identity.

A member whose request leaves the batch is *parked* in case the request comes back (a
preemption). :class:`ParkedMembers` keeps them in park order and indexes them by
(group key, history fingerprint) and, for members parked with an identity, by
(group key, fingerprint, identity), so finding a returning request's member is at most four
dictionary lookups however many are parked. The bounds and their logging are the registry's
(docs/internals.md, "Parked members").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from qmc_sampler.members.member import Member

__all__ = ["ParkedMembers"]


@dataclass
class ParkedMembers:
    """The parked members, least recently parked first, and their index (module docstring)."""

    _parked: OrderedDict[int, Member] = field(default_factory=OrderedDict)  # LRU over all groups
    # Per group key, in park order (its oldest first): the per-key bound and group expiry. (A
    # plain dict: reaching its first entry scans the slots emptied at its front since its last
    # resize, about a microsecond at the default bound.)
    _by_group: dict[Hashable, dict[int, Member]] = field(default_factory=dict)
    # (group key, *fingerprint) → its members as a _Bucket (id(member), park number): admission's lookup.
    _by_history: dict[tuple, _Bucket] = field(default_factory=dict)
    # (group key, *fingerprint, identity) → the same, for members parked with an identity.
    _by_identity: dict[tuple, _Bucket] = field(default_factory=dict)
    # id(member) → (its history keys, its identity): what to take out of the index when it leaves.
    _filed: dict[int, tuple[tuple[tuple, ...], Hashable]] = field(default_factory=dict)
    _parks: int = 0  # members parked so far (the park number)

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, member: Member) -> bool:
        return id(member) in self._parked

    def add(self, member: Member) -> None:
        """Park ``member`` as the most recently parked one (filed again if it was parked already)."""
        if id(member) in self._parked:  # parked twice: filed again, as parked now
            self._parked.pop(id(member))
            self._forget(member)
        key = id(member)
        self._parked[key] = member
        self._by_group.setdefault(member.group_key, {})[key] = member
        self._file(member)

    def remove(self, member: Member) -> bool:
        """Take ``member`` out of parking and the index.

        Returns:
            False if it was not parked (nothing changes).
        """
        if self._parked.pop(id(member), None) is None:
            return False
        self._forget(member)
        return True

    def oldest(self) -> Member:
        """The least recently parked member (there must be one)."""
        return next(iter(self._parked.values()))

    def of_group(self, key: Hashable) -> Iterator[Member]:
        """The members parked under group key ``key``, oldest first."""
        return iter(self._by_group.get(key, {}).values())

    def count_of_group(self, key: Hashable) -> int:
        """How many members are parked under group key ``key``."""
        return len(self._by_group.get(key, ()))

    def take(self, key: Hashable, identity: Hashable, done: int, at: tuple, after: tuple | None) -> Member | None:
        """Take out of parking the member a request entering the batch resumes, if any.

        The rule, over the key's parked members :meth:`~qmc_sampler.members.member.Member.consistent_with`
        the request's output in the order they were parked: the first with the request's
        identity; else, for a request with a history, the first exactly at it, else the first
        whose pending token completes it. Here: at most four dictionary lookups, whatever the
        count parked.

        Args:
            key: the request's group key.
            identity: the caller's name for the request, or None.
            done: its output length.
            at, after: :func:`~qmc_sampler.members.history.history_fingerprints` of its output.

        Returns:
            The member, out of parking, or None.
        """
        found = None
        if identity is not None:
            found = self._earliest((key, *at), identity, (key, *after) if after else None)
        # Matching by history alone needs a history: a new request arrives with
        # none, and must never take a parked sibling's member.
        if found is None and done:
            # Most specific first: a member exactly at this history, then one whose
            # pending draw is the last accepted token.
            found = self._earliest((key, *at)) or (self._earliest((key, *after)) if after else None)
        if found is not None:
            del self._parked[id(found)]
            self._forget(found)
        return found

    def _earliest(self, first: tuple, identity: Hashable = None, second: tuple | None = None) -> Member | None:
        """The earliest parked member filed under one of two index keys.

        Args:
            first, second: ``(group key, *fingerprint)`` keys (``second`` may be None).
            identity: if not None, only members parked with this identity.

        Returns:
            The member parked first among those filed there, or None (it stays parked).
        """
        best: tuple[int, int] | None = None  # (park number, id)
        for history in (first, second):
            if history is None:
                continue
            bucket = self._by_history.get(history) if identity is None else self._by_identity.get((*history, identity))
            if bucket is not None:
                ident, number = _first(bucket)  # park order: the first is the earliest
                if best is None or number < best[0]:
                    best = (number, ident)
        # Every filed member is parked (filing and _forget go together); a miss is no member.
        return None if best is None else self._parked.get(best[1])

    def _file(self, member: Member) -> None:
        """Index a member being parked under its group key and the histories it matches."""
        self._parks += 1
        histories = tuple((member.group_key, *fp) for fp in member.fingerprints())
        for k in histories:
            _add(self._by_history, k, id(member), self._parks)
            if member.identity is not None:
                _add(self._by_identity, (*k, member.identity), id(member), self._parks)
        self._filed[id(member)] = (histories, member.identity)

    def _forget(self, member: Member) -> None:
        """Take a member that is leaving parking (already out of ``_parked``) out of the index."""
        group = self._by_group.get(member.group_key)
        if group is not None:
            group.pop(id(member), None)
            if not group:
                del self._by_group[member.group_key]
        histories, identity = self._filed.pop(id(member), ((), None))
        for k in histories:
            _remove(self._by_history, k, id(member))
            if identity is not None:
                _remove(self._by_identity, (*k, identity), id(member))


# The parked members filed under one key of the index, in park order, as (id(member), park
# number): most histories are one member's, kept as that pair (a few dozen bytes, not a
# dictionary's hundreds, for up to max_parked members); two or more, as an OrderedDict, whose
# first entry stays O(1) to reach however many were taken from its front before.
_Bucket = tuple[int, int] | OrderedDict[int, int]


def _add(index: dict[tuple, _Bucket], key: tuple, ident: int, number: int) -> None:
    """File member ``ident`` (parked as number ``number``, the highest so far) under ``key``."""
    bucket = index.get(key)
    if bucket is None:
        index[key] = (ident, number)
    elif isinstance(bucket, tuple):
        index[key] = OrderedDict((bucket, (ident, number)))
    else:
        bucket[ident] = number


def _first(bucket: _Bucket) -> tuple[int, int]:
    """The ``(id, park number)`` of the earliest parked member in ``bucket``."""
    return bucket if isinstance(bucket, tuple) else next(iter(bucket.items()))


def _remove(index: dict[tuple, _Bucket], key: tuple, ident: int) -> None:
    """Take member ``ident`` out of ``key``'s bucket (dropping the bucket once empty)."""
    bucket = index.get(key)
    if isinstance(bucket, tuple):
        if bucket[0] == ident:
            del index[key]
    elif bucket is not None:
        bucket.pop(ident, None)
        if not bucket:
            del index[key]
