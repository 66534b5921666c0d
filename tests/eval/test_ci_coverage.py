"""The quick form of ``benchmarks/ci_coverage.py``: qmc-eval's 95% intervals cover at their rate.

400 simulated evaluations of 48 problems (p ~ Beta(0.6, 1.4), one group of 32 per problem
and sampler, exact population values): the intervals for pass@1/4/16 of i.i.d. and lattice
groups, for the mean samples to the first correct member, and for the ratio lattice / i.i.d.
must each cover between 0.92 and 0.98 of the time (standard error 0.011 per figure: this
catches an interval that covers 0.92 or less). The figure the old intervals missed, lattice
pass@16, gets 3000 replications (standard error 0.004) and must cover 0.935–0.975: the plain
percentile bootstrap's 0.927 fails there, the BCa interval's 0.956 passes with 5 standard
errors to spare either side. Fixed seeds; the benchmark's 2000 replications of every figure
are in docs/evaluation.md.
"""

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).parents[2] / "benchmarks" / "ci_coverage.py"
_spec = importlib.util.spec_from_file_location("ci_coverage", _path)
ci_coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_coverage)


def test_the_intervals_cover_at_their_nominal_rate():
    coverage = ci_coverage.coverage(reps=400, problems=48, resamples=400, seed=1)
    assert set(coverage) == set(ci_coverage.truth())
    off = {name: c for name, c in coverage.items() if not 0.92 <= c <= 0.98}
    assert not off, f"coverage outside [0.92, 0.98]: {off}"


def test_lattice_pass_at_16_is_no_longer_under_covered():
    (covered,) = ci_coverage.coverage(reps=3000, problems=48, resamples=400, seed=2, only=("lattice pass@16",)).values()
    assert 0.935 <= covered <= 0.975, covered


def test_the_population_values_agree_with_quadrature():
    from scipy import integrate, stats

    truth = ci_coverage.truth()

    def expect(f):
        return integrate.quad(lambda p: f(p) * stats.beta.pdf(p, 0.6, 1.4), 0, 1, limit=200, points=[1 / 16])[0]

    for p in (0.01, 0.2, 0.3, 0.7):  # a prefix of 2^m radical-inverse members is a shifted lattice
        assert ci_coverage.arc_union(4, p) == pytest.approx(min(1.0, 4 * p))
    assert truth["lattice pass@16"] == pytest.approx(expect(lambda p: min(1.0, 16 * p)), abs=1e-7)
    assert truth["iid pass@4"] == pytest.approx(expect(lambda p: 1 - (1 - p) ** 4), abs=1e-7)
    assert ci_coverage.lattice_pass(5) == pytest.approx(expect(lambda p: ci_coverage.arc_union(5, p)), abs=1e-6)
