"""Group designs: how the n members of a group get correlated uniforms.

Every design implements one small contract (:class:`GroupDesign`) over arrays of
draws, so rows of many groups are served in one call. A design is either

* a *code* design (``carries = True``): each member starts from one code
  c_i ∈ [0, 1) and the residual carry (:mod:`qmc_sampler.carry`) turns it into the
  next step's uniform — ``lattice``, ``stratified``, ``arithmetic``; or
* a *per-step* design (``carries = False``): u_{i,t} is given directly —
  ``iid``, ``sobol``, ``antithetic``.

In every design each member's code / uniforms are exactly U[0, 1) on their own,
which is what makes every member an exact draw from the model
(``../shared/design/qmc-math.md`` §2–3).
"""

from __future__ import annotations

import itertools
from abc import ABC
from typing import ClassVar

import numpy as np
from numpy.typing import NDArray

from qmc_sampler.counter_rng import Purpose, counter_hash, counter_uniform
from qmc_sampler.limits import MAX_GROUP_SIZE
from qmc_sampler.sobol import scrambled_sobol_uniforms

__all__ = ["DESIGNS", "MAX_GROUP_SIZE", "METHODS", "GroupDesign", "get_design", "radical_inverse", "stratum_of_member"]

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F64 = NDArray[np.float64]


class GroupDesign(ABC):
    """The contract every design implements (vectorised over draws of many groups).

    Arrays are 1-D and aligned: ``seeds[j]``, ``ns[j]``, ``members[j]`` (and
    ``steps[j]``) describe draw j, which may belong to any group.
    """

    name: ClassVar[str]
    carries: ClassVar[bool]
    #: True when only n = 2^m gives the design its balance (a warning otherwise).
    wants_power_of_two: ClassVar[bool] = False
    #: True when member i's draws do not depend on the group size, so a group can
    #: grow one member at a time with no size given (``n = 0``, "extensible").
    extensible: ClassVar[bool] = True

    def start_codes(self, seeds: U64, ns: I64, members: I64) -> F64:
        """Each member's initial code c_i ∈ [0, 1) (code designs only)."""
        raise NotImplementedError(f"{self.name!r} is a per-step design; it has no codes")

    def step_uniforms(self, seeds: U64, ns: I64, members: I64, steps: I64) -> F64:
        """u_{i,t} ∈ (0, 1) for member i at step t (per-step designs only)."""
        raise NotImplementedError(f"{self.name!r} is a code design; its uniforms come from the carry")

    def alone_widths(self, ns: I64) -> F64:
        """Prefix width below which no other member can share a member's prefix.

        Below it a carry member switches to fresh uniforms (qmc-math.md §2,
        "Precision and alone members"). 0 where the design gives no such guarantee,
        and for extensible groups (n = 0), whose size is unknown.
        """
        return np.zeros(np.shape(ns), dtype=np.float64)


def radical_inverse(i: I64, bits: int = 32) -> F64:
    """Base-2 radical inverse φ2(i): the bits of i mirrored about the binary point."""
    x = np.asarray(i, dtype=np.uint64)
    out = np.zeros(x.shape, dtype=np.uint64)
    for b in range(bits):
        out |= ((x >> np.uint64(b)) & np.uint64(1)) << np.uint64(bits - 1 - b)
    return out.astype(np.float64) * 2.0**-bits


def _is_power_of_two(ns: I64) -> NDArray[np.bool_]:
    ns = np.asarray(ns, dtype=np.int64)
    return (ns > 0) & ((ns & (ns - 1)) == 0)


def _group_shift(seeds: U64) -> F64:
    return counter_uniform(seeds, Purpose.SHIFT, 0, 0)


class IIDDesign(GroupDesign):
    """Independent uniforms for every member and step: ordinary sampling."""

    name = "iid"
    carries = False

    def step_uniforms(self, seeds: U64, ns: I64, members: I64, steps: I64) -> F64:
        return counter_uniform(seeds, Purpose.FRESH, members, steps)


