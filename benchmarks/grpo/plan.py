"""``grpo_steps.py``'s command line, every value checked, and what it fixes: the run's identity and eval steps."""

from __future__ import annotations

import argparse
import json
from typing import Any, NoReturn

QUICK = dict(steps=2, seeds=1, generations=4, prompts=2, max_completion_length=8, heldout=4, eval_every=2)

#: TRL's loss and generation settings, set explicitly (not inherited from a TRL release's defaults) and
#: part of the run's identity: DAPO's token-level loss (TRL 1.16's default), no KL term, rewards scaled by
#: the group's standard deviation, one optimisation pass per generation (so the clip never binds), no
#: top-k/top-p/min-p or repetition penalty (the design's inverse-CDF sampling sees the model's distribution),
#: and the defaults of TRL 1.16 that shape the loss.
TRL_SETTINGS = dict(
    loss_type="dapo",
    beta=0.0,
    scale_rewards="group",
    epsilon=0.2,
    num_iterations=1,
    importance_sampling_level="token",
    mask_truncated_completions=False,
    top_k=0,
    top_p=1.0,
    min_p=None,
    repetition_penalty=1.0,
    # TRL 1.16's defaults, written out so that a release that changes them cannot change the run:
    entropy_coef=0.0,  # no entropy bonus
    use_adaptive_entropy=False,
    epsilon_high=None,  # the clip's upper end = epsilon
    delta=None,  # no two-sided clipping of the ratio
    top_entropy_quantile=1.0,  # every token trained, not only the high-entropy ones
    off_policy_mask_threshold=None,
    steps_per_generation=1,  # one generation per optimizer step
    gradient_checkpointing=True,  # TRL's default (transformers' is False): the same gradients, slower
    vllm_importance_sampling_correction=True,  # with --use-vllm only
)


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error (``prog: error: …``, exit 2), no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, OneLineParser]:
    """The command line, with ``--quick``'s sizes applied and every value checked.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).
        description: ``--help``'s description (the script's first docstring line).

    Returns:
        The parsed namespace and the parser (for later one-line errors).
    """
    p = OneLineParser(prog="grpo_steps.py", description=description)
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a task setting, e.g. max_digits=2 (repeatable; as qmc-eval run takes them)",
    )
    p.add_argument("--designs", default="iid,lattice", help="comma-separated qmc_sampler.METHODS, iid among them")
    p.add_argument("--seeds", type=int, default=3, help="training seeds 0 … N-1, one run per design each")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run (one generation each)")
    p.add_argument("--generations", type=int, default=8, help="G: rollouts per prompt (one group)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--heldout", type=int, default=96, help="held-out problems (greedy evaluation)")
    p.add_argument("--eval-every", type=int, default=2, help="held-out evaluation every k steps (and at the end)")
    p.add_argument("--data-seed", type=int, default=0, help="seeds the problems and the held-out split")
    p.add_argument(
        "--rollout-stream",
        type=int,
        default=0,
        help="which stream of rollout uniforms the runs draw (0: the training seed's own); two streams of "
        "iid with the same seeds are an A/A calibration (benchmarks/grpo/power.py --paired-with)",
    )
    p.add_argument("--out", default="runs/grpo_steps", help="folder for steps.jsonl and reward.png")
    p.add_argument(
        "--plan",
        default=None,
        help="the committed plan (markdown with one ```json block: its settings and rule) that the report "
        "gives the verdict by; its path, SHA-256 and rule are part of the run's identity",
    )
    p.add_argument(
        "--save-at",
        type=int,
        default=None,
        metavar="STEP",
        help="save the weights after this step to OUT/checkpoints/DESIGN-SEED-stepSTEP (for grpo_gradient.py)",
    )
    p.add_argument(
        "--use-vllm",
        choices=("server", "colocate"),
        default=None,
        help="UNTESTED, GPU only (CUDA and vLLM's GPU build; refused here): TRL's use_vllm=True in this mode "
        "(colocate: one run per invocation, with --only)",
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="DESIGN:SEED",
        help="run only this (design, seed) run, if unfinished, then report (needed with --use-vllm colocate)",
    )
    p.add_argument("--quick", action="store_true", help="2 steps, 1 seed, G = 4, 2 prompts: checks that it runs")
    p.add_argument(
        "--print-settings",
        action="store_true",
        help="print these arguments' settings (a plan's \"settings\", as JSON) and exit: nothing runs",
    )
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    _check(args, p)
    return args, p


