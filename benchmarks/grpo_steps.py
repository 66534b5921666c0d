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
``basic_arithmetic`` (its verifier is the 0/1 reward), sized for about an hour on an
idle 2-core CPU (2 designs × 3 seeds × 16 steps; G = 8 rollouts of 4 prompts a step,
24 tokens; learning rate 1e-5, constant; 64 held-out problems evaluated every 4 steps).

Pre-registered comparison (fixed before the first full run; not tuned on its result):

* Problems: the task's distinct problems (from ``problems(600, 0)``, de-duplicated by
  prompt), split once by a numpy Generator seeded with ``--data-seed``: ``--heldout``
  held-out problems, never trained on; the rest are the training prompts.
* Held-out reward: **greedy** decoding (``max_completion_length`` tokens, cut at the
  task's stop string) of every held-out problem, scored by the verifier, averaged. Greedy
  because it is deterministic given the weights (no evaluation noise on top of the
  training noise) and because ``patch_generate`` passes non-sampling calls through, so
  both designs are evaluated by identical code. Evaluated at step 0, every
  ``--eval-every`` steps and after the final step.
* **Primary**: held-out reward after the final step, paired difference design − iid per
  seed, and its mean over seeds. Printed with it: the number of seeds, the exact sign-flip
  permutation p-value of that mean (two-sided; all 2^n sign patterns of the n paired
  differences; with 3 seeds it can be no smaller than 0.25), and a **descriptive**
  percentile bootstrap interval over seeds (2.5 and 97.5 percentiles of 10 000 resampled
  means, ``numpy.random.default_rng(0)``). That interval is not a 95% confidence interval:
  with 3–5 seeds it is about the range of the differences and covers far less than 95%.
* Secondary: (a) the area under the held-out reward curve (trapezoid over the evaluation
  steps, divided by the steps: the mean held-out reward over training), paired the same
  way; (b) per seed, the first evaluation step at which the design's held-out reward
  reaches iid's final held-out reward (``-`` if it never does; ``iid did not improve``
  where iid's final held-out reward is not above its step-0 value: nothing to reach).
* Also recorded, not compared: training reward, the share of zero-variance groups (all
  G rewards equal: no GRPO signal), distinct completions per group, tokens generated.

Output (``--out``, default ``runs/grpo_steps``): ``steps.jsonl`` — a header line
(arguments, CPU, versions), then one line per (design, seed, step) — step 0 is the
held-out reward before training — and one ``end`` line per finished (design, seed);
``reward.png`` (training and held-out reward against step, mean over seeds with a
min–max band). Per step: training reward mean, zero-variance share, distinct completions
per group, tokens, wall and CPU seconds, the prompts' problem ids, held-out reward at
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
        [--seeds 3] [--steps 16] [--generations 8] [--prompts 4] [--max-completion-length 24]
        [--learning-rate 1e-5] [--heldout 64] [--eval-every 4] [--out runs/grpo_steps]
        [--use-vllm server|colocate] [--only DESIGN:SEED] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

QUICK = dict(steps=2, seeds=1, generations=4, prompts=2, max_completion_length=8, heldout=4, eval_every=2)
POOL = 600  # problems drawn before de-duplication (basic_arithmetic has ~240 distinct; 600 give ~220)
BOOTSTRAP = 10_000
LEVEL = 0.95
HEADER, STEP, END = "header", "step", "end"


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error (``prog: error: …``, exit 2), no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, OneLineParser]:
    """The command line, with ``--quick``'s sizes applied and every value checked.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed namespace and the parser (for later one-line errors).
    """
    p = OneLineParser(prog="grpo_steps.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--designs", default="iid,lattice", help="comma-separated qmc_sampler.METHODS, iid among them")
    p.add_argument("--seeds", type=int, default=3, help="training seeds 0 … N-1, one run per design each")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run (one generation each)")
    p.add_argument("--generations", type=int, default=8, help="G: rollouts per prompt (one group)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--heldout", type=int, default=64, help="held-out problems (greedy evaluation)")
    p.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every k steps (and at the end)")
    p.add_argument("--data-seed", type=int, default=0, help="seeds the problems and the held-out split")
    p.add_argument("--out", default="runs/grpo_steps", help="folder for steps.jsonl and reward.png")
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
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    _check(args, p)
    return args, p


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
    if args.data_seed < 0:
        p.error(f"--data-seed {args.data_seed}: must be an integer >= 0")
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


