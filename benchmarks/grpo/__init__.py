"""The parts of ``benchmarks/grpo_steps.py`` (the command and its pre-registered comparison: its docstring).

* :mod:`grpo.plan` — the command line (checked), the run's identity, the evaluation steps;
* :mod:`grpo.records` — ``steps.jsonl``: its records, their reading, the resume;
* :mod:`grpo.data` — the task's problems and their split, a step's batch and its groups;
* :mod:`grpo.evaluation` — the held-out reward (greedy);
* :mod:`grpo.training` — one (design, seed) run of ``trl.GRPOTrainer`` and its step lines;
* :mod:`grpo.stop` — training rollouts cut at the task's stop string;
* :mod:`grpo.verdict` — the plan (its settings and rule, from its markdown) and the rule's verdict;
* :mod:`grpo.report` — the table, the paired comparison and the plot, from the finished runs
  (its paired statistics: :mod:`qmc_sampler.eval.stats.paired`);
* :mod:`grpo.power` — a plan's effect, SD and seeds from an i.i.d. pilot (a command of its own).

Imported as ``grpo`` with ``benchmarks/`` on ``sys.path``: where ``python benchmarks/grpo_steps.py``
puts it, and where the script puts itself when it is loaded otherwise.
"""
