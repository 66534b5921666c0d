"""``qmc-eval run``: sample groups with vLLM (plugin in the engine), score them, write JSONL.

Every (sampler, problem, group) is one group of ``n`` members, each sent as its
own request with explicit plugin arguments (:mod:`qmc_sampler.eval.backends.generation`),
so member i is recorded as member i of the design — not by the order in which
an engine happened to return it. The i.i.d. baseline goes through the same
processor (design ``iid``), so every sampler's samples are reproducible from
the group seed, which depends only on (run seed, task, problem, group): all
samplers see the same seeds.

Results are appended group by group as groups complete
(:mod:`qmc_sampler.eval.runs.samples`); a rerun with the same ``--out`` resumes,
skipping finished groups. ``run.json`` records the settings and a rerun with
different settings is refused. Before sampling, the engine is checked to run the
plugin: results labelled ``lattice`` from an engine without it would be i.i.d.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import Any

from qmc_sampler.eval.backends.generation import Completion, DrawFailedError, GroupJob, InProcessBackend
from qmc_sampler.eval.runs.samples import append_group, read_samples
from qmc_sampler.eval.tasks.catalog import Problem, Task, get_task

from qmc_sampler import __version__
from qmc_sampler.counter_rng import keyed_seed

__all__ = ["RunConfig", "RunError", "build_engine", "check_resumable", "group_seed", "run", "shutdown_engine"]

SAMPLES = "samples.jsonl"
SETTINGS = "run.json"
#: Members per round of ``--until-correct`` when ``--round-size`` is not given.
ROUND_SIZE = 8


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
    dtype: str = "auto"  # the engine's dtype (qmc_sampler.cpu_defaults.engine_dtype)
    max_members_in_flight: int = 512  # member requests in the engine at once
    until_correct: int | None = None  # sample in rounds until this many are correct (n: the cap)
    round_size: int | None = None  # members per round of a sequential run (default ROUND_SIZE)

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share (not where it writes or how it schedules) and the
        qmc-sampler release that draws its groups (``release``), as JSON types."""
        d = asdict(self)
        for key in ("out", "max_members_in_flight"):
            d.pop(key)
        d["release"] = __version__  # a release may draw other groups from the same seeds: never mixed in one run
        return json.loads(json.dumps(d))


def group_seed(run_seed: int, task: str, problem: int | str, group: int) -> int:
    """A 63-bit group seed from (run seed, task, problem, group), the same for every sampler
    (:func:`~qmc_sampler.counter_rng.keyed_seed` of ``run seed|task|problem|group``)."""
    return keyed_seed(f"{run_seed}|{task}|{problem}|{group}")


