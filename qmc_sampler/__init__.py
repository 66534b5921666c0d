"""qmc-sampler: correlated, exact parallel sampling for LLMs.

The core is engine-agnostic and pure torch/numpy:

* :data:`METHODS` / :func:`get_design` — group designs (``iid``, ``lattice``,
  ``stratified``, ``arithmetic``, ``sobol``, ``antithetic``);
* :func:`counter_uniform` — counter-based uniforms of (seed, purpose, member, step);
* :func:`process_logits` — temperature / min-p / top-k / top-p, vLLM semantics;
* :func:`inverse_cdf` — batched inverse-CDF choice with interval start and width;
* :class:`GroupSpec`, :class:`MemberState`, :func:`sample_members` — groups
  (of a given size, or :data:`EXTENSIBLE`), members and the residual carry;
* :func:`sample_group` — the reference loop for one group.

The math is in ``../shared/design/qmc-math.md`` (QuasiMoTTo, 2026).
"""

from qmc_sampler.counter_rng import Purpose, counter_hash, counter_uniform
from qmc_sampler.designs import METHODS, GroupDesign, get_design, radical_inverse
from qmc_sampler.group import EXTENSIBLE, PRECISION_FLOOR, GroupSpec, MemberState, sample_members
from qmc_sampler.inverse_cdf import ORDERS, Draw, inverse_cdf
from qmc_sampler.processing import SAMPLING_EPS, process_logits
from qmc_sampler.reference import sample_group, validate_sampling

__version__ = "0.2.0"
#: The distribution's name on the package registries (the import package is ``qmc_sampler``; the
#: registry's ``qmc-sampler`` is another project, which installs a top-level ``qmc_sampler`` too).
DISTRIBUTION = "qmc-llm-sampler"

__all__ = [
    "DISTRIBUTION",
    "EXTENSIBLE",
    "METHODS",
    "ORDERS",
    "PRECISION_FLOOR",
    "SAMPLING_EPS",
    "Draw",
    "GroupDesign",
    "GroupSpec",
    "MemberState",
    "Purpose",
    "counter_hash",
    "counter_uniform",
    "get_design",
    "inverse_cdf",
    "process_logits",
    "radical_inverse",
    "sample_group",
    "sample_members",
    "validate_sampling",
]
