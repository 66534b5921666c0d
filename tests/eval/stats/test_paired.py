"""Paired statistics: the exact sign-flip p-value against counts of sign patterns worked out by hand, and
the percentile bootstrap of the mean against resampled means whose distribution is known exactly, the
inverted sign-flip interval against its test and its coverage."""

import numpy as np
import pytest
from qmc_sampler.eval.stats.paired import SIGN_FLIP_MOST, bootstrap_mean_interval, sign_flip_interval, sign_flip_p


def test_the_sign_flip_p_value_is_exact_over_all_sign_patterns():
    assert sign_flip_p(np.array([0.1, 0.2, 0.3])) == 0.25  # of 8 patterns, the two extreme ones
    assert sign_flip_p(np.array([0.1, 0.2, 0.3, 0.05])) == 0.125
    assert sign_flip_p(np.array([0.3, 0.1, -0.1])) == 0.75  # ±0.3±0.1±0.1: 6 of 8 as far from 0 (rounding too)
    assert sign_flip_p(np.array([0.1, -0.1])) == 1.0 == sign_flip_p(np.zeros(3))
    assert sign_flip_p(np.ones(21)) is None


def test_all_positive_differences_give_the_least_p_value_two_in_two_to_the_n():
    assert sign_flip_p([0.5, 1.0, 2.0]) == 0.25  # a list is taken as an array
    assert sign_flip_p(np.arange(1.0, 11.0)) == 2 / 1024  # 10 differences: only the observed signs and their mirror
    assert sign_flip_p(np.ones(SIGN_FLIP_MOST)) == 2 / 2**SIGN_FLIP_MOST  # the most it lists


def test_a_negative_difference_counts_where_flipping_it_keeps_the_mean_as_far_from_zero():
    # ±1 ±2 ±3 ±0.5 against |1 + 2 + 3 − 0.5| = 5.5: +1+2+3±0.5 (6.5, 5.5) and their mirrors, 4 of 16
    assert sign_flip_p([1.0, 2.0, 3.0, -0.5]) == 0.25
    # ±1 ±1 ±1 against |1 + 1 − 1| = 1: every pattern's |sum| is 1 or 3, so all 8
    assert sign_flip_p([1.0, 1.0, -1.0]) == 1.0
    # ±3 ±1 against |3 − 1| = 2: ±(3 + 1) and ±(3 − 1), all 4; ±2 ±1 ±1 against 2: all but ±(2 − 1 − 1), 6 of 8
    assert sign_flip_p([3.0, -1.0]) == 1.0 and sign_flip_p([2.0, -1.0, 1.0]) == 0.75


def test_the_sign_flip_p_value_is_two_sided():
    diffs = np.array([0.2, 0.4, -0.1, 0.3])
    assert sign_flip_p(diffs) == sign_flip_p(-diffs) == 0.25  # ±0.2 ±0.4 ±0.1 ±0.3 against 0.8: 4 of 16


def test_no_differences_is_an_error_not_a_p_value():
    with pytest.raises(ValueError, match="at least one difference"):
        sign_flip_p([])


def test_the_bootstrap_interval_of_zero_and_one_is_the_quantiles_of_a_quarter_half_quarter_mean():
    # resampled means of {0, 1}, two draws with replacement: 0, ½, 1 with probability ¼, ½, ¼ (a share of
    # 10 000 draws within 1.3% of those at 3 standard deviations), so the 2.5% and 97.5% quantiles are 0
    # and 1, and the 30% and 70% quantiles (level 0.4) are both ½
    assert bootstrap_mean_interval([0.0, 1.0], np.random.default_rng(0)) == (0.0, 1.0)
    assert bootstrap_mean_interval([0.0, 1.0], np.random.default_rng(0), level=0.4) == (0.5, 0.5)


def test_with_three_differences_the_interval_is_their_range():
    # each extreme resample (all three the smallest: (2/3)^3, all three the largest: 1/27) is over 2.5% likely:
    # the figures of docs/performance.md's GRPO run, +0.016 and +0.141, are exactly its least and greatest difference
    diffs = [1 / 64, 1 / 64, 9 / 64]
    assert bootstrap_mean_interval(diffs, np.random.default_rng(0)) == (1 / 64, 9 / 64)