def check_resumable(config: RunConfig, ignore: tuple[str, ...] = ()) -> None:
    """Refuse an ``--out`` that cannot hold this run, writing nothing (the CLI asks this before any model
    is converted, engine started or endpoint asked).

    Args:
        config: the run's settings.
        ignore: settings not known yet, left out of the comparison (``model`` before endpoints answer).

    Raises:
        RunError: ``config.out`` or a folder above it is a file or not writable, or its ``run.json`` is
            unreadable or records other settings.
    """
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} is a file; give a folder (created if missing, resumed if it holds a run)")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise RunError(f"--out {out}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(f"--out {out}: {existing} is not writable")
    settings = out / SETTINGS
    if not settings.is_file():
        return
    try:
        previous = json.loads(settings.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{settings} is not a run's settings file ({type(e).__name__}); use another --out") from None
    identity = {k: v for k, v in config.identity().items() if k not in ignore}
    if not isinstance(previous, dict):
        raise RunError(f"{settings} is not a run's settings file (not a JSON object); use another --out")
    changed = sorted({k for k in identity if previous.get(k) != identity[k]} | (set(previous) - set(config.identity())))
    if changed:
        why = (f" (made by qmc-sampler {previous.get('release', 'before 0.2.0')}, this is {__version__}: "
               f"another release may draw other groups; delete {out} to start again)" if "release" in changed else "")
        raise RunError(
            f"{out} holds a run with other settings ({', '.join(changed)} differ){why}; "
            "use another --out or the same settings to resume"
        )


def _prepare_out(config: RunConfig) -> tuple[Path, set[tuple[str, Any, int]]]:
    check_resumable(config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = out / SETTINGS
    if not settings.exists():
        settings.write_text(json.dumps(config.identity(), indent=2) + "\n")
    done: set[tuple[str, Any, int]] = set()
    samples = out / SAMPLES
    if samples.exists():
        counts: dict[tuple[str, int, int], int] = {}
        for r in read_samples(samples, repair=True):
            key = (r["sampler"], r["problem"], int(r["group"]))
            counts[key] = counts.get(key, 0) + 1
        done = {k for k, c in counts.items() if c == config.n}
    return out, done


def build_engine(model_dir: str, dtype: str = "auto") -> tuple[Any, str]:
    """A ``vllm.LLM`` for evaluation runs, with the CPU-aware defaults of :mod:`qmc_sampler.cpu_defaults`.

    Returns:
        The engine, and one phrase saying what runs where (for the console).

    Raises:
        RunError: the engine does not run the qmc-sampler plugin.
    """
    import torch

    from qmc_sampler.cpu_defaults import cpu_engine_env, engine_block_size, engine_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen, why = engine_dtype(dtype, device, model_dir)
    if device == "cpu":
        os.environ.update(cpu_engine_env())
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from qmc_sampler.vllm_engine.checks import require_plugin
    from vllm import LLM

    block_size = engine_block_size(device_type=device)  # CPU: groups share their prompt's KV blocks
    blocks = {"block_size": block_size} if block_size is not None else {}
    llm = LLM(model=model_dir, enforce_eager=True, seed=0, dtype=chosen, **blocks)
    try:
        require_plugin(llm)
    except RuntimeError as e:
        raise RunError(str(e)) from None
    cores = len(os.sched_getaffinity(0))
    where = f"vLLM on {device.upper()} ({cores} cores), {chosen}: {why}" if device == "cpu" else f"vLLM on {device}"
    return llm, where


def jobs_for(config: RunConfig, task: Task, problems: list[Problem], done: set[tuple[str, Any, int]]) -> list[GroupJob]:
    """The groups of the run that are not in the samples file yet, sampler by sampler."""
    sampling = {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "min_p": config.min_p,
        "max_tokens": config.max_tokens or task.max_tokens,
        "stop": list(task.stop),
    }
    return [
        GroupJob(
            key=(sampler, p.problem_id, g),
            messages=p.messages,
            prompt=p.prompt,
            n=config.n,
            seed=group_seed(config.seed, config.task, p.problem_id, g),
            method=sampler,
            order=config.order,
            sampling=sampling,
        )
        for sampler in config.samplers
        for p in problems
        for g in range(config.groups)
        if (sampler, p.problem_id, g) not in done
    ]


def run(
    config: RunConfig,
    *,
    engine: Any = None,
    backend: Any = None,
    task: Task | None = None,
    progress: bool = True,
    console: Any = None,
) -> Path:
    """Generate and score every missing group of the run; return the output folder.

    Args:
        config: the run's settings (validated by the CLI).
        engine: a ``vllm.LLM`` to reuse (tests share one); built from ``config.model`` otherwise.
        backend: where members are generated (default: :class:`InProcessBackend` on ``engine``;
            :class:`~qmc_sampler.eval.backends.endpoints.EndpointBackend` for served models).
        task: the task, if already built (default: from ``config``).
        progress: show a progress bar over groups (moves as each group completes, with an ETA).
        console: a :class:`qmc_sampler.eval.console.Console` for the bar (default: stderr).

    Raises:
        RunError: the engine does not run the plugin, or its draw failed while a group was generated
            (that group is not written; those written are exact, and the run resumes from them).
    """
    from tqdm import tqdm

    from qmc_sampler.models import resolve_model

    task = task or get_task(config.task, **config.task_options)
    out, done = _prepare_out(config)
    problems = task.problems(config.problems, config.seed)
    by_id = {p.problem_id: p for p in problems}
    todo = jobs_for(config, task, problems, done)
    bar = tqdm(
        total=len(config.samplers) * len(problems) * config.groups,
        initial=len(done),
        desc=f"{config.task} groups",
        unit="group",
        disable=not progress or config.until_correct is not None,  # rounds have their own bar
        file=None if console is None else console.err,
        dynamic_ncols=True,
    )
    with bar, contextlib.ExitStack() as stack:
        if not todo:
            return out
        if backend is None:
            if engine is None:
                engine, _ = build_engine(resolve_model(config.model), config.dtype)
                stack.callback(shutdown_engine, engine)
            else:
                from qmc_sampler.vllm_engine.checks import require_plugin

                require_plugin(engine)
            backend = InProcessBackend(engine, config.max_members_in_flight)

        def write(job: GroupJob, members: list[Completion]) -> None:
            sampler, problem_id, g = job.key
            append_group(out / SAMPLES, _records(config, task, sampler, by_id[problem_id], g, job.seed, members))
            bar.update(1)

        try:
            if config.until_correct is not None:
                _run_until(config, task, problems, backend, out, progress, console)
            else:
                backend.run(todo, write)
        except DrawFailedError as e:  # the groups written are exact; the run resumes once the engine draws
            raise RunError(str(e)) from None
    return out


def _run_until(
    config: RunConfig, task: Task, problems: list[Problem], backend: Any, out: Path, progress: bool, console: Any
) -> None:
    """``--until-correct K``: every (sampler, problem, group) is one group grown in rounds to K correct
    members or ``n`` (:mod:`qmc_sampler.eval.runs.sequential`, ``first`` mode), written round by round."""
    from qmc_sampler.eval.runs.sequential import run_rounds

    if not getattr(backend, "supports_rounds", False):
        raise RunError(f"--until-correct: the {type(backend).__name__} backend cannot generate rounds")
    templates = [dataclasses_replace(job, n=config.n) for job in jobs_for(config, task, problems, set())]
    by_id = {p.problem_id: p for p in problems}

    def score(template: GroupJob, text: str) -> dict[str, Any]:
        verdict = task.score(by_id[template.key[1]], text)
        return {"correct": verdict.correct, "failure": verdict.failure}

    settings = {"want": config.until_correct, "cap": config.n, "round_size": config.round_size or ROUND_SIZE,
                "mode": "first"}  # fmt: skip
    run_rounds(templates, backend, score, settings, out=out / SAMPLES, extra=lambda t: {"task": config.task},
               progress=progress, console=console)  # fmt: skip


def shutdown_engine(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s engine-core process now (not at interpreter exit)."""
    llm.llm_engine.engine_core.shutdown()


def _records(
    config: RunConfig, task: Task, sampler: str, problem: Problem, g: int, seed: int, members: list[Completion]
) -> list[dict]:
    records = []
    for member, completion in enumerate(members):
        text = completion.text
        verdict = task.score(problem, text)
        records.append(
            {
                "task": config.task,
                "problem": problem.problem_id,
                "sampler": sampler,
                "group": g,
                "group_seed": seed,
                "member": member,
                "n": config.n,
                "text": text,
                "finish_reason": completion.finish_reason,
                "score": verdict.correct,
                "failure": verdict.failure,
            }
        )
    return records
