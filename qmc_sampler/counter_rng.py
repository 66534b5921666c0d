"""Counter-based random numbers: every draw is a pure function of its coordinates.

The hash
--------
A draw is addressed by four unsigned 64-bit integers ``(seed, purpose, member, step)``
and computed by chaining the SplitMix64 finalizer (Steele, Lea & Flood, "Fast
splittable pseudorandom number generators", OOPSLA 2014)::

    h = mix(seed);  h = mix(h ^ purpose);  h = mix(h ^ member);  h = mix(h ^ step)

where ``mix(x)`` adds the golden-ratio increment and applies SplitMix64's two
multiply-xorshift rounds. ``mix`` is a bijection of 64-bit words, so distinct
coordinates never collide through one link of the chain and the output passes
BigCrush as a stream (the same construction vLLM and FlashInfer use with
murmur3/Philox: a keyed hash instead of generator state).

Uniforms use the top 52 bits ``k = h >> 12`` and map them to the odd multiples of
2^-53, ``u = (2k + 1)·2^-53``: the open interval (0, 1), exactly representable in
float64, symmetric under ``u ↦ 1 − u`` (used by the antithetic design).

Because nothing is stateful, a member's draws never depend on batch composition,
on which other members exist, on preemption or on the engine replica
(``../shared/design/qmc-math.md`` §2).
"""

from __future__ import annotations

import enum
import hashlib

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["Purpose", "counter_hash", "counter_seed", "counter_uniform", "keyed_seed", "seed_to_u64", "stable_seed"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_U64_MASK = (1 << 64) - 1
_TWO_POW_M53 = 2.0**-53


@enum.unique  # an alias would give two derivations one stream
class Purpose(enum.IntEnum):
    """What a draw is for; a separate stream per purpose keeps the streams independent."""

    FRESH = 1  # i.i.d. per-(member, step) uniforms: `iid`, and carry designs once alone
    SHIFT = 2  # the group's random shift Δ (lattice, arithmetic)
    PERMUTATION = 3  # stratified: round keys of the Feistel bijection behind the permutation π
    JITTER = 4  # stratified: the per-member offset V_i inside its stratum
    SOBOL_MATRIX = 5  # sobol: rows of the random lower-triangular scrambling matrix
    SOBOL_SHIFT = 6  # sobol: the random digital shift
    SOBOL_JITTER = 7  # sobol: the bits below the net's resolution
    ENGINE_GROUP_SEED = 8  # the vLLM plugin's engine: a group that came without a seed (engine seed, rank, counter)
    STRATUM_SHIFT = 9  # stratified: the shift s of the permutation π(i) = (σ(i) + s) mod n
    PROMPT_SEED = 10  # the seed of prompt i > 0 of a multi-prompt request, from the request's seed
    FRONT_END_SEED = 11  # the vLLM plugin's front end: a request without a seed (process salt, 0, counter)
    HF_CALL_SEED = 12  # transformers: one generate call's seed (user seed, process rank, call number)
    HF_GROUP_SEED = 13  # transformers: group g of one generate call (call seed, g, 0)


def seed_to_u64(seed: int) -> int:
    """Reduce a Python int seed (any sign, any size) to an unsigned 64-bit word."""
    return int(seed) & _U64_MASK


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    # SplitMix64 finalizer; uint64 arrays wrap modulo 2^64 silently, which is the point.
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _as_u64(values: ArrayLike) -> NDArray[np.uint64]:
    arr = np.asarray(values)
    if arr.dtype == np.uint64:
        return np.atleast_1d(arr)
    if arr.dtype == object:
        return np.atleast_1d(np.array([seed_to_u64(v) for v in arr.ravel()], dtype=np.uint64).reshape(arr.shape))
    # Negative int64 values wrap to their two's-complement word, like seed_to_u64.
    return np.atleast_1d(arr.astype(np.int64).view(np.uint64))


def counter_hash(seed: ArrayLike, purpose: int, member: ArrayLike, step: ArrayLike) -> NDArray[np.uint64]:
    """Hash ``(seed, purpose, member, step)`` to a 64-bit word (see the module docstring).

    Args:
        seed: group seed(s), int or array; broadcast against ``member`` and ``step``.
        purpose: a :class:`Purpose` value.
        member: member index (or any per-draw counter), int or int array.
        step: step index (or a second counter), int or int array.

    Returns:
        ``uint64`` array of the broadcast shape (at least 1-D).
    """
    s, m, t = np.broadcast_arrays(_as_u64(seed), _as_u64(member), _as_u64(step))
    h = _mix(s)
    h = _mix(h ^ np.uint64(purpose))
    h = _mix(h ^ m)
    return _mix(h ^ t)


def counter_uniform(seed: ArrayLike, purpose: int, member: ArrayLike, step: ArrayLike) -> NDArray[np.float64]:
    """Uniform draws on the open interval (0, 1), addressed like :func:`counter_hash`.

    Returns:
        ``float64`` array ``(2·(h >> 12) + 1)·2^-53``: exactly uniform on the 2^52 odd
        multiples of 2^-53.
    """
    k = counter_hash(seed, purpose, member, step) >> np.uint64(12)
    return (k.astype(np.float64) * 2.0 + 1.0) * _TWO_POW_M53


def counter_seed(seed: int, purpose: int, member: int, step: int) -> int:
    """A derived seed (a non-negative 63-bit int: fits int64 and ``GroupSpec``), addressed like
    :func:`counter_hash`: the hash's top 63 bits. Used wherever a group seed is derived from
    another seed and a counter (fresh groups, per-prompt groups), so no two derivations can be
    written differently."""
    return int(counter_hash(seed, purpose, member, step)[0] >> np.uint64(1))


def stable_seed(*parts: object) -> int:
    """A 63-bit seed keyed by a tuple of values (strings, ints, tuples of them), the same in every
    process and on every machine: :func:`keyed_seed` of their ``repr``. The seeds derived from
    names rather than counters (auto groups by prompt, explicit groups by id) come from here; the
    first part names the derivation, so no two derivations share a seed by accident."""
    return keyed_seed(repr(parts))


def keyed_seed(key: str) -> int:
    """A 63-bit seed keyed by a string: the top 63 bits of the 8-byte BLAKE2b digest of its UTF-8
    bytes (little-endian). :func:`stable_seed` and qmc-eval's group seeds (``run seed|task|problem|
    group``, kept as written so that runs resume with the seeds they started with) use it."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
