"""One (design, seed) run of ``trl.GRPOTrainer``: its config, its reward function and step lines, its vLLM seeds."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from grpo.data import completion_text, cut, group_stats, grouped
from grpo.evaluation import heldout_reward
from grpo.plan import TRL_SETTINGS
from grpo.records import END, STEP, append
from grpo.stop import cut_generate_at_stop


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
        # Batches not shaped prompts × G, repeated calls in a step: printed, and counted in the end line.
        self.warnings = 0
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
        from qmc_sampler.eval.tasks.catalog import extract_answer

        task, by_id = self.ctx["task"], self.ctx["by_id"]
        texts = [cut(completion_text(c), task.stop) for c in completions]  # already cut by grpo.stop: a no-op
        rewards = [float(task.score(by_id[pid], t).correct) for pid, t in zip(problem_id, texts, strict=True)]
        answers = [extract_answer(t) for t in texts]
        self.pending = {
            "prompt_ids": list(dict.fromkeys(problem_id)),  # in the batch's order, each once
            "reward_mean": float(np.mean(rewards)),
            **group_stats(list(problem_id), rewards, completion_ids, answers),
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
                f"distinct {r['distinct_per_group']:.2f}/{args.generations} "
                f"({r['distinct_answers_per_group']:.2f} answers), {r['tokens']} tokens, "
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


def grpo_config(args: argparse.Namespace, design: str, seed: int, output_dir: str, stop: tuple[str, ...]) -> Any:
    """TRL's config: one generation of ``prompts × G`` rollouts per optimizer step, the run's seed,
    :data:`grpo.plan.TRL_SETTINGS`; with vLLM, rollouts cut at the task's ``stop`` strings by vLLM."""
    from trl import GRPOConfig

    vllm: dict[str, Any] = {}
    # qmc_seed here is the run's seed; vllm_step_seed replaces it before every step's generation.
    if args.use_vllm == "server":
        # docs/integrations.md, "TRL GRPO with vLLM": per-run settings travel in vllm_xargs.
        vllm = dict(
            use_vllm=True,
            vllm_mode="server",
            generation_kwargs={"vllm_xargs": {"qmc_method": design, "qmc_seed": seed}, "stop": list(stop)},
        )
    elif args.use_vllm == "colocate":
        os.environ["QMC_SAMPLER"] = design  # read when the colocated engine starts (this trainer's)
        vllm = dict(
            use_vllm=True,
            vllm_mode="colocate",
            generation_kwargs={"extra_args": {"qmc_method": design, "qmc_seed": seed}, "stop": list(stop)},
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
        **TRL_SETTINGS,
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


def rollout_seed(seed: int, stream: int) -> int:
    """The seed of a run's rollout uniforms: the training seed itself in stream 0; in stream k > 0 a
    counter-based hash of (seed, k), so that two streams of one design and training seed (the same
    prompts, in the same order) draw their rollouts independently — an A/A pair."""
    from qmc_sampler.counter_rng import stable_seed

    return seed if stream == 0 else stable_seed("grpo_steps rollout stream", seed, stream)


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
        config = grpo_config(args, design, seed, scratch, ctx["task"].stop)
        recorder = Recorder(ctx, None)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=recorder,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=ctx["train_tokenizer"],
        )
        # The design is the only difference between runs: i.i.d. through the same patched path.
        rollouts = rollout_seed(seed, args.rollout_stream)
        recorder.handle = None if args.use_vllm else patch_generate(trainer.model, design, seed=rollouts)
        # Rollouts end at the stop string, as the held-out evaluation's do (vLLM: its own ``stop``).
        uncut = None if args.use_vllm else cut_generate_at_stop(trainer.model, ctx["train_tokenizer"], ctx["task"].stop)

        class Steps(TrainerCallback):
            """The Trainer's hooks around each optimizer step: the recorder's clocks and line, and
            with vLLM the step's group seed (set before the step's generation, which TRL runs
            inside the step)."""

            def on_step_begin(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
                """Start the step; with vLLM, give its generation a seed of its own."""
                recorder.on_step_begin()
                if args.use_vllm:
                    generation_kwargs = trainer.vllm_generation.generation_kwargs
                    vllm_step_seed(generation_kwargs, args.use_vllm, rollouts, state.global_step)

            def on_step_end(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
                """Write the finished step's line (``state.global_step`` counts it)."""
                recorder.on_step_end(state.global_step, kw["model"])
                if state.global_step == args.save_at:
                    where = ctx["path"].parent / "checkpoints" / f"{design}-{seed}-step{args.save_at}"
                    kw["model"].save_pretrained(where)
                    ctx["train_tokenizer"].save_pretrained(where)
                    print(f"saved the weights after step {args.save_at} to {where}", flush=True)

        recorder.pending = {}
        recorder.on_step_end(0, trainer.model)  # step 0: the held-out reward before training
        trainer.add_callback(Steps())
        trainer.remove_callback(PrinterCallback)  # TRL's per-step dict; this script prints its own line
        try:
            trainer.train()
        finally:
            if uncut is not None:
                uncut()
            if recorder.handle is not None:
                recorder.handle.restore()
    from qmc_sampler.cpu_defaults import describe_cpu

    end = {
        "type": END,
        "design": design,
        "seed": seed,
        "cpu": describe_cpu(),  # a file's runs can come from several machines (sessions); the header names the first
        "wall_s": round(time.perf_counter() - start, 3),
        "qmc": recorder.counters(),
        "batch_warnings": recorder.warnings,
    }
    append(ctx["path"], end)
    return recorder.warnings
