"""``qmc-serve [MODEL] [vllm serve options] [--sampler lattice] [--max-n 128] [--max-members-in-flight 1024]
[--queue-timeout 0] [--max-body-bytes 1048576] [--kv-cache-gb N]``: ``vllm serve`` with the plugin and
:mod:`.middleware`. Defaults that differ: the embedded model, ``--shutdown-timeout 30``, and on a CPU
the measured CPU defaults (:mod:`qmc_sampler.cpu_defaults`, eager mode); ``QMC_SERVE_API_KEY`` works
as ``VLLM_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from qmc_sampler.designs import METHODS
from qmc_sampler.limits import positive_int

__all__ = ["main"]

API_KEY_ENV = "QMC_SERVE_API_KEY"
OPEN_INVOCATIONS_ENV = "QMC_SERVE_INVOCATIONS_WITHOUT_KEY"  # =1: as --invocations-without-key
MIDDLEWARE = "qmc_sampler.server.middleware.QMCServeMiddleware"
SHUTDOWN_TIMEOUT_S = 30


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds >= 0")
    return value


def _vllm_cli(name: str) -> Any:
    """vLLM's serve-argument function ``name`` (``make_arg_parser`` or ``validate_parsed_serve_args``),
    wherever this vLLM keeps it (:mod:`qmc_sampler.vllm_engine.compat`)."""
    from qmc_sampler.vllm_engine import compat

    touchpoint = {"make_arg_parser": "serve_cli_args", "validate_parsed_serve_args": "serve_validate_args"}[name]
    return compat.locate(touchpoint)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _version() -> str:
    from qmc_sampler import DISTRIBUTION, __version__

    return f"qmc-serve ({DISTRIBUTION} {__version__}) on vLLM {_vllm_version()}"


def _parser() -> Any:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class OneLineParser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:  # one line and exit code 2, not pages of vLLM's usage
            self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    make_arg_parser = _vllm_cli("make_arg_parser")

    parser = make_arg_parser(OneLineParser(
        prog="qmc-serve", description="vLLM's OpenAI-compatible server with correlated sampling groups (qmc-sampler)"
    ))  # fmt: skip
    ours = parser.add_argument_group("qmc-sampler")
    ours.add_argument("--version", action="version", version=_version())
    ours.add_argument("--sampler", choices=METHODS, default="lattice", help="design of requests that name none")
    ours.add_argument("--max-n", type=positive_int, default=128, help="largest n a request may ask for")
    ours.add_argument("--max-members-in-flight", type=positive_int, default=1024,
                      help="member requests (n × prompts) in the engines at once; beyond: 429")  # fmt: skip
    ours.add_argument("--queue-timeout", type=_seconds, default=0.0, help="seconds a request waits for room (then 429)")
    ours.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body")
    ours.add_argument("--invocations-without-key", action="store_true",
                      help="serve /invocations without the API key (authenticated in front, as SageMaker)")  # fmt: skip
    ours.add_argument("--kv-cache-gb", type=positive_int, default=None,
                      help="CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE)")  # fmt: skip
    parser.set_defaults(model=None, enforce_eager=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qmc-serve`` console script."""
    from qmc_sampler.vllm_engine import compat

    compat.locate("cli_env_setup")()
    parser = _parser()
    try:  # --config files and positional/--model conflicts are read here (ValueError, OSError)
        args = parser.parse_args(argv)
    except Exception as e:  # ValueError, OSError, a malformed YAML file: one line, not a traceback
        parser.error(str(e) or type(e).__name__)
    try:
        compat.locate("async_unfinished")
    except compat.TouchpointError as e:  # vLLM 0.24-0.28: refused at start, not a 500 on /stats and at shutdown
        parser.error(f"qmc-serve cannot run on vLLM {_vllm_version()}: {e}")
    _check_options(args, parser)
    _apply_defaults(args, parser)
    try:  # vLLM >= 0.31; older releases configure logging themselves
        compat.locate("configure_logging")(args)
    except compat.TouchpointError:
        pass
    compat.locate("serve_subcommand")(args)
    return 0


#: vLLM's other names for the dtypes of :data:`qmc_sampler.cpu_defaults.DTYPES`.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _check_options(args: Any, parser: Any) -> None:
    """Every check that needs no model, before the default model is converted or an engine started:
    vLLM's own (``validate_parsed_serve_args``, and the ``--headless`` rule it applies only later) and
    ours. A bad option exits with one line and code 2."""
    try:
        _vllm_cli("validate_parsed_serve_args")(args)
    except Exception as e:  # TypeError/ValueError, a missing --chat-template file, VLLMValidationError
        parser.error(str(e).removeprefix("Error: "))
    if getattr(args, "headless", False) and (getattr(args, "api_server_count", None) or 0) > 0:
        parser.error(f"--api-server-count={args.api_server_count} cannot be used with --headless")
    args.dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    import torch

    if args.kv_cache_gb is not None and torch.cuda.is_available():
        parser.error("--kv-cache-gb sizes the CPU KV cache; on a GPU use vLLM's --gpu-memory-utilization")


def _apply_defaults(args: Any, parser: Any) -> None:
    """qmc-serve's defaults where the user left vLLM's (see the module docstring); the plugin and middleware on."""
    import torch

    from qmc_sampler.cpu_defaults import cpu_engine_env, engine_block_size, engine_dtype
    from qmc_sampler.models import resolve_model

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.model is None:
        args.model = resolve_model(None)
        args.served_model_name = args.served_model_name or [os.path.basename(os.path.normpath(args.model))]
    args.model_tag = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    why = "vLLM's default"
    if device == "cpu":
        if os.path.isdir(args.model):
            try:
                args.dtype, why = engine_dtype(args.dtype, device, args.model)
            except ValueError as e:
                parser.error(f"--dtype: {e}")
        args.block_size = engine_block_size(args.block_size, device)
        os.environ.update(cpu_engine_env())
        if args.kv_cache_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.enforce_eager is None:
        args.enforce_eager = device == "cpu"  # torch.compile costs minutes on a CPU; CUDA graphs stay on a GPU
    if not (args.api_key or os.environ.get("VLLM_API_KEY")) and os.environ.get(API_KEY_ENV):
        os.environ["VLLM_API_KEY"] = os.environ[API_KEY_ENV]  # not on the command line, where `ps` shows it
    if os.environ.get(OPEN_INVOCATIONS_ENV) == "1":  # containers are configured through their environment
        args.invocations_without_key = True
    if args.api_key or os.environ.get("VLLM_API_KEY"):
        where = ("/generative_scoring needs it too; /invocations is open (--invocations-without-key)"
                 if args.invocations_without_key else "/invocations and /generative_scoring need it too")  # fmt: skip
        print(f"qmc-serve: API key set; {where}", flush=True)
    # The plugin's drop-in gives every route's sampled requests the server's design (auto groups of
    # n = 1 repeats, one group per n > 1 request), not only the two routes the middleware maps.
    from qmc_sampler.members.keys import ENV_METHOD

    if os.environ.get(ENV_METHOD, args.sampler) != args.sampler:
        print(f"qmc-serve: --sampler {args.sampler} replaces {ENV_METHOD}={os.environ[ENV_METHOD]}", flush=True)
    os.environ[ENV_METHOD] = args.sampler
    if MIDDLEWARE not in args.middleware:
        args.middleware = [*args.middleware, MIDDLEWARE]
    print(f"qmc-serve: {args.model} on {device} in {args.dtype} ({why}); default design {args.sampler}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
