"""Reports: what a run's samples say, as tables, JSON and plots.

:mod:`~qmc_sampler.eval.reports.passk_report` gives pass@k per sampler with its intervals and samples
saved (``qmc-eval score``); :mod:`~.until_report` the samples spent to ``want`` correct
(``--until-correct`` runs).

May import: this room, :mod:`qmc_sampler.eval.stats` for every figure, :mod:`qmc_sampler.eval.runs` for
the samples they read, and the core — no backend or engine: a report is made from files alone.
"""