def identity(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs comparable: every argument that changes a result (not ``--out``)."""
    keys = (
        "model",
        "task",
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
        "use_vllm",
    )
    return json.loads(json.dumps({k: getattr(args, k) for k in keys}))


def eval_steps(steps: int, every: int) -> list[int]:
    """The steps after which the held-out set is evaluated: 0, every ``every``-th, and the last."""
    return sorted({0, steps, *range(every, steps + 1, every)})


# ---------------------------------------------------------------- the JSONL file and its resume


def read_lines(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The records of ``path``, and whether its text is whole: every line a record, the last
    one ended by a newline. A last line cut off mid-write is dropped (its run is unfinished).

    Raises:
        ValueError: the file is not text, or a line before the last is not a JSON object.
    """
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text file ({e}); use another --out") from None
    records = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif i != len(lines) - 1:
            raise ValueError(
                f"{path}, line {i + 1}: not a JSON record (only the last line may be cut off); use another --out"
            )
    return records, len(records) == len(lines) and text.endswith("\n")


def open_results(path: Path, ident: dict[str, Any], p: OneLineParser) -> set[tuple[str, int]]:
    """Prepare ``path`` for this invocation and say which (design, seed) runs are finished.

    A new file gets the header line. An existing one must carry the same identity and parse
    (else a one-line error, exit 2); the lines of runs without an ``end`` line are dropped
    so that those runs restart from their beginning, and so is a last line cut off
    mid-write (wherever it is: after a run's ``end`` line too). Either way the file is
    rewritten atomically, whole lines only, so that the next line appended starts a line.

    Args:
        path: the JSONL file. ident: :func:`identity` of these arguments. p: for the error.

    Returns:
        The finished (design, seed) pairs.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        from qmc_sampler.cpu_defaults import describe_cpu

        versions = {name: _version(name) for name in ("qmc-llm-sampler", "torch", "transformers", "trl")}
        versions["python"] = sys.version.split()[0]
        header = {"type": HEADER, "identity": ident, "cpu": describe_cpu(), "versions": versions}
        path.write_text(json.dumps(header) + "\n")
        return set()
    try:
        records, whole = read_lines(path)
    except ValueError as e:
        p.error(str(e))
    if not records or records[0].get("type") != HEADER:
        p.error(f"{path} has no header line: not a grpo_steps.py file; use another --out")
    if records[0]["identity"] != ident:
        diff = sorted(k for k in ident if records[0]["identity"].get(k) != ident[k])
        p.error(f"{path} was written with other arguments ({', '.join(diff)}); use another --out or the same ones")
    finished = {(r["design"], r["seed"]) for r in records if r.get("type") == END}
    kept = [r for r in records if r.get("type") == HEADER or (r.get("design"), r.get("seed")) in finished]
    if len(kept) != len(records) or not whole:
        staging = path.with_suffix(".tmp")
        staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
        staging.replace(path)
        if not whole:
            print("dropped a last line cut off mid-write", flush=True)
        if len(kept) != len(records):
            print(f"dropped {len(records) - len(kept)} lines of unfinished runs; they restart", flush=True)
    return finished


def _version(name: str) -> str | None:
    """The installed version of distribution ``name`` (None: not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def append(path: Path, record: dict[str, Any]) -> None:
    """Add one record (a line, flushed: a cut-off run leaves whole lines behind it)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------- problems and rewards


def split_problems(task: Any, args: argparse.Namespace, p: OneLineParser) -> tuple[list[Any], list[Any]]:
    """The task's distinct problems, split into (training, held-out) by a Generator seeded
    with ``--data-seed``.

    Args:
        task: the eval task (``--task``). args: ``--heldout``, ``--prompts`` (at least that many
        training problems must remain) and ``--data-seed``. p: for the one-line errors (exit 2):
        too few problems, or the task failing to give them.

    Returns:
        Two disjoint lists of ``Problem``; held-out has ``--heldout`` problems.
    """
    heldout, data_seed = args.heldout, args.data_seed
    try:
        drawn = task.problems(POOL, data_seed)
    except Exception as e:  # e.g. StopIteration: the task's one-shot example pool ran dry for this seed
        p.error(
            f"--task {args.task} --data-seed {data_seed}: the task could not give its problems "
            f"({type(e).__name__}: {str(e) or 'no message'}); try another --data-seed"
        )
    distinct: dict[str, Any] = {}
    for problem in drawn:
        distinct.setdefault(json.dumps(problem.messages or problem.prompt), problem)
    problems = list(distinct.values())
    if len(problems) - heldout < args.prompts:
        p.error(
            f"--heldout {heldout}: the task gives {len(problems)} distinct problems, which leaves "
            f"{max(len(problems) - heldout, 0)} for training, fewer than --prompts {args.prompts}; use fewer"
        )
    order = np.random.default_rng(data_seed).permutation(len(problems))
    return [problems[i] for i in order[heldout:]], [problems[i] for i in order[:heldout]]


def cut(text: str, stop: tuple[str, ...]) -> str:
    """The text up to and including its first stop string (what a stop-string request returns)."""
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def completion_text(completion: Any) -> str:
    """A TRL completion's text (conversational: a list with one assistant message)."""
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def grouped(problem_ids: list[Any], prompts: int, g: int) -> bool:
    """Whether a step's batch is ``prompts × g`` rows: ``prompts`` distinct problem ids, each on
    ``g`` consecutive rows (TRL's RepeatSampler's layout, the one the figures assume)."""
    heads = problem_ids[::g]
    return (
        len(problem_ids) == prompts * g
        and len(set(heads)) == prompts
        and all(problem_ids[i * g : (i + 1) * g] == [head] * g for i, head in enumerate(heads))
    )


def group_stats(problem_ids: list[Any], rewards: list[float], completion_ids: list[list[int]]) -> dict[str, float]:
    """Zero-variance share and distinct completions per group, a group being one prompt's rows."""
    groups: dict[Any, list[int]] = {}
    for row, pid in enumerate(problem_ids):
        groups.setdefault(pid, []).append(row)
    zero_var = [len({rewards[r] for r in rows}) == 1 for rows in groups.values()]
    distinct = [len({tuple(completion_ids[r]) for r in rows}) for rows in groups.values()]
    return {"zero_var_share": float(np.mean(zero_var)), "distinct_per_group": float(np.mean(distinct))}


def heldout_reward(model: Any, tokenizer: Any, task: Any, problems: list[Any], max_tokens: int) -> float:
    """Mean verifier reward of greedy completions of ``problems`` (batches of 32, left-padded)."""
    import torch

    texts = [
        tokenizer.apply_chat_template(pr.messages, tokenize=False, add_generation_prompt=True)
        if pr.messages is not None
        else pr.prompt
        for pr in problems
    ]
    was_training = model.training
    model.eval()
    scores = []
    try:
        for start in range(0, len(texts), 32):
            batch = tokenizer(texts[start : start + 32], return_tensors="pt", padding=True, add_special_tokens=False)
            batch = batch.to(model.device)
            with torch.no_grad():
                out = model.generate(
                    **batch, do_sample=False, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id
                )
            decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            for pr, text in zip(problems[start : start + 32], decoded, strict=True):
                scores.append(float(task.score(pr, cut(text, task.stop)).correct))
    finally:
        model.train(was_training)
    return float(np.mean(scores))


# ---------------------------------------------------------------- one (design, seed) run


class Recorder:
    """The reward function TRL calls once per step (it sees every rollout of the step) and the
    callback that writes the step's line after the optimizer step.

    Args:
        ctx: the run's fixed parts (path, task, held-out problems, tokenizer, args, design, seed).
        handle: patch_generate's handle (None with vLLM: its counters live in the engine).
    """

    def __init__(self, ctx: dict[str, Any], handle: Any) -> None:
        self.ctx = ctx
        self.handle = handle
        self.pending: dict[str, Any] = {}
        self.started = (time.perf_counter(), time.process_time())
        self.calls = 0  # reward calls in this step (one expected)
        self.warnings = 0  # batches not shaped prompts × G, repeated calls in a step (printed, not recorded)
        self.__name__ = "verifier"  # TRL names its reward metrics after the function

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        problem_id: list[Any],
        **_: Any,
    ) -> list[float]:
        """The task's verifier on each completion (cut at the stop string), 1.0 or 0.0.

        A batch that is not ``prompts × G`` rows in groups of G by problem id, or a second call
        in one step, is warned about and counted (the step's line holds the last call's figures).
        """
        args = self.ctx["args"]
        self.calls += 1
        if self.calls > 1:
            self.warn(f"the reward function was called {self.calls} times in this step (once expected)")
        if not grouped(list(problem_id), args.prompts, args.generations):
            self.warn(
                f"the batch has {len(problem_id)} rows of {len(set(problem_id))} problems, not {args.prompts} "
                f"prompts × G = {args.generations} rows in groups of G by problem id"
            )
        task, by_id = self.ctx["task"], self.ctx["by_id"]
        texts = [cut(completion_text(c), task.stop) for c in completions]
        rewards = [float(task.score(by_id[pid], t).correct) for pid, t in zip(problem_id, texts, strict=True)]
        self.pending = {
            "prompt_ids": list(dict.fromkeys(problem_id)),  # in the batch's order, each once
            "reward_mean": float(np.mean(rewards)),
            **group_stats(list(problem_id), rewards, completion_ids),
            "tokens": int(sum(len(ids) for ids in completion_ids)),
        }
        return rewards

    def warn(self, message: str) -> None:
        """Print one WARNING line naming the run and the step, and count it."""
        self.warnings += 1
        print(f"WARNING {self.ctx['design']} seed {self.ctx['seed']}: {message}", flush=True)

    def on_step_begin(self) -> None:
        """Start the step's clocks and its count of reward calls."""
        self.started = (time.perf_counter(), time.process_time())
        self.calls = 0

    def on_step_end(self, step: int, model: Any) -> None:
        """Write the step's line (held-out reward at evaluation steps) and print its progress."""
        wall, cpu = time.perf_counter() - self.started[0], time.process_time() - self.started[1]
        record = {"type": STEP, "design": self.ctx["design"], "seed": self.ctx["seed"], "step": step, **self.pending}
        if self.pending:  # a training step (step 0 is the evaluation before training only)
            record |= {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
        self.pending = {}
        record.update(self.evaluate(step, model))
        record["qmc"] = self.counters()
        append(self.ctx["path"], record)
        self.report(record)

    def evaluate(self, step: int, model: Any) -> dict[str, Any]:
        """``heldout_reward`` and its seconds at evaluation steps, None elsewhere."""
        if step not in self.ctx["eval_steps"]:
            return {"heldout_reward": None}
        start = time.perf_counter()
        args = self.ctx["args"]
        value = heldout_reward(
            model, self.ctx["tokenizer"], self.ctx["task"], self.ctx["heldout"], args.max_completion_length
        )
        return {"heldout_reward": value, "eval_s": round(time.perf_counter() - start, 3)}

    def counters(self) -> dict[str, Any] | None:
        """patch_generate's design and cumulative counters (None where vLLM generates)."""
        if self.handle is None:
            return None
        stats = self.handle.generator.stats
        names = ("calls", "groups", "members", "unsampleable", "copies_only_calls")
        return {"method": self.handle.generator.method, **{k: getattr(stats, k) for k in names}}

    def report(self, r: dict[str, Any]) -> None:
        """One progress line; unsampleable rows and copies-only calls are named, never silent."""
        args = self.ctx["args"]
        where = f"{r['design']} seed {r['seed']} step {r['step']}/{args.steps}"
        parts = []
        if "reward_mean" in r:
            parts.append(
                f"reward {r['reward_mean']:.3f}, zero-var {r['zero_var_share']:.2f}, "
                f"distinct {r['distinct_per_group']:.2f}/{args.generations}, {r['tokens']} tokens, "
                f"{r['wall_s']:.1f} s ({r['cpu_s']:.1f} s CPU)"
            )
        if r["heldout_reward"] is not None:
            parts.append(f"held-out {r['heldout_reward']:.3f} ({r['eval_s']:.1f} s)")
        qmc = r["qmc"] or {}
        if qmc.get("unsampleable") or qmc.get("copies_only_calls"):
            parts.append(
                f"WARNING unsampleable row-steps {qmc['unsampleable']}, copies-only calls {qmc['copies_only_calls']}"
            )
        print(f"{where}: {'; '.join(parts)}", flush=True)


def grpo_config(args: argparse.Namespace, design: str, seed: int, output_dir: str) -> Any:
    """TRL's config: one generation of ``prompts × G`` rollouts per optimizer step, the run's seed."""
    from trl import GRPOConfig

    vllm: dict[str, Any] = {}
    # qmc_seed here is the run's seed; vllm_step_seed replaces it before every step's generation.
    if args.use_vllm == "server":
        # docs/integrations.md, "TRL GRPO with vLLM": per-run settings travel in vllm_xargs.
        vllm = dict(
            use_vllm=True,
            vllm_mode="server",
            generation_kwargs={"vllm_xargs": {"qmc_method": design, "qmc_seed": seed}},
        )
    elif args.use_vllm == "colocate":
        os.environ["QMC_SAMPLER"] = design  # read when the colocated engine starts (this trainer's)
        vllm = dict(
            use_vllm=True,
            vllm_mode="colocate",
            generation_kwargs={"extra_args": {"qmc_method": design, "qmc_seed": seed}},
        )
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts * args.generations,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",  # a short run: the same step size throughout, for every design
        temperature=args.temperature,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=seed,
        use_cpu=args.use_vllm is None,
        bf16=False,
        disable_tqdm=True,
        **vllm,
    )


def vllm_step_seed(generation_kwargs: dict[str, Any], mode: str, seed: int, call: int) -> None:
    """Give generation ``call`` (0 before the first optimizer step, 1 before the second, …) of a
    vLLM run a group seed of its own, written into the ``generation_kwargs`` that TRL 1.16's
    ``VLLMGeneration.generate`` reads at each generation (``trainer.vllm_generation``).

    Server mode: TRL sends one request per step, with every prompt; the plugin seeds prompt
    i's group from (``qmc_seed``, i) (``vllm_plugin/request_args.py``, ``prompt_seed``), so a
    seed fixed for the run gave slot i the same uniforms at every step (i.i.d. not i.i.d.).
    Colocate mode: the auto groups are keyed by the prompt's tokens and ``qmc_seed``, so the
    prompts of one step never share a seed, but a prompt drawn again at a later step, once its
    group expired, would draw its members 0 … G−1 with the same uniforms again; a seed per
    step makes each step's G copies of a prompt a group of their own there too.

    The seed is patch_generate's seed of a generate call (``counter_seed(seed, HF_CALL_SEED,
    rank 0, call)``, hf/generate.py): the CPU path's call seeds, so both paths pair designs by
    the same per-step seeds. Untested here (no GPU).
    """
    from qmc_sampler.counter_rng import Purpose, counter_seed

    key = "vllm_xargs" if mode == "server" else "extra_args"
    generation_kwargs[key]["qmc_seed"] = counter_seed(seed, Purpose.HF_CALL_SEED, 0, call)


def run_one(args: argparse.Namespace, design: str, seed: int, ctx: dict[str, Any]) -> int:
    """Train one (design, seed) run from the model's own weights, writing its lines and ``end`` line.

    Returns:
        The warnings its reward function printed (:meth:`Recorder.warn`).
    """
    import tempfile

    import torch
    from datasets import Dataset
    from qmc_sampler.hf import patch_generate
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ctx["model_dir"], dtype=torch.float32)
    rows = [
        {"prompt": pr.messages if pr.messages is not None else pr.prompt, "problem_id": pr.problem_id}
        for pr in ctx["train"]
    ]
    ctx = ctx | {"design": design, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="grpo-steps-") as scratch:
        config = grpo_config(args, design, seed, scratch)
        recorder = Recorder(ctx, None)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=recorder,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=ctx["train_tokenizer"],
        )
        # The design is the only difference between runs: i.i.d. through the same patched path.
        recorder.handle = None if args.use_vllm else patch_generate(trainer.model, design, seed=seed)

        class Steps(TrainerCallback):
            """The Trainer's hooks around each optimizer step: the recorder's clocks and line, and
            with vLLM the step's group seed (set before the step's generation, which TRL runs
            inside the step)."""

            def on_step_begin(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
                """Start the step; with vLLM, give its generation a seed of its own."""
                recorder.on_step_begin()
                if args.use_vllm:
                    generation_kwargs = trainer.vllm_generation.generation_kwargs
                    vllm_step_seed(generation_kwargs, args.use_vllm, seed, state.global_step)

            def on_step_end(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
                """Write the finished step's line (``state.global_step`` counts it)."""
                recorder.on_step_end(state.global_step, kw["model"])

        recorder.pending = {}
        recorder.on_step_end(0, trainer.model)  # step 0: the held-out reward before training
        trainer.add_callback(Steps())
        trainer.remove_callback(PrinterCallback)  # TRL's per-step dict; this script prints its own line
        try:
            trainer.train()
        finally:
            if recorder.handle is not None:
                recorder.handle.restore()
    end = {
        "type": END,
        "design": design,
        "seed": seed,
        "wall_s": round(time.perf_counter() - start, 3),
        "qmc": recorder.counters(),
    }
    append(ctx["path"], end)
    return recorder.warnings


# ---------------------------------------------------------------- the comparison, the table, the plot


def curves(records: list[dict[str, Any]], designs: list[str], seeds: list[int]) -> dict[str, dict[int, dict]]:
    """design → seed → {"steps": [...], "train": [...], "heldout": {step: reward}} from finished runs."""
    finished = {(r["design"], r["seed"]) for r in records if r.get("type") == END}
    out: dict[str, dict[int, dict]] = {d: {} for d in designs}
    for r in records:
        if r.get("type") != STEP or (r["design"], r["seed"]) not in finished or r["design"] not in out:
            continue
        run = out[r["design"]].setdefault(r["seed"], {"steps": [], "rows": [], "heldout": {}})
        if "reward_mean" in r:
            run["steps"].append(r["step"])
            run["rows"].append(r)
        if r["heldout_reward"] is not None:
            run["heldout"][r["step"]] = r["heldout_reward"]
    return out


def auc(heldout: dict[int, float], steps: int) -> float:
    """Trapezoid area under the held-out curve over [0, steps], divided by steps (a mean reward)."""
    xs = sorted(heldout)
    ys = [heldout[x] for x in xs]
    return float(np.sum((np.diff(xs)) * (np.array(ys[1:]) + np.array(ys[:-1])) / 2) / steps)


def bootstrap(diffs: np.ndarray, rng: np.random.Generator) -> tuple[float, float] | None:
    """The percentile bootstrap interval (percentiles (1 ∓ :data:`LEVEL`)/2) of the mean of
    ``diffs`` over seeds; None with fewer than 2 seeds (no interval to give). Descriptive only:
    with a few seeds it is about [min, max] of the differences and covers far less than LEVEL."""
    if len(diffs) < 2:
        return None
    means = diffs[rng.integers(0, len(diffs), (BOOTSTRAP, len(diffs)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def sign_flip_p(diffs: np.ndarray) -> float | None:
    """The exact two-sided sign-flip permutation p-value of the mean of paired differences: the
    share of the 2^n sign patterns of the n differences (the observed one included) whose mean
    is at least as far from 0 as the observed mean. Its least value is 2 / 2^n (0.25 with 3
    seeds). None with more than 20 differences (2^n patterns too many to list)."""
    n = len(diffs)
    if n > 20:
        return None
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    means = np.abs((signs * diffs).mean(axis=1))
    return float(np.mean(means >= abs(diffs.mean()) - 1e-12))


def reach_step(heldout: dict[int, float], target: float) -> int | None:
    """The first evaluation step whose held-out reward is at least ``target`` (None: never)."""
    return next((s for s in sorted(heldout) if heldout[s] >= target - 1e-12), None)


def table(runs: dict[str, dict[int, dict]], steps: int) -> str:
    """Per design, means over seeds: final and mean held-out reward, training figures, cost."""
    head = (
        f"{'design':>10}  {'seeds':>5}  {'final held-out':>14}  {'held-out AUC':>12}  {'train reward':>12}  "
        f"{'zero-var':>8}  {'distinct/group':>14}  {'tokens/step':>11}  {'s/step':>6}  {'CPU s/step':>10}"
    )
    lines = [head, "-" * len(head)]
    for design, by_seed in runs.items():
        if not by_seed:
            continue
        rows = [row for run in by_seed.values() for row in run["rows"]]
        final = np.mean([run["heldout"][steps] for run in by_seed.values()])
        area = np.mean([auc(run["heldout"], steps) for run in by_seed.values()])
        mean = {
            k: np.mean([row[k] for row in rows])
            for k in ("reward_mean", "zero_var_share", "distinct_per_group", "tokens", "wall_s", "cpu_s")
        }
        lines.append(
            f"{design:>10}  {len(by_seed):>5}  {final:14.3f}  {area:12.3f}  {mean['reward_mean']:12.3f}  "
            f"{mean['zero_var_share']:8.3f}  {mean['distinct_per_group']:14.2f}  {mean['tokens']:11.0f}  "
            f"{mean['wall_s']:6.1f}  {mean['cpu_s']:10.1f}"
        )
    return "\n".join(lines)


def comparison(runs: dict[str, dict[int, dict]], steps: int) -> str:
    """The pre-registered comparison of each design with iid, paired by seed (module docstring)."""
    lines = []
    base = runs["iid"]
    for design, by_seed in runs.items():
        if design == "iid":
            continue
        seeds = sorted(set(base) & set(by_seed))
        if not seeds:
            lines.append(f"{design} − iid: no seed finished for both")
            continue
        rng = np.random.default_rng(0)  # the same resamples on every rerun
        for name, value in (
            ("final held-out reward", lambda run: run["heldout"][steps]),
            ("held-out AUC", lambda run: auc(run["heldout"], steps)),
        ):
            diffs = np.array([value(by_seed[s]) - value(base[s]) for s in seeds])
            ci = bootstrap(diffs, rng)
            n = f"{len(seeds)} seed{'s' * (len(seeds) > 1)}"
            p_value = sign_flip_p(diffs)
            test = (
                f"exact sign-flip p = {p_value:.3f} (two-sided, 2^{len(seeds)} flips; least possible "
                f"{2 / 2 ** len(seeds):.3f})"
                if p_value is not None
                else "sign-flip p not computed (over 20 seeds)"
            )
            where = (
                f"descriptive percentile bootstrap [{ci[0]:+.3f}, {ci[1]:+.3f}], not a {LEVEL:.0%} interval"
                if ci
                else "no interval with 1 seed"
            )
            per_seed = ", ".join(f"{d:+.3f}" for d in diffs)
            lines.append(f"{design} − iid, {name}: {diffs.mean():+.3f} over {n} ({test}; {where}; per seed {per_seed})")
        shown = []
        for s in seeds:
            target = base[s]["heldout"][steps]
            if target <= base[s]["heldout"][0] + 1e-12:  # nothing to reach: the design's step 0 is as good
                shown.append("iid did not improve")
            else:
                reached = reach_step(by_seed[s]["heldout"], target)
                shown.append("-" if reached is None else str(reached))
        lines.append(f"{design}: steps to reach iid's final held-out reward, per seed (of {steps}): {', '.join(shown)}")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    """Training and held-out reward against step: mean over seeds, band from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for design, by_seed in runs.items():
        if not by_seed:
            continue
        for ax, pick in ((axes[0], "train"), (axes[1], "heldout")):
            if pick == "train":
                xs = next(iter(by_seed.values()))["steps"]
                ys = np.array([[row["reward_mean"] for row in run["rows"]] for run in by_seed.values()])
            else:
                xs = sorted(next(iter(by_seed.values()))["heldout"])
                ys = np.array([[run["heldout"][x] for x in xs] for run in by_seed.values()])
            (line,) = ax.plot(
                xs, ys.mean(axis=0), marker="o" if pick == "heldout" else None, label=f"{design} ({len(by_seed)} seeds)"
            )
            ax.fill_between(xs, ys.min(axis=0), ys.max(axis=0), color=line.get_color(), alpha=0.2)
    axes[0].set(title="training reward (rollouts of the step)", xlabel="step", ylabel="reward (mean over seeds)")
    axes[1].set(title="held-out reward (greedy)", xlabel="step")
    axes[1].legend(title="band: min–max over seeds")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(path: Path, args: argparse.Namespace) -> None:
    """Print the table and the paired comparison, and draw the plot, from the file's finished runs."""
    records, _ = read_lines(path)
    runs = curves(records, args.designs, list(range(args.seeds)))
    header = records[0]
    title = (
        f"{header['cpu']}; model {args.model or 'SmolLM2-135M-Instruct'}, {args.task}, G = {args.generations}, "
        f"{args.prompts} prompts/step, lr {args.learning_rate:g}, {args.heldout} held-out problems"
    )
    print(f"\n{title}\n{table(runs, args.steps)}\n\n{comparison(runs, args.steps)}")
    plot(runs, path.with_name("reward.png"), title)
    print(f"plot: {path.with_name('reward.png')}; lines: {path}", flush=True)


VLLM_WARNING = (
    "WARNING --use-vllm {mode} (untested): this script cannot see vLLM's engine, so it cannot check that the "
    "qmc-sampler plugin made groups; without it both designs run vLLM's own i.i.d. sampling, silently. Check the "
    "engine's log (the plugin logs once which interface it serves) and its plugin_stats "
    "(qmc_sampler.vllm_plugin.processor.plugin_stats through LLM.collective_rpc, or qmc-serve's GET /stats; "
    "docs/serving.md): admitted_by_design must count members of both designs"
)


def main(argv: list[str] | None = None) -> int:
    """Run the missing (design, seed) runs (or ``--only``'s), seed by seed, then report. Returns the exit code."""
    args, p = parse_args(argv)
    from qmc_sampler.eval.tasks.catalog import get_task

    try:
        task = get_task(args.task)
    except ValueError as e:
        p.error(f"--task: {e}")
    train, heldout = split_problems(task, args, p)  # before the file: a refusal writes nothing
    path = Path(args.out) / "steps.jsonl"
    finished = open_results(path, identity(args), p)
    runs = [args.only] if args.only else [(d, s) for s in range(args.seeds) for d in args.designs]
    todo = [run for run in runs if run not in finished]
    if todo:
        from transformers import AutoTokenizer

        from qmc_sampler.models import resolve_model

        if args.use_vllm:
            print(VLLM_WARNING.format(mode=args.use_vllm), flush=True)
        model_dir = resolve_model(args.model)
        print(
            f"{read_lines(path)[0][0]['cpu']}; {len(train)} training prompts, {len(heldout)} held-out; "
            f"runs to do: {len(todo)} of {len(args.designs) * args.seeds}",
            flush=True,
        )
        ctx = {
            "path": path,
            "task": task,
            "args": args,
            "model_dir": model_dir,
            "heldout": heldout,
            "train": train,
            "by_id": {pr.problem_id: pr for pr in train},
            "eval_steps": eval_steps(args.steps, args.eval_every),
            "tokenizer": AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
            "train_tokenizer": AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
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
    report(path, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
