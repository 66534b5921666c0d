"""Generation backends: how a group's members become completions, wherever the engine runs.

:mod:`~qmc_sampler.eval.backends.generation` is the contract every backend meets (:class:`GroupJob` in,
:class:`Completion` out, each member its own request named by its index) and the in-process vLLM one;
:mod:`~.endpoints` sends the members to OpenAI-compatible servers; :mod:`~.ray_backend` (with
:mod:`~.ray_plan` for placement and :mod:`~.ray_rows` for Ray Data's rows) runs them on a Ray cluster;
:mod:`~.ray_recipe` and :mod:`~.ray_serve_recipe` are the docs' Ray Data and Ray Serve recipes.

May import: this room, the core (``qmc_sampler``), ``qmc_sampler.vllm_engine``, vLLM, Ray and HTTP
clients — no task, run, report or statistic: a backend moves text and knows nothing of scoring.
"""
