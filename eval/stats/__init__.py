"""The statistics of pass@k evaluation: pure numpy/scipy, no I/O, no engine.

:mod:`~qmc_sampler.eval.stats.passk` holds the estimators (unbiased pass@k of i.i.d. and designed
groups, the union bound, samples saved) and their intervals (bounded-mean bootstrap, exact binomial,
the ratio's inverted test, the median's order-statistic interval); :mod:`~qmc_sampler.eval.stats.paired`
the paired comparisons over a few units (the exact sign-flip test, a percentile bootstrap of the mean).

May import: the standard library, numpy and scipy only — nothing else of ``qmc_sampler``, so every
other room (reports, benchmarks) can take its figures from here.
"""
