"""Do correlated rollouts give GRPO a better gradient? The mechanism behind fewer training steps, at fixed weights.

For fixed weights (``--model``: the initial model, or a checkpoint that ``grpo_steps.py --save-at``
wrote), each of ``--prompts`` training prompts (``grpo_steps.py``'s split: the same task, options,
``--data-seed`` and ``--heldout``) gets **two groups of G rollouts from each design** (the same
rollout budget per design; G = ``--generations``), generated, cut at the stop string and scored
by the code ``grpo_steps.py`` trains with (``trl.GRPOTrainer``'s own generation and reward path, with
``patch_generate`` and :data:`grpo.plan.TRL_SETTINGS`; :data:`CHUNK` prompts a generate call here, the
step's ``--prompts`` there). Per group:

* whether its rewards are all equal (zero variance: no GRPO signal), its distinct completions and
  its distinct answers (the verifier's parsed answer);
* **the GRPO policy-gradient estimate of TRL's loss** from the group alone: TRL's
  ``compute_loss`` on the group's rows (DAPO: normalised by the group's own completion tokens),
  differentiated with respect to the last decoder layer's parameters (and the final norm; the
  other weights frozen: the backward pass stops there). Its target is g = E[ĝ] under **i.i.d.**
  rollouts. That is close to, not exactly, the prompt's share of the trainer's step gradient: the
  trainer divides by the tokens of all the step's rows, a group alone by its own (a random
  normaliser), so a design whose completions have other lengths differs from g through it too —
  counted below as the design's bias.

The error of a design's estimate against g, E‖ĝ − g‖², from per-prompt distances only, unbiased
(independent groups; no reference gradient needs estimating first): with I₁, I₂ the i.i.d. groups'
estimates and L₁, L₂ the design's, E‖I₁ − I₂‖²/2 is i.i.d.'s error (its total variance), and the
mean of ‖Lⱼ − Iₖ‖² over the four pairs, less that, is the design's error — its variance
(‖L₁ − L₂‖²/2) plus its squared bias against g (a correlated group's GRPO estimate need not have
i.i.d.'s expectation: the advantages couple its members). Figures are means over prompts with
percentile bootstrap intervals over prompts (the prompts are the independent units; 2,000 resamples,
``numpy.random.default_rng(0)``); the error ratio design / iid is a ratio of means over the same
resamples.

Output (``--out``, default ``runs/grpo_gradient``): ``gradient.jsonl`` — a header line (arguments,
CPU, versions), then one line per prompt (appended as it finishes: a rerun with the same arguments
resumes after the last whole line; other arguments are refused, exit 2) — and the report printed
from it.

    python benchmarks/grpo_gradient.py [--model DIR] [--task basic_arithmetic] [--task-option K=V ...]
        [--prompts N (default 256, or all the task has)] [--generations 8] [--max-completion-length 24]
        [--designs iid,lattice] [--seed 0] [--out runs/grpo_gradient] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the grpo package beside it, however this file is loaded

import numpy as np
from grpo.data import completion_text, cut, group_stats, split_problems
from grpo.plan import TRL_SETTINGS, OneLineParser, _task_options, model_dir
from grpo.records import append, open_records, read_lines
from grpo.stop import cut_generate_at_stop

#: --quick: 2 prompts of 4 rollouts, one a chunk (so that the chunked loop and its resume run twice).
QUICK = dict(prompts=2, generations=4, max_completion_length=8, heldout=4, chunk=1)
RESAMPLES = 2000
#: The arguments that make two files comparable (not ``--out``).
IDENTITY = (
    "model",
    "task",
    "task_options",
    "designs",
    "prompts",
    "generations",
    "max_completion_length",
    "temperature",
    "heldout",
    "data_seed",
    "seed",
    "chunk",  # it decides the chunks' group seeds and batch shapes
)
GROUPS_PER_DESIGN = 2  # two independent groups per design and prompt: the error needs no reference gradient
DEFAULT_PROMPTS = 256  # the least: intervals over prompts narrow enough to tell the designs apart
CHUNK = 8  # prompts generated together (8 × G rows a generate call), each still a group of its own


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, OneLineParser]:
    """The command line, with ``--quick``'s sizes applied and every value checked (one-line errors, exit 2)."""
    p = OneLineParser(prog="grpo_gradient.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--designs", default="iid,lattice", help="iid and one other design")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"training prompts, each a group pair per design (default {DEFAULT_PROMPTS}, or all the task has)",
    )
    p.add_argument("--generations", type=int, default=8, help="G: rollouts per group")
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--heldout", type=int, default=96, help="held out of the training prompts, as grpo_steps.py")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="the designs' group seeds are derived from it")
    p.add_argument("--out", default="runs/grpo_gradient")
    p.add_argument("--quick", action="store_true", help="2 prompts, G = 4, 8 tokens: checks that it runs")
    args = p.parse_args(argv)
    args.chunk = CHUNK
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    from qmc_sampler.designs import METHODS

    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    if len(designs) != 2 or designs[0] != "iid" or designs[1] not in METHODS or designs[1] == "iid":
        p.error(f"--designs {args.designs!r}: give iid and one other design of {','.join(METHODS)} (e.g. iid,lattice)")
    args.designs = designs
    for name in ("prompts", "generations", "max_completion_length", "heldout"):
        if name == "prompts" and args.prompts is None:
            continue
        if getattr(args, name) < (2 if name == "generations" else 1):
            least = 2 if name == "generations" else 1
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be an integer >= {least}")
    if not args.temperature > 0 or args.data_seed < 0 or args.seed < 0:
        p.error("--temperature must be > 0, --data-seed and --seed >= 0")
    args.task_options = _task_options(args.task_option, p)
    return args, p


