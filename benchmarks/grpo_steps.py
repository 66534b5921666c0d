"""Does GRPO train faster with correlated rollouts? Real ``trl.GRPOTrainer`` runs, i.i.d. against lattice.

Every design (``--designs``, default ``iid,lattice``) trains the same model on the same
prompts, in the same order (TRL's ``RepeatSampler`` shuffles with ``GRPOConfig(seed=…)``),
with the same reward, hyper-parameters and training seeds (0 … ``--seeds``−1); runs are
paired by seed. Only the rollouts' design differs:

* CPU (default, ``use_vllm=False``): TRL calls transformers' ``generate``, patched by
  :func:`qmc_sampler.hf.patch_generate` with the design and the run's seed, so each
  prompt's G rollouts are one group. **i.i.d. runs the same code path** with the ``iid``
  design (independent counter-based uniforms through the same forcer), not transformers'
  own ``torch.multinomial``: the design is the only difference.
* GPU only, **untested** (``--use-vllm server|colocate``): TRL's own ``use_vllm=True,
  vllm_mode=…``; the design travels as docs/integrations.md says ("TRL GRPO with vLLM"):
  server mode in ``generation_kwargs={"vllm_xargs": {"qmc_method": …, "qmc_seed": …}}`` to a
  server started with ``QMC_SAMPLER=lattice trl vllm-serve --model …``; colocate mode with
  ``QMC_SAMPLER`` set in this process and ``generation_kwargs={"extra_args": …}``, one
  (design, seed) run per invocation (``--only DESIGN:SEED``: one colocated engine per
  process). ``qmc_seed`` is set afresh before each step's generation (from the run's seed
  and the step, as patch_generate derives a call's seed), so no step reuses another step's
  uniforms. The script cannot see the engine, so it cannot check that the plugin made
  groups (it says so when it starts). Refused (exit 2) on a machine without CUDA: these
  paths cannot run on this project's CPU machine.

Defaults: the default model (SmolLM2-135M-Instruct) and ``make run``'s task,
``basic_arithmetic`` (its verifier is the 0/1 reward; ``--task-option KEY=VALUE`` sets its
options, e.g. ``max_terms=3``), 2 designs × 3 seeds × 16 steps; G = 8 rollouts of 4 prompts a
step, 24 tokens; learning rate 1e-5, constant; 96 held-out problems evaluated every 2 steps.
TRL's loss and generation settings are :data:`grpo.plan.TRL_SETTINGS`, set explicitly and recorded.

The comparison, computed the same way for every design against iid, paired by seed:

* Problems: the task's distinct problems (from ``problems(POOL, data_seed)`` of :mod:`grpo.data`, de-duplicated by
  prompt), split once by a numpy Generator seeded with ``--data-seed``: ``--heldout``
  held-out problems, never trained on; the rest are the training prompts.
* Held-out reward: **greedy** decoding (``max_completion_length`` tokens, cut at the
  task's stop string) of every held-out problem, scored by the verifier, averaged. Greedy
  because it is deterministic given the weights (no evaluation noise on top of the
  training noise) and because ``patch_generate`` passes non-sampling calls through, so
  both designs are evaluated by identical code. Evaluated at step 0, every
  ``--eval-every`` steps and after the final step. Training rollouts are cut at the same stop
  string (:mod:`grpo.stop`: the tokens after it are not trained on, but for one end-of-sequence token).
* **Primary**: the area under the held-out reward curve (trapezoid over the evaluation steps,
  divided by the steps: the mean held-out reward over training), design − iid per seed: the mean
  over seeds, the exact sign-flip p-value (two-sided, all 2^n sign patterns) and the interval of
  the inverted test at 1 − α (:mod:`qmc_sampler.eval.stats.paired`).
* Secondary, the same way: the final held-out reward; with a plan, the steps to its threshold for
  iid *and* the design (a run that never reaches it counts as ``steps + eval_every``); whether
  iid's mean curve still rose at at least half of its evaluation points.
* ``--plan PLAN.md`` (its one ```json block: the settings — ``--print-settings`` prints them for
  the arguments given — and ``alpha``, ``margin``, ``threshold``) must agree with the arguments (else
  exit 2 before anything runs) and is recorded in the header with its SHA-256; the report then
  states the verdict by the plan's rule (:mod:`grpo.verdict`) — or none, saying why: settings unlike
  the plan's, pairs still missing (a partial result, listed), or a run whose end line does not show
  its design sampling one group per prompt and step.
* Also recorded, not compared: training reward, the share of zero-variance groups (all
  G rewards equal: no GRPO signal), distinct completions and distinct answers per group, tokens.

Output (``--out``, default ``runs/grpo_steps``): ``steps.jsonl`` — a header line
(arguments, CPU, versions), then one line per (design, seed, step) — step 0 is the
held-out reward before training — and one ``end`` line per finished (design, seed);
``reward.png`` (training and held-out reward against step, mean over seeds with a
min–max band). Per step: training reward mean, zero-variance share, distinct completions
and distinct answers per group, tokens, wall and CPU seconds, the prompts' problem ids, held-out reward at
evaluation steps, and patch_generate's cumulative counters (groups, members, unsampleable
rows, copies-only calls; any unsampleable or copies-only count is also printed).

Resume: rerunning with the same arguments skips the finished (design, seed) runs; a run
that was cut off has its partial lines dropped and reruns from its start (deterministic:
same seeds); a last line cut off mid-write is dropped too (the file is rewritten). A file
written with other arguments, or with a line that is not JSON before its last, is refused
(exit 2). ``--only DESIGN:SEED`` runs that one run (if unfinished) and reports; it is not
part of the arguments a file is written with. Invocations on one ``--out`` must run one
after another, never at once.

    python benchmarks/grpo_steps.py [--model DIR] [--task basic_arithmetic] [--designs iid,lattice]
        [--task-option KEY=VALUE …] [--seeds 3] [--steps 16] [--generations 8] [--prompts 4]
        [--max-completion-length 24] [--learning-rate 1e-5] [--heldout 96] [--eval-every 2]
        [--temperature 1.0] [--data-seed 0] [--rollout-stream 0] [--plan PLAN.md] [--save-at STEP]
        [--out runs/grpo_steps] [--use-vllm server|colocate] [--only DESIGN:SEED] [--quick] [--print-settings]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the grpo package beside it, however this file is loaded

from grpo.data import split_problems
from grpo.plan import eval_steps, identity, model_dir, parse_args, settings
from grpo.records import open_results
from grpo.report import report
from grpo.training import run_one

VLLM_WARNING = (
    "WARNING --use-vllm {mode} (untested): this script cannot see vLLM's engine, so it cannot check that the "
    "qmc-sampler plugin made groups; without it both designs run vLLM's own i.i.d. sampling, silently. Check the "
    "engine's log (the plugin logs once which interface it serves) and its plugin_stats "
    "(qmc_sampler.vllm_plugin.processor.plugin_stats through LLM.collective_rpc, or qmc-serve's GET /stats; "
    "docs/serving.md): admitted_by_design must count members of both designs"
)


def main(argv: list[str] | None = None) -> int:
    """Run the missing (design, seed) runs (or ``--only``'s), seed by seed, then report. Returns the exit code."""
    args, p = parse_args(argv, __doc__.splitlines()[0])
    if args.print_settings:  # a plan's "settings": these arguments' identity, the plan's own entry left out
        print(json.dumps(settings(args), indent=1))
        return 0
    from qmc_sampler.eval.tasks.catalog import get_task

    try:
        task = get_task(args.task, **args.task_options)
    except TypeError as e:  # a --task-option the task does not take
        p.error(f"--task-option: {e}")
    except ValueError as e:  # a task name that is not one, or a setting out of range (naming its option)
        p.error(str(e) if str(e).startswith("--task-option") else f"--task: {e}")
    train, heldout = split_problems(task, args, p)  # before the file: a refusal writes nothing
    path = Path(args.out) / "steps.jsonl"
    # A model that cannot be found is refused before a new file's header names it (a header locks --out).
    folder = None if path.exists() else model_dir(args, p)
    finished = open_results(path, identity(args), p)
    runs = [args.only] if args.only else [(d, s) for s in range(args.seeds) for d in args.designs]
    todo = [run for run in runs if run not in finished]
    if todo:
        from transformers import AutoTokenizer

        from qmc_sampler.cpu_defaults import describe_cpu

        if args.use_vllm:
            print(VLLM_WARNING.format(mode=args.use_vllm), flush=True)
        folder = folder or model_dir(args, p)
        print(
            f"{describe_cpu()}; {len(train)} training prompts, {len(heldout)} held-out; "
            f"runs to do: {len(todo)} of {len(args.designs) * args.seeds}",
            flush=True,
        )
        ctx = {
            "path": path,
            "task": task,
            "args": args,
            "model_dir": folder,
            "heldout": heldout,
            "train": train,
            "by_id": {pr.problem_id: pr for pr in train},
            "eval_steps": eval_steps(args.steps, args.eval_every),
            "tokenizer": AutoTokenizer.from_pretrained(folder, padding_side="left"),
            "train_tokenizer": AutoTokenizer.from_pretrained(folder, padding_side="left"),
        }
        warnings = sum(run_one(args, design, seed, ctx) for design, seed in todo)
        print(
            f"batch warnings (a batch not --prompts × G rows in groups of G by problem id, or the reward "
            f"function called more than once in a step): {warnings} in the {len(todo)} runs trained now",
            flush=True,
        )
    elif args.only:
        print(f"run {args.only[0]}:{args.only[1]} finished in {path}; nothing to train", flush=True)
    else:
        print(f"all {len(args.designs) * args.seeds} runs finished in {path}; nothing to train", flush=True)
    report(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