class LatticeDesign(GroupDesign):
    """Randomly shifted lattice, c_i = frac(φ2(i) + Δ) for n = 2^m or n = 0, else frac(i/n + Δ).

    The radical-inverse order makes every aligned block of 2^j members a shifted
    lattice of size 2^j, so groups extend and sub-groups are valid designs
    (QuasiMoTTo 2026; qmc-math.md §2 ``lattice``). n = 0 is the extensible group
    of unknown size: radical-inverse codes, and no alone width.
    """

    name = "lattice"
    carries = True

    def start_codes(self, seeds: U64, ns: I64, members: I64) -> F64:
        ns = np.asarray(ns, dtype=np.int64)
        members = np.asarray(members, dtype=np.int64)
        dyadic = _is_power_of_two(ns) | (ns == 0)
        base = np.where(dyadic, radical_inverse(members), members / np.maximum(ns, 1))
        return np.mod(base + _group_shift(seeds), 1.0)

    def alone_widths(self, ns: I64) -> F64:
        ns = np.asarray(ns, dtype=np.float64)
        return np.where(ns > 0, 1.0 / np.maximum(ns, 1.0), 0.0)


class ArithmeticDesign(GroupDesign):
    """Arithmetic sampling codes c_i = frac((i+1)/(n+1) + Δ) (Vilnis et al. 2023, §3)."""

    name = "arithmetic"
    carries = True
    extensible = False

    def start_codes(self, seeds: U64, ns: I64, members: I64) -> F64:
        ns = np.asarray(ns, dtype=np.float64)
        members = np.asarray(members, dtype=np.float64)
        return np.mod((members + 1.0) / (ns + 1.0) + _group_shift(seeds), 1.0)

    def alone_widths(self, ns: I64) -> F64:
        # Codes are 1/(n+1) apart: an interval narrower than that holds one at most.
        return 1.0 / (np.asarray(ns, dtype=np.float64) + 1.0)


#: Feistel rounds of the stratum permutation: four make a keyed bijection indistinguishable from
#: a random permutation (Luby & Rackoff 1988), which a per-member evaluation needs.
_FEISTEL_ROUNDS = 4
_U32 = np.uint64(0xFFFFFFFF)


