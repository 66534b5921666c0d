"""pass@k evaluation of qmc-sampler (``qmc_sampler.eval``).

:func:`pass_at_k` is the estimator for one problem's groups; the CLI is
``qmc-eval`` (:mod:`qmc_sampler.eval.cli`).
"""

from qmc_sampler.eval.passk import pass_at_k, union_bound

__all__ = ["pass_at_k", "union_bound"]
