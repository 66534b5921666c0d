"""What places a member in its group: the group kinds, the arguments a request brings, its place.

A request with a design carries :class:`GroupArgs` (written at admission by the engine's
front end, read back where it is drawn); :class:`~qmc_sampler.members.groups.GroupResolver`
turns them into a :class:`Placement` — its group's spec, its member index and its group's
label. The kinds of group (docs/internals.md, "Groups"): :data:`EXPLICIT` (the caller names
the group), :data:`PER_REQUEST` (one request's own members: the children of an ``n > 1``
request, or a lone request with auto-grouping off) and :data:`AUTO` (repeats of one ``n = 1``
prompt: an extensible lattice, open for its ttl).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from qmc_sampler.group import GroupSpec

__all__ = ["AUTO", "DEFAULT_GROUP_TTL", "EXPLICIT", "PER_REQUEST", "GroupArgs", "Placement"]

#: The kinds of group (see the module docstring).
EXPLICIT, PER_REQUEST, AUTO = "explicit", "per_request", "auto"

#: Seconds an auto group stays open after its last member left, unless a request says otherwise.
DEFAULT_GROUP_TTL = 300.0


@dataclass(frozen=True)
class GroupArgs:
    """What is needed to place one request (one member) in its group.

    Attributes:
        kind: ``explicit``, ``per_request`` or ``auto``.
        method, order: the design and vocabulary order.
        seed: the group seed, or None (derived where the member is placed).
        n: group size (0 for auto groups: extensible).
        group: the group key (explicit and request groups; auto groups are keyed by prompt).
        index: the member index if the caller gave one.
        params_key: fingerprint of the sampling parameters (auto groups).
        arrival: front-end clock at admission (seconds); ttl: auto-group time-to-live.
        fresh_seed: the seed for a new group when ``seed`` is None (drawn in the front-end).
        children: the request's ``n`` (an explicit ``index`` is the first of ``children`` members).
        tag: names the request, so its children can be numbered (explicit groups with an index).
        salt: the front end's instance salt: tells apart replicas, and an engine before and
            after a restart, where a group is numbered or seeded where it is drawn.
        child: this child's place in its ``n > 1`` request (0 … ``children`` − 1), written by the
            front end as the request is fanned out into children, so that the engine that draws
            it needs no counter (vLLM may send one request's children to different engines);
            None for a request that is not a child, or where the front end could not mark it.
    """

    kind: str
    method: str
    order: str
    seed: int | None
    n: int
    group: str = ""
    index: int | None = None
    params_key: str = ""
    arrival: float = 0.0
    ttl: float = DEFAULT_GROUP_TTL
    fresh_seed: int | None = None
    children: int = 1
    tag: str = ""
    salt: int = 0
    child: int | None = None


@dataclass(frozen=True)
class Placement:
    """A request's place: its group's spec, its member index, and its group's label.

    ``fresh`` is True for a member beyond its group's size (docs/internals.md, "Groups").
    ``auto_key`` identifies the auto group (None for the other kinds).
    """

    label: str
    spec: GroupSpec
    member: int
    fresh: bool = False
    auto_key: Hashable | None = None