def identity(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs comparable: every argument that changes a result (not ``--out``)."""
    keys = (
        "model",
        "task",
        "task_options",
        "designs",
        "seeds",
        "steps",
        "generations",
        "prompts",
        "max_completion_length",
        "learning_rate",
        "temperature",
        "heldout",
        "eval_every",
        "data_seed",
        "rollout_stream",
        "use_vllm",
    )
    return json.loads(json.dumps({k: getattr(args, k) for k in keys} | {"trl": TRL_SETTINGS, "plan": args.plan_id}))


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """A plan's ``settings`` for these arguments: their :func:`identity` without its ``plan`` entry."""
    return {k: v for k, v in identity(args).items() if k != "plan"}


def model_dir(args: argparse.Namespace, p: OneLineParser) -> str:
    """``--model``'s folder (None: the default model, fetched if not cached), or a one-line error (exit 2)."""
    from qmc_sampler.models import resolve_model

    try:
        return resolve_model(args.model)
    except ValueError as e:
        p.error(f"--model: {e}")


def eval_steps(steps: int, every: int) -> list[int]:
    """The steps after which the held-out set is evaluated: 0, every ``every``-th, and the last."""
    return sorted({0, steps, *range(every, steps + 1, every)})


def _check(args: argparse.Namespace, p: OneLineParser) -> None:
    """Check every value and normalize two in place: ``args.designs`` becomes a list, iid
    first; ``args.only`` a (design, seed) pair or None.

    Args:
        args: the parsed namespace (modified). p: for the one-line error (exit 2).
    """
    from qmc_sampler.designs import METHODS

    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = [d for d in designs if d not in METHODS]
    if unknown:
        p.error(f"--designs {unknown[0]!r} is not a design; use some of {','.join(METHODS)}")
    if "iid" not in designs or len(set(designs)) != len(designs) or len(designs) < 2:
        p.error(f"--designs {args.designs!r}: give iid and at least one other design, each once (e.g. iid,lattice)")
    args.designs = ["iid", *[d for d in designs if d != "iid"]]
    for name in ("seeds", "steps", "generations", "prompts", "max_completion_length", "heldout", "eval_every"):
        if getattr(args, name) < 1 or (name == "generations" and args.generations < 2):
            least = 2 if name == "generations" else 1
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be an integer >= {least}")
    if not 0 < args.learning_rate < 1 or not args.temperature > 0:
        p.error("--learning-rate must be in (0, 1) and --temperature > 0")
    for name in ("data_seed", "rollout_stream"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be an integer >= 0")
    if args.save_at is not None and not 1 <= args.save_at <= args.steps:
        p.error(f"--save-at {args.save_at}: must be a step 1 … --steps ({args.steps})")
    args.task_options = _task_options(args.task_option, p)
    args.plan_id = None
    if args.plan is not None:
        from grpo.verdict import differing_settings, read_plan

        try:
            plan = read_plan(args.plan)
        except ValueError as e:
            p.error(f"--plan: {e}")
        args.plan_id = plan.rule()  # the header carries the rule: the verdict needs only the JSONL
        differ = differing_settings(identity(args))  # the report's own check, now rather than after the runs
        if differ:  # found now, not in the report after hours of training
            p.error(
                f"--plan {args.plan}: these arguments differ from the plan's settings ({', '.join(differ)}); "
                "give the plan's command (--print-settings prints these arguments' settings)"
            )
    if args.only is not None:
        design, _, seed = args.only.partition(":")
        if design not in args.designs or not seed.isdigit() or int(seed) >= args.seeds:
            p.error(
                f"--only {args.only!r}: give DESIGN:SEED, a design of --designs ({','.join(args.designs)}) "
                f"and a seed 0 … {args.seeds - 1}"
            )
        args.only = (design, int(seed))
    if args.use_vllm == "colocate" and args.only is None:
        # A colocated engine lives in this process (TRL builds one per trainer, and QMC_SAMPLER is
        # read when it starts): two runs in one process would hold two engines, the second started
        # under the first's environment. One run per process is the simplest correct rule; a driver
        # that spawned a process per run could not be tested here (no GPU).
        p.error("--use-vllm colocate: one (design, seed) run per invocation; add --only DESIGN:SEED (e.g. iid:0)")
    if args.use_vllm:
        import torch

        if not torch.cuda.is_available():
            p.error(
                f"--use-vllm {args.use_vllm}: needs a CUDA GPU and vLLM's GPU build; this machine has no "
                "CUDA device (on the CPU leave --use-vllm out: transformers generate with patch_generate)"
            )


def _task_options(texts: list[str], p: OneLineParser) -> dict[str, Any]:
    """``--task-option KEY=VALUE`` settings as a dict (values as Python literals where they parse).

    Raises (through ``p``): a one-line error (exit 2) for a setting without ``=`` or a key given twice.
    """
    from qmc_sampler.eval.cli import _task_option

    options: dict[str, Any] = {}
    for text in texts:
        try:
            key, value = _task_option(text)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
        if key in options:
            p.error(f"--task-option {key}: given twice")
        options[key] = value
    return dict(sorted(options.items()))
