"""pass@k evaluation of qmc-sampler (``qmc_sampler.eval``).

:func:`pass_at_k` is the estimator for one problem's groups; :func:`sample_until`
samples each prompt in rounds until its members are verified
(:mod:`qmc_sampler.eval.sequential`); the CLI is ``qmc-eval`` (:mod:`qmc_sampler.eval.cli`).
"""

from qmc_sampler.eval.passk import pass_at_k, union_bound
from qmc_sampler.eval.sequential import sample_until

__all__ = ["pass_at_k", "sample_until", "union_bound"]