def main(argv: list[str] | None = None) -> int:
    """Measure the prompts not yet in ``gradient.jsonl``, one line each, then report. Returns the exit code."""
    args, p = parse_args(argv)
    from qmc_sampler.eval.tasks.catalog import get_task

    try:
        task = get_task(args.task, **args.task_options)
    except (TypeError, ValueError) as e:
        p.error(f"--task / --task-option: {e}")
    asked = args.prompts or 1
    split = argparse.Namespace(heldout=args.heldout, prompts=asked, data_seed=args.data_seed, task=args.task)
    train, _ = split_problems(task, split, p)
    if args.prompts is None:
        args.prompts = min(DEFAULT_PROMPTS, len(train))
        if args.prompts < DEFAULT_PROMPTS:  # said, not silent: the intervals are wider than the default's
            print(
                f"WARNING: {args.prompts} prompts, all the training prompts {args.task} gives after --heldout "
                f"{args.heldout} (fewer than the default {DEFAULT_PROMPTS}"
                + ("; --task-option max_terms=3 gives 369)" if args.task == "basic_arithmetic" else ")"),
                file=sys.stderr,
                flush=True,
            )
    prompts = train[: args.prompts]
    path = Path(args.out) / "gradient.jsonl"
    where = None if path.exists() else model_dir(args, p)  # before a new file's header names it: a header locks --out
    ident = identity(args)
    done = {r.get("problem_id") for r in open_records(path, ident, p, "grpo_gradient.py")[1:]}
    if any(pr.problem_id not in done for pr in prompts):
        measure(args, task, prompts, done, where or model_dir(args, p), path)
    report(path)
    return 0


