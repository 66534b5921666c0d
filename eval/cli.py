"""``qmc-eval``: run pass@k evaluations and score them.

    qmc-eval run --task T|jsonl:PATH --samplers iid,lattice,sobol --n 64 --groups R --problems P --out DIR
                 [--model DIR] [--dtype auto|bfloat16|float16|float32]
                 [--endpoint URL ...] [--served-model NAME] [--api-key KEY] [--concurrency 32]
                 [--ray [ADDRESS]] [--replicas 2] [--ray-device auto|cpu|gpu]
                 [--temperature 1.0] [--top-p 1] [--top-k 0] [--min-p 0] [--max-tokens M] [--seed S]
                 [--order id|sorted] [--task-option key=value ...]
                 [--until-correct K [--round-size 8]]   (sample in rounds to K correct; --n is the cap)
    qmc-eval score DIR [--json] [--plot out.png] [--k 1,2,4]
    qmc-eval passk FILE.jsonl [--json] [--plot out.png] [--k 1,2,4]

Bad input prints one line naming the problem (file and line for samples files)
and exits with code 2.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from qmc_sampler.eval.reports.passk_report import as_json, format_table, plot, summarize
from qmc_sampler.eval.runs.samples import SampleFileError, correct_arrays, read_samples
from qmc_sampler.eval.tasks.catalog import JSONL_PREFIX, TASKS

from qmc_sampler.cpu_defaults import DTYPES
from qmc_sampler.designs import METHODS
from qmc_sampler.limits import positive_int

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"qmc-eval: error: {message}\n")
    raise SystemExit(2)


def _samplers(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    for name in names:
        if name not in METHODS:
            raise argparse.ArgumentTypeError(f"unknown sampler {name!r}; use some of {list(METHODS)}")
    if not names:
        raise argparse.ArgumentTypeError("give at least one sampler")
    return names


def _task(text: str) -> str:
    if text in TASKS or (text.startswith(JSONL_PREFIX) and len(text) > len(JSONL_PREFIX)):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a task; use one of {', '.join(TASKS)}, or jsonl:PATH")


def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k {text!r} must be a comma-separated list of integers") from None
    if ks[0] < 1:
        raise argparse.ArgumentTypeError(f"--k values must be >= 1, got {ks[0]}")
    return ks


def _task_option(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--task-option {text!r} must look like key=value")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key, value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qmc-eval", description="pass@k evaluation of correlated samplers")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="generate and score groups of samples")
    run.add_argument(
        "--task", required=True, type=_task, metavar="TASK", help=f"one of {', '.join(TASKS)}, or jsonl:PATH"
    )
    run.add_argument("--samplers", type=_samplers, default=("iid", "lattice"), help="comma-separated designs")
    run.add_argument("--n", type=positive_int, default=64, help="group size N")
    run.add_argument("--groups", type=positive_int, default=1, help="groups per problem and sampler")
    run.add_argument("--problems", type=positive_int, default=50)
    run.add_argument("--out", required=True, help="output folder (resumed if it exists)")
    run.add_argument("--model", default=None, help="a local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    run.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="engine dtype; auto: bf16 where the CPU has native bf16, else float32 (GPUs: the model's)",
    )
    fleet = run.add_argument_group("served models (instead of an in-process engine)")
    fleet.add_argument(
        "--endpoint", action="append", default=[], metavar="URL", help="an OpenAI-compatible server (repeatable)"
    )
    fleet.add_argument("--served-model", default=None, help="the model name the endpoints serve (default: theirs)")
    fleet.add_argument("--api-key", default=None, help="Bearer key for the endpoints (or set $QMC_EVAL_API_KEY)")
    fleet.add_argument("--concurrency", type=positive_int, default=None, help="member requests in flight (32)")
    cluster = run.add_argument_group("a Ray cluster (instead of an in-process engine)")
    cluster.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="generate through Ray Data's vLLM stage on --replicas engines; ADDRESS: a running cluster "
        "(auto, HOST:6379, ray://HOST:10001), none: a local cluster on this machine",
    )
    cluster.add_argument(
        "--replicas", type=positive_int, default=None, help="vLLM engines on the Ray cluster (default 2)"
    )
    cluster.add_argument(
        "--ray-device",
        choices=("auto", "cpu", "gpu"),
        default=None,
        help="where the replicas run: auto (default): GPUs where the cluster has any; cpu: CPU replicas anyway",
    )
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--max-tokens", type=positive_int, default=None)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--order", choices=("id", "sorted"), default="id")
    run.add_argument(
        "--task-option",
        type=_task_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="generator setting, e.g. min_digits=2 (repeatable)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    until = run.add_argument_group("sample until verified (--n is the cap)")
    until.add_argument("--until-correct", type=positive_int, default=None, metavar="K",
                       help="grow each problem's group in rounds until K members are correct, or --n")  # fmt: skip
    until.add_argument("--round-size", type=positive_int, default=None, metavar="R", help="members per round (8)")
    for name, what in (("score", "an output folder of `qmc-eval run`"), ("passk", "a samples JSONL file")):
        p = sub.add_parser(name, help=f"pass@k table of {what}")
        p.add_argument("source", help=what)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.add_argument("--plot", default=None, metavar="PNG", help="also draw pass@k vs k to this file")
        p.add_argument("--k", type=_ks, default=None, help="comma-separated k (default: powers of two up to N)")
        p.add_argument("--resamples", type=positive_int, default=2000, help="bootstrap replicates")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from qmc_sampler.eval.runs.runner import RunConfig, RunError, check_resumable, run
    from qmc_sampler.eval.tasks.catalog import get_task

    from qmc_sampler.reference import validate_sampling

    # Every option first, alone and together: a bad one costs no model conversion, engine, endpoint
    # request or cluster (tests/eval/test_cli.py runs each case with an empty model cache).
    try:
        validate_sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    except ValueError as e:
        _fail(
            str(e)
            .replace("top_k", "--top-k")
            .replace("top_p", "--top-p")
            .replace("min_p", "--min-p")
            .replace("temperature", "--temperature", 1)
        )
    for option, value in (("--replicas", args.replicas), ("--ray-device", args.ray_device)):
        if value is not None and args.ray is None:
            _fail(f"{option}: give --ray too (the replicas are vLLM engines on a Ray cluster)")
    if args.ray is not None and args.endpoint:
        _fail("--ray: give either --ray or --endpoint (Ray starts its own engines; --endpoint uses running servers)")
    if args.endpoint and args.model is not None:
        _fail("--model runs an in-process engine; with --endpoint, name the served model with --served-model")
    for option, value in (("--served-model", args.served_model), ("--api-key", args.api_key),
                          ("--concurrency", args.concurrency)):  # fmt: skip
        if value is not None and not args.endpoint:
            _fail(f"{option}: give --endpoint too ({option} applies to served models only)")
    _check_until(args)
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        _fail(f"--model {args.model!r} is not a Hugging Face model folder (no config.json)")
    try:
        task = get_task(args.task, **dict(args.task_option))
        task.problems(args.problems, args.seed)  # a generator's options are taken only here
    except TypeError as e:  # a --task-option the task does not take
        _fail(f"--task-option: {e}")
    except ValueError as e:  # a bad task file ("PATH:LINE: …") or verifier
        _fail(str(e))
    except AssertionError as e:  # reasoning-gym checks its generators' settings with asserts
        _fail(f"--task-option: {str(e) or 'the task refuses these settings'}")
    config = RunConfig(
        task=args.task,
        samplers=args.samplers,
        n=args.n,
        groups=args.groups,
        problems=args.problems,
        out=args.out,
        model=args.model,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        order=args.order,
        task_options=dict(args.task_option),
        dtype=args.dtype,
        until_correct=args.until_correct,
        round_size=args.round_size,
    )
    try:  # with endpoints the run's model is the served one, compared once they answer
        check_resumable(config, ignore=("model",) if args.endpoint else ())
    except RunError as e:
        _fail(str(e))
    # Then the backend: endpoints are asked, a cluster joined, and only then a model converted.
    backend = None
    if args.endpoint:
        from qmc_sampler.eval.backends.endpoints import EndpointBackend, EndpointError

        api_key = args.api_key or os.environ.get("QMC_EVAL_API_KEY")
        backend = EndpointBackend(args.endpoint, args.served_model, api_key, args.concurrency or 32)
        try:
            where = backend.connect()
            config = dataclasses.replace(config, model=backend.model)
            check_resumable(config)
        except (EndpointError, RunError) as e:
            _fail(str(e))
    if args.ray is not None:
        from qmc_sampler.eval.backends.ray_backend import DEFAULT_REPLICAS, RayBackend

        # args.model None: the default model, converted by connect() once the cluster has been checked.
        replicas, device = args.replicas or DEFAULT_REPLICAS, args.ray_device or "auto"
        backend = RayBackend(args.model, args.ray or None, replicas, args.dtype, device=device)
    from qmc_sampler.eval.console import engine_output_to

    log = Path(args.out) / "engine.log"
    if args.ray is not None:
        return _run_on_ray(config, backend, task, log, progress=not args.quiet)
    try:
        if backend is not None:
            print(where, flush=True)
            out = run(config, backend=backend, task=task, progress=not args.quiet)
        else:
            # vLLM's own output goes to the log; the progress bar and the table stay readable.
            with engine_output_to(log) as console:
                out = run(config, task=task, progress=not args.quiet, console=console)
    except (RunError, SampleFileError) as e:
        _fail(str(e))
    except RuntimeError as e:  # EndpointError: a request failed for good
        _fail(str(e))
    if backend is not None:
        print(f"{backend.retries} requests retried (connection errors, 429, 5xx)")
    print(_table(read_samples(out / "samples.jsonl"), str(out)))
    print(f"\nsamples: {out / 'samples.jsonl'}" + ("" if backend is not None else f" (vLLM's log: {log})"))
    return 0


def _run_on_ray(config: Any, backend: Any, task: Any, log: Path, progress: bool) -> int:
    """``run --ray``: Ray's and vLLM's output go to ``log``, the progress bar and the table stay readable."""
    from qmc_sampler.eval.backends.ray_backend import RayBackendError
    from qmc_sampler.eval.console import engine_output_to
    from qmc_sampler.eval.runs.runner import RunError, run

    failure = None
    try:
        with engine_output_to(log) as console:
            try:
                console.print(backend.connect())
            except RayBackendError as e:  # a bad --ray or --replicas: one line, not the log's tail
                failure = str(e)
            else:
                out = run(config, backend=backend, task=task, progress=progress, console=console)
            finally:
                backend.close()  # a local cluster stops here, its output still going to the log
    except (RunError, SampleFileError, RayBackendError) as e:  # the log's tail is shown above it
        failure = str(e)
    if failure is not None:
        _fail(failure)
    rows = ", ".join(str(r) for r in backend.engine_rows) or "none (nothing left to generate)"
    print(f"rows per vLLM engine: {rows}; duplicates dropped: {backend.duplicates}")
    print(format_table(summarize(correct_arrays(read_samples(out / "samples.jsonl"), source=str(out)))))
    print(f"\nsamples: {out / 'samples.jsonl'} (Ray's and vLLM's log: {log})")
    return 0


def _check_until(args: argparse.Namespace) -> None:
    """``--until-correct``'s options, alone and with the others (one line, exit code 2)."""
    from qmc_sampler.eval.runs.runner import ROUND_SIZE
    from qmc_sampler.eval.runs.sequential import check_until, sequential_designs

    if args.until_correct is None:
        if args.round_size is not None:
            _fail("--round-size: give --until-correct too (rounds are how a sequential run grows its groups)")
        return
    if args.ray is not None:
        _fail(
            "--until-correct: not with --ray (Ray's stage runs whole groups); use the in-process engine or --endpoint"
        )
    for sampler in args.samplers:
        if sampler not in sequential_designs():
            _fail(
                f"--samplers: {sampler!r} cannot grow in rounds (--until-correct); use some of {sequential_designs()}"
            )
    try:
        check_until(args.until_correct, args.n, args.round_size or ROUND_SIZE, args.samplers[0])
    except ValueError as e:
        _fail(
            str(e).replace("want=", "--until-correct ").replace("cap=", "--n ").replace("round_size=", "--round-size ")
        )