def test_the_bootstrap_resamples_with_replacement_within_the_range_of_the_differences():
    diffs = np.array([-0.3, 0.1, 0.2, 0.4, 0.9])
    low, high = bootstrap_mean_interval(diffs, np.random.default_rng(1), resamples=2000)
    # with replacement the resampled mean has standard deviation 0.393 / √5 = 0.176 about 0.26 (without, it is 0.26
    # every time): about 0.26 ± 1.96 · 0.176, well inside [min, max]
    assert diffs.min() < low < diffs.mean() - 0.2 and diffs.mean() + 0.2 < high < diffs.max()
    assert bootstrap_mean_interval(np.full(4, 0.25), np.random.default_rng(1)) == (0.25, 0.25)


def test_the_bootstrap_draws_from_the_generator_it_is_given():
    diffs = np.array([0.0, 0.1, 0.5, 0.7, 1.3, 2.2])
    rng = np.random.default_rng(3)
    first, second = bootstrap_mean_interval(diffs, rng), bootstrap_mean_interval(diffs, rng)
    assert first == bootstrap_mean_interval(diffs, np.random.default_rng(3)) and second != first  # one stream
    assert bootstrap_mean_interval(diffs, np.random.default_rng(3), resamples=10) != first


def test_fewer_than_two_differences_have_no_interval():
    assert bootstrap_mean_interval([0.5], np.random.default_rng(0)) is None
    assert bootstrap_mean_interval([], np.random.default_rng(0)) is None


def test_the_sign_flip_interval_ends_where_the_test_starts_to_reject():
    d = np.array([0.12, -0.03, 0.08, 0.15, 0.02, 0.09, -0.01, 0.11, 0.05, 0.07])
    low, high = sign_flip_interval(d, level=0.95)
    assert low < d.mean() < high
    assert sign_flip_p(d - low) > 0.05 >= sign_flip_p(d - (low - 1e-6))
    assert sign_flip_p(d - high) > 0.05 >= sign_flip_p(d - (high + 1e-6))
    wider = sign_flip_interval(d, level=0.99)
    assert wider[0] < low and high < wider[1]


def test_the_sign_flip_interval_covers_the_mean_at_its_level():
    """300 samples of 10 normal differences (mean 0.3, SD 1): the 95% interval holds 0.3 in at least
    91.5% of them (its coverage is ≥ 95% for symmetric differences; 91.5% is 2.8 binomial SEs below,
    one-sided α ≈ 0.003) and at most 99% (an interval that never missed would not be at its level)."""
    rng = np.random.default_rng(11)
    hits = [lo <= 0.3 <= hi for lo, hi in (sign_flip_interval(rng.normal(0.3, 1.0, 10)) for _ in range(300))]
    assert 0.915 <= np.mean(hits) <= 0.99, np.mean(hits)


def test_the_sign_flip_interval_is_unbounded_where_the_test_cannot_reject_and_none_without_two_differences():
    assert sign_flip_interval([0.1, 0.2, 0.3, 0.4, 0.5]) == (-np.inf, np.inf)  # least p 2/32 > 0.05
    assert np.isfinite(sign_flip_interval([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])).all()  # least p 2/64 < 0.05
    assert sign_flip_interval([0.1]) is None and sign_flip_interval(np.ones(SIGN_FLIP_MOST + 1)) is None
    with pytest.raises(ValueError, match="level"):
        sign_flip_interval([0.1, 0.2], level=1.0)


def test_where_the_least_p_value_equals_alpha_the_test_rejects_and_the_interval_is_bounded():
    """5 differences, α = 2/32: all of one sign gives p = 2/32 ≤ α, so far shifts are rejected."""
    low, high = sign_flip_interval([0.1, 0.2, 0.3, 0.4, 0.5], level=1 - 2 / 32)
    assert np.isfinite([low, high]).all() and low < 0.3 < high


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_difference_that_is_not_finite_is_an_error_not_a_p_value(bad):
    for function in (sign_flip_p, sign_flip_interval, lambda d: bootstrap_mean_interval(d, np.random.default_rng(0))):
        with pytest.raises(ValueError, match="finite"):
            function([0.1, bad, 0.2])