def identity(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two files comparable: :data:`IDENTITY`'s arguments (``--prompts`` resolved) and TRL's settings."""
    return json.loads(json.dumps({k: getattr(args, k) for k in IDENTITY} | {"trl": TRL_SETTINGS}))


def measure(
    args: argparse.Namespace, task: Any, prompts: list[Any], done: set[Any], model_dir: str, path: Path
) -> None:
    """Two groups per design for each prompt not in ``done``: their statistics and gradient distances, a
    line per prompt. The prompts go in chunks of ``args.chunk`` (:data:`CHUNK`) in their order, each chunk's group seeds
    from its first prompt: a resumed file skips whole chunks and redoes a cut-off one with the same seeds
    (only its missing lines appended), so it holds what an uninterrupted run would have written."""
    import tempfile

    import torch
    from datasets import Dataset
    from grpo.training import grpo_config
    from qmc_sampler.hf import patch_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from qmc_sampler.counter_rng import stable_seed

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainable = [*model.model.layers[-1].parameters(), *model.model.norm.parameters()]
    keep = {id(t) for t in trainable}
    for param in model.parameters():
        param.requires_grad_(id(param) in keep)
    by_id = {pr.problem_id: pr for pr in prompts}
    scored: list[dict[str, Any]] = []

    def verifier(prompts: Any, completions: Any, completion_ids: Any, problem_id: Any, **_: Any) -> list[float]:
        texts = [cut(completion_text(c), task.stop) for c in completions]
        rewards = [float(task.score(by_id[pid], t).correct) for pid, t in zip(problem_id, texts, strict=True)]
        scored.append({"texts": texts, "rewards": rewards, "ids": [list(c) for c in completion_ids]})
        return rewards

    verifier.__name__ = "verifier"
    config_args = argparse.Namespace(
        prompts=1,
        generations=args.generations,
        max_completion_length=args.max_completion_length,
        steps=1,
        learning_rate=1e-6,
        temperature=args.temperature,
        use_vllm=None,
    )
    g = args.generations
    rows = [
        {"prompt": pr.messages if pr.messages is not None else pr.prompt, "problem_id": pr.problem_id} for pr in prompts
    ]
    with tempfile.TemporaryDirectory(prefix="grpo-gradient-") as scratch:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=verifier,
            args=grpo_config(config_args, "iid", args.seed, scratch, task.stop),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        trainer.model.train()
        # What Trainer's loop sets each step (one accumulation step here); the DAPO loss divides by it.
        trainer.current_gradient_accumulation_steps = 1
        start, total = time.perf_counter(), len(rows)
        for first in range(0, total, args.chunk):
            chunk = rows[first : first + args.chunk]
            if all(row["problem_id"] in done for row in chunk):
                continue
            grads: list[dict[str, list[torch.Tensor]]] = [{} for _ in chunk]
            lines: list[dict[str, Any]] = [
                {"type": "prompt", "problem_id": row["problem_id"], "groups": {}} for row in chunk
            ]
            for design in args.designs:
                seed = stable_seed("grpo_gradient", args.seed, design, chunk[0]["problem_id"])
                for line in lines:
                    line.setdefault("group_seeds", {})[design] = seed  # the chunk's: a resume must draw the same
                handle = patch_generate(trainer.model, design, seed=seed)
                uncut = cut_generate_at_stop(trainer.model, tokenizer, task.stop)
                try:
                    for _ in range(GROUPS_PER_DESIGN):  # successive calls: independent group seeds
                        scored.clear()
                        batch = trainer._generate_and_score_completions([row for row in chunk for _ in range(g)])
                        for i in range(len(chunk)):
                            grad, stats = group_gradient(trainer, batch, i, g, scored[-1], trainable)
                            grads[i].setdefault(design, []).append(grad)
                            lines[i]["groups"].setdefault(design, []).append(stats)
                finally:
                    uncut()
                    handle.restore()
            for line, grad in zip(lines, grads, strict=True):
                if line["problem_id"] not in done:
                    line["distances"] = distances(grad[args.designs[0]], grad[args.designs[1]])
                    append(path, line)
            print(f"{first + len(chunk)}/{total} prompts, {time.perf_counter() - start:.0f} s", flush=True)


def group_gradient(
    trainer: Any, batch: dict[str, Any], i: int, g: int, scored: dict[str, Any], trainable: list[Any]
) -> tuple[Any, dict[str, Any]]:
    """Group ``i`` of a generation batch (rows i·G … i·G + G − 1): TRL's loss on its rows alone (DAPO's
    normaliser: the group's own completion tokens), its gradient on ``trainable`` as one ``[P]``
    float64 vector, and its statistics (zero variance, distinct completions and answers, rewards, tokens)."""
    import torch

    rows = slice(i * g, (i + 1) * g)
    total = len(scored["rewards"])
    inputs = {k: v[rows] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == total else v for k, v in batch.items()}
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, inputs).backward()
    if any(t.grad is None for t in trainable):  # the loss did not reach them: a broken graph, not a zero gradient
        raise RuntimeError("TRL's loss has no gradient on the last decoder layer: the backward pass did not reach it")
    grad = torch.cat([t.grad.flatten() for t in trainable]).double()
    rewards, ids, texts = scored["rewards"][rows], scored["ids"][rows], scored["texts"][rows]
    stats = group_stats([0] * g, rewards, ids, [extract(t) for t in texts])
    return grad, stats | {"rewards": rewards, "tokens": sum(map(len, ids))}


def extract(text: str) -> str | None:
    """The verifier's parsed answer (the last ``<answer>…</answer>``)."""
    from qmc_sampler.eval.tasks.catalog import extract_answer

    return extract_answer(text)


def distances(iid: list[Any], design: list[Any]) -> dict[str, Any]:
    """Squared distances between one prompt's group estimates: ``ii`` (the two i.i.d. groups), ``dd`` (the
    design's two), ``di`` (each design group against each i.i.d. group, four), and each estimate's squared norm."""
    sq = lambda a, b: float(((a - b) ** 2).sum())  # noqa: E731
    return {
        "ii": sq(iid[0], iid[1]),
        "dd": sq(design[0], design[1]),
        "di": [sq(d, i) for d in design for i in iid],
        "norms": {"iid": [float((g**2).sum()) for g in iid], "design": [float((g**2).sum()) for g in design]},
    }


def errors(lines: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Per prompt: i.i.d.'s error ‖I₁ − I₂‖²/2, the design's error mean‖Lⱼ − Iₖ‖² − that, and the design's
    variance ‖L₁ − L₂‖²/2 (module docstring)."""
    ii = np.array([ln["distances"]["ii"] for ln in lines]) / 2
    di = np.array([np.mean(ln["distances"]["di"]) for ln in lines])
    dd = np.array([ln["distances"]["dd"] for ln in lines]) / 2
    return {"iid": ii, "design": di - ii, "design_variance": dd}


def report(path: Path) -> None:
    """Print the figures with bootstrap intervals over prompts, from ``gradient.jsonl`` alone."""
    records, _ = read_lines(path)
    header, lines = records[0], [r for r in records[1:] if r.get("type") == "prompt"]
    ident = header["identity"]
    iid, design = ident["designs"]
    print(
        f"\n{header['cpu']}; model {ident['model'] or 'SmolLM2-135M-Instruct'}, {ident['task']} "
        f"{ident['task_options'] or ''}, {len(lines)} of {ident['prompts']} prompts, G = {ident['generations']}, "
        f"{GROUPS_PER_DESIGN} groups per design and prompt"
    )
    if not lines:
        print("no prompt measured yet")
        return
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(lines), (RESAMPLES, len(lines)))

    def interval(values: np.ndarray) -> str:
        means = values[picks].mean(axis=1)
        low, high = np.quantile(means, [0.025, 0.975])
        return f"{values.mean():.3f} [{low:.3f}, {high:.3f}]"

    for key, name in (
        ("zero_var_share", "zero-variance groups"),
        ("distinct_answers_per_group", "distinct answers"),
        ("distinct_per_group", "distinct completions"),
        ("reward", "reward"),
    ):
        per = {}
        for d in (iid, design):
            per[d] = np.array([np.mean([group_value(g, key) for g in ln["groups"][d]]) for ln in lines])
        print(
            f"{name:>21}: {iid} {interval(per[iid])}, {design} {interval(per[design])}, "
            f"{design} − {iid} {interval(per[design] - per[iid])}"
        )
    err = errors(lines)
    head = (
        f"gradient error E‖ĝ − g‖² (last layer): {iid} {interval(err['iid'])}, {design} {interval(err['design'])} "
        f"(its variance {interval(err['design_variance'])}); {design} / {iid} "
    )
    resampled = err["iid"][picks].mean(axis=1)
    if (resampled > 0).all():
        low, high = np.quantile(err["design"][picks].mean(axis=1) / resampled, [0.025, 0.975])
        print(f"{head}{err['design'].mean() / err['iid'].mean():.3f} [{low:.3f}, {high:.3f}]")
    else:  # every i.i.d. group of some resample had equal rewards: no gradient to compare with
        print(f"{head}undefined (i.i.d.'s error is 0 in some resamples: their groups' rewards are all equal)")
    print(f"lines: {path}", flush=True)


def group_value(group: dict[str, Any], key: str) -> float:
    """A group's figure: one of its group_stats, or its mean reward (``reward``)."""
    return float(np.mean(group["rewards"])) if key == "reward" else float(group[key])


if __name__ == "__main__":
    sys.exit(main())
