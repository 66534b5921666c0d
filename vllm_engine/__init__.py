"""vLLM as the doors that drive it meet it (``qmc_sampler.vllm_engine``): what the plugin, qmc-serve
and qmc-eval share of vLLM, kept out of any one of them.

:mod:`.compat` is the table of every vLLM object the package touches (where each release keeps
it, the parameters a wrapped function must have) and the check of that table against a release's
sources: the plugin (``qmc_sampler.vllm_plugin``: its hooks and logprobs) and ``qmc-serve``
(``qmc_sampler.server``) find vLLM's objects through it. :mod:`.checks` asks a running engine,
through vLLM's own API, whether its front-end and every worker run the plugin: ``qmc-serve`` and
``qmc-eval``'s in-process engine (``qmc_sampler.eval``) ask before they serve or sample, qmc-serve's
stats route reads every worker's plugin stats through it, and qmc-eval's endpoint check sends its
probe design to a served model. Neither module imports a door, nor vLLM until a function is called.
"""
