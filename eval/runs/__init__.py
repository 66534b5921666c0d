"""Runs: sampling a task's problems in groups through a backend and writing every sample down.

:mod:`~qmc_sampler.eval.runs.samples` is the samples file (one JSON line a member; read, appended,
resumed); :mod:`~.runner` is ``qmc-eval run`` (fixed-size groups, the in-process engine, resume);
:mod:`~.sequential` samples each prompt in rounds until ``want`` members pass (``--until-correct``).

May import: this room, :mod:`qmc_sampler.eval.backends`, :mod:`qmc_sampler.eval.tasks`, the core and
``qmc_sampler.vllm_engine`` — no report or statistic: a run records, a report judges.
"""
