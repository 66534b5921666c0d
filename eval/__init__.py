"""pass@k evaluation of qmc-sampler (``qmc_sampler.eval``)."""
