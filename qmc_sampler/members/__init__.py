"""The members of groups, engine-agnostic (``qmc_sampler.members``): who is which member, and the draw cycle.

Used by every door that draws group members — the vLLM plugin and transformers' ``generate``
(``qmc_sampler.hf``) — and knowing none of them:

* :mod:`~qmc_sampler.members.keys` — the request contract: the ``qmc_*`` keys, the
  ``QMC_SAMPLER*`` variables, :func:`check_extra_args`;
* :mod:`~qmc_sampler.members.placement` — the group kinds, a request's :class:`GroupArgs`
  and its :class:`Placement`;
* :mod:`~qmc_sampler.members.groups` — :class:`GroupResolver`: who is which member;
* :mod:`~qmc_sampler.members.member` — :class:`Member`, its :class:`Pending` draw, its
  :class:`RowSampling`;
* :mod:`~qmc_sampler.members.history` — token histories, on the host and the device;
* :mod:`~qmc_sampler.members.pool` — :class:`DevicePool`: the numbers of the members in the batch;
* :mod:`~qmc_sampler.members.cycle` — :class:`DrawCycle`: draw → pending → commit, on the device;
* :mod:`~qmc_sampler.members.parking` — :class:`ParkedMembers`: the parked-member index;
* :mod:`~qmc_sampler.members.registry` — :class:`MemberRegistry`: admission, parking, resumption.

How and why: docs/internals.md, "Groups" and "The registry".
"""

from qmc_sampler.members.cycle import DrawCycle, RegistryStats
from qmc_sampler.members.groups import EngineSalt, GroupResolver, GroupStats
from qmc_sampler.members.history import extend_history, history_fingerprints, token_history
from qmc_sampler.members.member import Member, Pending, RowSampling
from qmc_sampler.members.parking import ParkedMembers
from qmc_sampler.members.placement import AUTO, DEFAULT_GROUP_TTL, EXPLICIT, PER_REQUEST, GroupArgs, Placement
from qmc_sampler.members.pool import DevicePool
from qmc_sampler.members.registry import MemberRegistry

__all__ = [
    "AUTO",
    "DEFAULT_GROUP_TTL",
    "EXPLICIT",
    "PER_REQUEST",
    "DevicePool",
    "DrawCycle",
    "EngineSalt",
    "GroupArgs",
    "GroupResolver",
    "GroupStats",
    "Member",
    "MemberRegistry",
    "ParkedMembers",
    "Pending",
    "Placement",
    "RegistryStats",
    "RowSampling",
    "extend_history",
    "history_fingerprints",
    "token_history",
]
