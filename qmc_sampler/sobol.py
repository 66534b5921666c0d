"""Scrambled Sobol' coordinates, one dimension per decoding step.

Direction numbers come from the table scipy ships
(``scipy/stats/_sobol_direction_numbers.npz``: Joe & Kuo's new-joe-kuo-6.21201
primitive polynomials and initial values, 21201 dimensions), expanded with the
standard recurrence (Bratley & Fox 1988, Algorithm 659; Joe & Kuo 2008, §2) to
``BITS = 32`` bits. Points are taken in Gray-code order, as scipy's generator
emits them, so unscrambled points equal ``scipy.stats.qmc.Sobol(scramble=False)``.

Randomization (``../shared/design/qmc-math.md`` §2, ``sobol``): a linear matrix
scramble (LMS: a random lower-triangular binary matrix with unit diagonal) and a
random digital shift per dimension (Matoušek 1998; Owen 2003, §3), plus uniform
bits below the 2^-32 resolution. Every random bit comes from the counter hash of
(group seed, purpose, dimension, row), so the scramble is the same for every
member of a group and a member's coordinate is uniform on [0, 1). The LMS and the
shift keep the net's (t, m, s) structure: every aligned block of 2^m points
(in particular the first 2^m) stays balanced.

Beyond the table (step ≥ 21201) coordinates are i.i.d. fresh uniforms: exactness
holds either way, and no group shares a prefix that long.
"""

from __future__ import annotations

import functools
import importlib.resources

import numpy as np
from numpy.typing import NDArray

from qmc_sampler.counter_rng import Purpose, counter_hash, counter_uniform

__all__ = ["BITS", "MAX_DIMENSION", "direction_numbers", "scrambled_sobol_uniforms", "sobol_coordinates"]

BITS = 32
MAX_DIMENSION = 21201


@functools.lru_cache(maxsize=1)
def direction_numbers() -> NDArray[np.uint64]:
    """Direction numbers ``v[d, k]`` (integers scaled by 2^BITS), ``[21201, 32] uint64``.

    ``v[d, k]`` is the k-th direction number of dimension d (k = 0 is the most
    significant, 2^31·m_1). Derived from scipy's shipped table with the same
    recurrence as scipy's ``_initialize_v``.
    """
    table = importlib.resources.files("scipy.stats").joinpath("_sobol_direction_numbers.npz")
    with importlib.resources.as_file(table) as path, np.load(path) as data:
        poly = data["poly"].astype(np.int64)
        vinit = data["vinit"].astype(np.int64)
    dims = poly.shape[0]
    m = np.zeros((dims, BITS), dtype=np.int64)
    m[0, :] = 1
    degree = np.floor(np.log2(np.maximum(poly, 1))).astype(np.int64)
    for d in range(1, dims):  # vectorising over d buys little: 21201 × 32 small ints, once
        s = int(degree[d])
        p = int(poly[d])
        row = m[d]
        row[:s] = vinit[d, :s]
        for j in range(s, BITS):
            new = row[j - s]
            pow2 = 1
            for k in range(s):
                pow2 <<= 1
                if (p >> (s - 1 - k)) & 1:
                    new ^= pow2 * row[j - k - 1]
            row[j] = new
    shifts = np.arange(BITS - 1, -1, -1, dtype=np.int64)  # m_k · 2^(BITS-1-k)
    return (m << shifts).astype(np.uint64)


def sobol_coordinates(points: NDArray[np.int64], dimensions: NDArray[np.int64]) -> NDArray[np.uint64]:
    """Unscrambled Sobol' coordinates as BITS-bit integers (value = result / 2^BITS).

    Args:
        points: point indices (Gray-code order, as scipy), int array.
        dimensions: dimension per point, ``0 ≤ d < MAX_DIMENSION``, same shape.

    Returns:
        ``uint64`` array of the same shape.
    """
    v = direction_numbers()
    points = np.asarray(points, dtype=np.uint64)
    gray = points ^ (points >> np.uint64(1))
    x = np.zeros(points.shape, dtype=np.uint64)
    rows = v[np.asarray(dimensions, dtype=np.int64)]
    for k in range(BITS):
        bit = ((gray >> np.uint64(k)) & np.uint64(1)).astype(bool)
        x ^= np.where(bit, rows[..., k], np.uint64(0))
    return x


def scrambled_sobol_uniforms(
    seeds: NDArray[np.uint64], points: NDArray[np.int64], dimensions: NDArray[np.int64]
) -> NDArray[np.float64]:
    """Coordinate ``dimensions`` of point ``points`` of each group's scrambled net.

    Args:
        seeds: group seed per draw, ``uint64`` array.
        points: member index per draw.
        dimensions: decoding step per draw (one dimension per step).

    Returns:
        ``float64`` uniforms in (0, 1), on the same grid as
        :func:`qmc_sampler.counter_rng.counter_uniform`.
    """
    seeds, points, dimensions = np.broadcast_arrays(
        np.asarray(seeds, dtype=np.uint64), np.asarray(points, dtype=np.int64), np.asarray(dimensions, dtype=np.int64)
    )
    out = counter_uniform(seeds, Purpose.FRESH, points, dimensions).reshape(seeds.shape)
    inside = dimensions < MAX_DIMENSION
    if not inside.any():
        return out
    s, i, d = seeds[inside], points[inside], dimensions[inside]
    x = sobol_coordinates(i, d)
    # LMS: output digit r (r = 0 most significant) is the parity of x masked by row r,
    # which has digit r set and random digits only above it (lower-triangular).
    y = np.zeros_like(x)
    for r in range(BITS):
        bit = np.uint64(1 << (BITS - 1 - r))
        above = np.uint64(((1 << BITS) - 1) ^ ((1 << (BITS - r)) - 1))
        row = (counter_hash(s, Purpose.SOBOL_MATRIX, d, r) & above) | bit
        parity = np.bitwise_count(row & x) & np.uint8(1)
        y |= np.where(parity.astype(bool), bit, np.uint64(0))
    y ^= counter_hash(s, Purpose.SOBOL_SHIFT, d, 0) & np.uint64((1 << BITS) - 1)
    # 32 net bits, then 20 uniform bits, on the odd multiples of 2^-53.
    low = counter_hash(s, Purpose.SOBOL_JITTER, i, d) >> np.uint64(64 - (52 - BITS))
    k = (y << np.uint64(52 - BITS)) | low
    out[inside] = (k.astype(np.float64) * 2.0 + 1.0) * 2.0**-53
    return out
