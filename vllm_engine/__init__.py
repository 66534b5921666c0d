"""vLLM as every door that drives it meets it (``qmc_sampler.vllm_engine``), apart from the plugin.

:mod:`.compat` is the table of every vLLM object the package touches (where each release keeps
it, the parameters a wrapped function must have) and the check of that table against a release's
sources; :mod:`.checks` asks a running engine, through vLLM's own API, whether its front-end and
every worker run the plugin. The plugin (``qmc_sampler.vllm_plugin``), ``qmc-serve``
(``qmc_sampler.server``) and ``qmc-eval``'s in-process engine (``qmc_sampler.eval``) use both; neither
module imports any of them, nor vLLM until a function is called.
"""
