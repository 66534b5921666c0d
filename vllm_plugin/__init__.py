"""vLLM integration of qmc-sampler (``qmc_sampler.vllm_plugin``)."""
