"""Counter-based uniforms: pure functions of (seed, purpose, member, step), uniform on (0, 1)."""

import numpy as np
from scipy import stats

from qmc_sampler import Purpose, counter_hash, counter_uniform
from qmc_sampler.counter_rng import counter_seed, keyed_seed, stable_seed

ALPHA = 1e-3 / 2  # two KS tests in this file, Bonferroni


def test_same_coordinates_give_the_same_draw_in_any_batch() -> None:
    one_by_one = [counter_uniform(7, Purpose.FRESH, m, t)[0] for m in range(5) for t in range(5)]
    batched = counter_uniform(7, Purpose.FRESH, np.repeat(np.arange(5), 5), np.tile(np.arange(5), 5))
    np.testing.assert_array_equal(one_by_one, batched)


def test_every_coordinate_changes_the_draw() -> None:
    base = counter_hash(1, Purpose.FRESH, 2, 3)
    assert base != counter_hash(2, Purpose.FRESH, 2, 3)
    assert base != counter_hash(1, Purpose.SHIFT, 2, 3)
    assert base != counter_hash(1, Purpose.FRESH, 3, 3)
    assert base != counter_hash(1, Purpose.FRESH, 2, 4)
    assert counter_hash(1, Purpose.FRESH, 2, 3) != counter_hash(1, Purpose.FRESH, 3, 2)


def test_any_python_int_is_a_seed() -> None:
    for seed in (0, -1, 2**63, 2**64 + 5, -(2**70)):
        u = counter_uniform(seed, Purpose.FRESH, 0, 0)
        assert 0.0 < u[0] < 1.0
    assert counter_uniform(-1, Purpose.FRESH, 0, 0) == counter_uniform(2**64 - 1, Purpose.FRESH, 0, 0)


def test_uniforms_lie_in_the_open_interval_on_the_odd_grid() -> None:
    u = counter_uniform(3, Purpose.FRESH, np.arange(100_000), 0)
    assert u.min() > 0.0 and u.max() < 1.0
    scaled = u * 2.0**53
    np.testing.assert_array_equal(scaled % 2, 1.0)
    np.testing.assert_array_equal(1.0 - (1.0 - u), u)


def test_uniforms_are_uniform_across_members_and_across_steps() -> None:
    across_members = counter_uniform(11, Purpose.FRESH, np.arange(50_000), 0)
    across_steps = counter_uniform(11, Purpose.FRESH, 0, np.arange(50_000))
    assert stats.kstest(across_members, "uniform").pvalue > ALPHA
    assert stats.kstest(across_steps, "uniform").pvalue > ALPHA


def test_every_purpose_is_a_stream_of_its_own():
    # An IntEnum member given another's value becomes its alias: two derivations would share a stream.
    assert len(Purpose.__members__) == len(set(Purpose)) == len({int(p) for p in Purpose})


def test_derived_seeds_are_the_hashes_top_63_bits():
    seeds = [counter_seed(7, Purpose.ENGINE_GROUP_SEED, member, 3) for member in range(100)]
    assert all(0 <= s < 2**63 for s in seeds) and len(set(seeds)) == 100
    assert seeds[5] == int(counter_hash(7, Purpose.ENGINE_GROUP_SEED, 5, 3)[0]) >> 1


def test_keyed_seeds_are_blake2b_of_the_key_and_stable_seeds_key_by_repr():
    assert keyed_seed("0|basic_arithmetic|1|0") == 2954819457369714347  # a committed qmc-eval group's seed
    assert stable_seed("auto", 5, (1, 2)) == keyed_seed(repr(("auto", 5, (1, 2))))
    assert stable_seed("auto", 5) != stable_seed("dp", 5) and 0 <= stable_seed("x") < 2**63
