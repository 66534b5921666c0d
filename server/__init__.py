"""OpenAI-compatible server of qmc-sampler (``qmc_sampler.server``)."""