def stratum_of_member(seeds: U64, ns: I64, members: I64) -> I64:
    """π(i): the stratum of member i of a stratified group, evaluated for that member alone.

    π(i) = (σ(i) + s) mod n, where σ is a keyed bijection of [0, n) — a four-round Feistel
    network on the smallest even number of bits covering n, cycle-walked back into [0, n)
    (Black & Rogaway 2002, "Ciphers with arbitrary finite domains", §3) — and s is the
    group's shift, uniform on [0, n). Each member's stratum is therefore uniform on [0, n)
    on its own (through s, whatever σ), which is what keeps its code exactly U[0, 1); σ
    spreads any subset of members (e.g. the first k) over the strata at random. Work and
    memory are O(1) per member: nothing depends on n beyond its bit length, so a client's
    group size cannot make a decoding step allocate or sort (qmc-math.md §2 ``stratified``).

    Args:
        seeds: ``[draws] uint64`` group seeds; ns: ``[draws] int64`` group sizes in
            ``[1, MAX_GROUP_SIZE]``; members: ``[draws] int64`` member indices in ``[0, n)``.

    Returns:
        ``[draws] int64`` strata; for one (seed, n), a permutation of ``[0, n)`` over the members.
    """
    seeds = np.atleast_1d(np.asarray(seeds, dtype=np.uint64))
    ns = np.atleast_1d(np.asarray(ns, dtype=np.int64))
    members = np.atleast_1d(np.asarray(members, dtype=np.int64))
    if np.any((ns < 1) | (ns > MAX_GROUP_SIZE)) or np.any((members < 0) | (members >= ns)):
        # The cycle walk returns to [0, n) only from a point in it: refuse, never loop.
        raise ValueError(f"stratum_of_member needs 1 <= n <= {MAX_GROUP_SIZE} and 0 <= member < n")
    bits = np.ceil(np.log2(np.maximum(ns, 2).astype(np.float64))).astype(np.int64)  # exact below 2^52
    half = ((bits + 1) // 2).astype(np.uint64)
    n_u = ns.astype(np.uint64)
    x = _feistel(seeds, members.astype(np.uint64), half)
    walking = x >= n_u  # a bijection's cycle through an in-range value returns to the range
    while walking.any():
        x[walking] = _feistel(seeds[walking], x[walking], half[walking])
        walking = x >= n_u
    return ((x + _uniform_below(seeds, n_u)) % n_u).astype(np.int64)


def _feistel(seeds: U64, x: U64, half: U64) -> U64:
    # A balanced Feistel network on 2·half bits; each round key is the counter hash of
    # (seed, round, right half), so the permutation depends on the group seed alone.
    mask = (np.uint64(1) << half) - np.uint64(1)
    left, right = x >> half, x & mask
    for r in range(_FEISTEL_ROUNDS):
        left, right = right, left ^ (counter_hash(seeds, Purpose.PERMUTATION, right, r) & mask)
    return (left << half) | right


def _uniform_below(seeds: U64, n: U64) -> U64:
    # The group's shift s, exactly uniform on [0, n) (n <= 2^32): Lemire's multiply-shift of a
    # 64-bit counter hash, h·n = s·2^64 + low, rejecting low < 2^64 mod n and hashing again with
    # the next counter (Lemire 2019, "Fast random integer generation in an interval", alg. 5).
    out = np.empty(n.shape, dtype=np.uint64)
    todo = np.arange(n.size)
    threshold = (np.uint64(0) - n) % n  # 2^64 mod n
    for attempt in itertools.count():
        h = counter_hash(seeds[todo], Purpose.STRATUM_SHIFT, 0, attempt)
        low = h * n[todo]  # the product's low 64 bits (uint64 wraps)
        hi, lo = h >> np.uint64(32), h & _U32
        out[todo] = (hi * n[todo] + ((lo * n[todo]) >> np.uint64(32))) >> np.uint64(32)  # its high 64 bits
        todo = todo[low < threshold[todo]]  # probability below n / 2^64 per draw
        if todo.size == 0:
            return out
    raise AssertionError("unreachable")


class StratifiedDesign(GroupDesign):
    """Stratified codes c_i = (π(i) + V_i)/n: one member per stratum, in random order."""

    name = "stratified"
    carries = True
    extensible = False

    def start_codes(self, seeds: U64, ns: I64, members: I64) -> F64:
        seeds = np.asarray(seeds, dtype=np.uint64)
        ns = np.asarray(ns, dtype=np.int64)
        members = np.asarray(members, dtype=np.int64)
        strata = stratum_of_member(seeds, ns, members).astype(np.float64)
        jitter = counter_uniform(seeds, Purpose.JITTER, members, 0)
        return np.minimum((strata + jitter) / ns, np.nextafter(1.0, 0.0))


class SobolDesign(GroupDesign):
    """Token-level QMC: u_{i,t} = coordinate t of point i of a scrambled Sobol' net."""

    name = "sobol"
    carries = False
    wants_power_of_two = True

    def step_uniforms(self, seeds: U64, ns: I64, members: I64, steps: I64) -> F64:
        return scrambled_sobol_uniforms(seeds, members, steps)


class AntitheticDesign(GroupDesign):
    """Members 2j and 2j+1 use (u, 1 − u) at every step; an odd last member is plain."""

    name = "antithetic"
    carries = False

    def step_uniforms(self, seeds: U64, ns: I64, members: I64, steps: I64) -> F64:
        members = np.asarray(members, dtype=np.int64)
        u = counter_uniform(seeds, Purpose.FRESH, members // 2, steps)
        # 1 − u is exact on the odd-multiples-of-2^-53 grid (counter_rng docstring).
        return np.where(members % 2 == 1, 1.0 - u, u)


DESIGNS: dict[str, GroupDesign] = {
    d.name: d
    for d in (IIDDesign(), LatticeDesign(), StratifiedDesign(), ArithmeticDesign(), SobolDesign(), AntitheticDesign())
}
METHODS: tuple[str, ...] = tuple(DESIGNS)


def get_design(method: str) -> GroupDesign:
    """The design registered under ``method``.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`.
    """
    try:
        return DESIGNS[method]
    except (KeyError, TypeError):
        raise ValueError(f"method={method!r} is not a design; use one of {set(METHODS)}") from None
