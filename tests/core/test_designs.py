"""The design contract, run against every design; then each design's own structure."""

import tracemalloc
import warnings

import numpy as np
import pytest
from scipy import stats

from qmc_sampler import METHODS, GroupSpec, get_design, radical_inverse
from qmc_sampler.designs import MAX_GROUP_SIZE, stratum_of_member

# Marginal uniformity: one KS test per (design, n, member) below; Bonferroni over all.
SIZES = (1, 3, 8)
N_KS = len(METHODS) * sum(SIZES)
ALPHA = 1e-3 / N_KS
SEEDS = np.arange(20_000, dtype=np.uint64) * np.uint64(7919) + np.uint64(5)


def first_uniforms(method: str, n: int, member: int, step: int = 0) -> np.ndarray:
    design = get_design(method)
    r = len(SEEDS)
    ns = np.full(r, n, dtype=np.int64)
    members = np.full(r, member, dtype=np.int64)
    if design.carries:
        return design.start_codes(SEEDS, ns, members)
    return design.step_uniforms(SEEDS, ns, members, np.full(r, step, dtype=np.int64))


@pytest.mark.parametrize("method", METHODS)
class TestDesignContract:
    """What every design promises (scipy ``_qmc`` style: one contract, all engines)."""

    @pytest.mark.parametrize("n", SIZES)
    def test_each_member_is_uniform_over_group_seeds(self, method: str, n: int) -> None:
        for member in range(n):
            u = first_uniforms(method, n, member)
            assert u.min() >= 0.0 and u.max() < 1.0
            assert stats.kstest(u, "uniform").pvalue > ALPHA, (method, n, member)

    def test_is_deterministic(self, method: str) -> None:
        np.testing.assert_array_equal(first_uniforms(method, 4, 1), first_uniforms(method, 4, 1))

    def test_members_of_a_group_differ(self, method: str) -> None:
        if method == "antithetic":
            a, b = first_uniforms(method, 4, 0), first_uniforms(method, 4, 1)
            np.testing.assert_array_equal(a + b, 1.0)
            return
        a, b = first_uniforms(method, 4, 0), first_uniforms(method, 4, 1)
        assert not np.any(a == b)

    def test_group_spec_accepts_n_1_and_non_powers_of_two(self, method: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for n in (1, 5, 12):
                assert GroupSpec(method, n, 0).n == n


def test_lattice_codes_are_a_shifted_lattice() -> None:
    for n in (1, 2, 5, 8, 16, 12):
        codes = get_design("lattice").start_codes(np.full(n, 99, np.uint64), np.full(n, n), np.arange(n))
        gaps = np.diff(np.sort(codes))
        np.testing.assert_allclose(gaps, 1.0 / n, atol=1e-12)


def test_lattice_aligned_power_of_two_blocks_are_lattices() -> None:
    n = 32
    codes = get_design("lattice").start_codes(np.full(n, 5, np.uint64), np.full(n, n), np.arange(n))
    for k in (1, 2, 4, 8, 16):
        for b in range(n // k):
            block = np.sort(codes[b * k : (b + 1) * k])
            np.testing.assert_allclose(np.diff(block), 1.0 / k, atol=1e-12)


def test_lattice_first_members_of_a_bigger_group_are_the_smaller_group() -> None:
    small = get_design("lattice").start_codes(np.full(4, 3, np.uint64), np.full(4, 4), np.arange(4))
    big = get_design("lattice").start_codes(np.full(4, 3, np.uint64), np.full(4, 16), np.arange(4))
    np.testing.assert_array_equal(small, big)


def test_radical_inverse_values() -> None:
    np.testing.assert_array_equal(radical_inverse(np.arange(8)), [0, 0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875])


def test_stratified_puts_one_member_in_each_stratum() -> None:
    for n in (1, 3, 10):
        codes = get_design("stratified").start_codes(np.full(n, 8, np.uint64), np.full(n, n), np.arange(n))
        np.testing.assert_array_equal(np.sort(np.floor(codes * n)), np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4099])
def test_the_stratum_permutation_is_a_bijection(n: int) -> None:
    for seed in (0, 8, 2**64 - 1):
        strata = stratum_of_member(np.full(n, seed, np.uint64), np.full(n, n), np.arange(n))
        np.testing.assert_array_equal(np.sort(strata), np.arange(n))


def test_a_members_stratum_is_uniform_over_seeds() -> None:
    # Exactness of the stratified code needs π(i) ~ U{0..n-1} for each member i on its own.
    # χ² over 20,000 seeds for 3 (n, member) cells; Bonferroni α = 0.001 / 3.
    seeds = np.arange(20_000, dtype=np.uint64)
    for n, member in ((5, 0), (7, 6), (12, 3)):
        strata = stratum_of_member(seeds, np.full(seeds.size, n), np.full(seeds.size, member))
        counts = np.bincount(strata, minlength=n)
        assert stats.chisquare(counts).pvalue > 0.001 / 3, (n, member, counts)


def test_the_stratum_of_a_member_of_a_huge_group_is_computed_alone() -> None:
    # A client's group size must not make a decoding step allocate in proportion to it
    # (the old rank-of-n-hashes permutation held 8·n bytes per seed).
    tracemalloc.start()
    try:
        codes = get_design("stratified").start_codes(
            np.full(3, 3, np.uint64), np.full(3, MAX_GROUP_SIZE), np.array([0, 1, MAX_GROUP_SIZE - 1])
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert np.all((codes >= 0) & (codes < 1))
    assert len(set(np.floor(codes * MAX_GROUP_SIZE))) == 3


def test_arithmetic_codes_are_spaced_one_over_n_plus_one() -> None:
    n = 6
    codes = get_design("arithmetic").start_codes(np.full(n, 2, np.uint64), np.full(n, n), np.arange(n))
    np.testing.assert_allclose(np.diff(np.sort(codes)), 1.0 / (n + 1), atol=1e-12)


def test_sobol_coordinates_are_balanced_at_every_step() -> None:
    n = 16
    design = get_design("sobol")
    for step in (0, 1, 7, 500, 21200):
        u = design.step_uniforms(np.full(n, 4, np.uint64), np.full(n, n), np.arange(n), np.full(n, step))
        np.testing.assert_array_equal(np.sort(np.floor(u * n)), np.arange(n))


def test_sobol_with_n_not_a_power_of_two_warns() -> None:
    with pytest.warns(UserWarning, match="power of two"):
        GroupSpec("sobol", 6, 0)


def test_unknown_method_names_the_allowed_designs() -> None:
    with pytest.raises(ValueError, match=r"method='lattic' is not a design; use one of .*'lattice'"):
        get_design("lattic")


@pytest.mark.parametrize(("n", "member"), [(8, 8), (3, -1), (1, 1), (0, 0), (2**32 + 1, 0)])
def test_a_stratum_outside_the_group_is_refused_not_searched_forever(n, member):
    # The cycle walk only returns to [0, n) from a member in it.
    with pytest.raises(ValueError, match=r"needs 1 <= n <= 4294967296 and 0 <= member < n"):
        stratum_of_member(np.array([1], np.uint64), np.array([n]), np.array([member]))