def _table(records: list[dict[str, Any]], source: str) -> str:
    from qmc_sampler.eval.reports.until_report import format_until, is_until, summarize_until

    if is_until(records):
        return format_until(summarize_until(records))
    return format_table(summarize(correct_arrays(records, source=source)))


def _cmd_report(args: argparse.Namespace) -> int:
    source = Path(args.source)
    path = source / "samples.jsonl" if args.command == "score" else source
    if args.command == "score" and not source.is_dir():
        _fail(f"{source} is not an output folder of `qmc-eval run`")
    if not path.is_file():
        _fail(f"{path} does not exist")
    from qmc_sampler.eval.reports.until_report import format_until, is_until, summarize_until, until_as_json

    try:
        records = read_samples(path)
        if is_until(records):  # a run of --until-correct: samples to K correct, not pass@k
            if args.k or args.plot:
                _fail(
                    f"{'--k' if args.k else '--plot'}: {path} is a sequential run (--until-correct); it has no pass@k"
                )
            until = summarize_until(records, args.resamples)
            print(json.dumps(until_as_json(until), indent=2) if args.json else format_until(until))
            return 0
        reports = summarize(correct_arrays(records, source=str(path)), args.k, args.resamples)
    except SampleFileError as e:
        _fail(str(e))
    if not reports:
        _fail(f"{path} holds no samples")
    if args.json:
        print(json.dumps(as_json(reports), indent=2))
    else:
        print(format_table(reports))
    if args.plot:
        plot(reports, args.plot, title=str(source))
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qmc-eval`` console script."""
    args = _parser().parse_args(argv)
    # vLLM's INFO lines would bury the progress bar and the table; users can set it back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.command == "run":
        return _cmd_run(args)
    return _cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
