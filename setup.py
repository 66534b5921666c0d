"""qmc-sampler: correlated, exact parallel sampling for LLMs.

Everything installs under one import namespace, ``qmc_sampler``: the top-level
folders ``vllm_plugin/``, ``server/`` and ``eval/`` become ``qmc_sampler.vllm_plugin``,
``qmc_sampler.server`` and ``qmc_sampler.eval`` through ``package_dir``.
"""

from setuptools import setup

SUBPACKAGES = {"vllm_plugin": "vllm_plugin", "server": "server", "eval": "eval"}

setup(
    packages=["qmc_sampler", *(f"qmc_sampler.{name}" for name in SUBPACKAGES)],
    package_dir={"qmc_sampler": "qmc_sampler", **{f"qmc_sampler.{k}": v for k, v in SUBPACKAGES.items()}},
)
