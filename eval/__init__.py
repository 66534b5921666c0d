"""pass@k evaluation of qmc-sampler (``qmc_sampler.eval``): ``qmc-eval`` and ``make run``.

The rooms, in the order they may import one another (``tests/test_layout.py`` checks it):

* :mod:`~qmc_sampler.eval.stats` — estimators and intervals; imports nothing else of the package;
* :mod:`~qmc_sampler.eval.tasks` — tasks, prompts, verifiers, the sandbox;
* :mod:`~qmc_sampler.eval.backends` — generation in-process, on endpoints, on Ray;
* :mod:`~qmc_sampler.eval.runs` — samples files, ``qmc-eval run`` and sampling until correct
  (backends, tasks);
* :mod:`~qmc_sampler.eval.reports` — tables and plots from samples (stats, runs);
* this folder's own modules — the CLI (:mod:`~qmc_sampler.eval.cli`), its console and the main job —
  may import every room.

The names a user imports are re-exported here: :func:`pass_at_k`, the estimator for one problem's
groups, :func:`union_bound`, and :func:`sample_until`, which samples each prompt in rounds until its
members are verified; tasks are :func:`qmc_sampler.eval.tasks.get_task`.
"""

from qmc_sampler.eval.runs.sequential import sample_until
from qmc_sampler.eval.stats.passk import pass_at_k, union_bound

__all__ = ["pass_at_k", "sample_until", "union_bound"]
