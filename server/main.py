"""``qmc-serve``: the OpenAI-compatible server with correlated n > 1 groups.

    qmc-serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--sampler lattice] [--max-n 128]
              [--served-model-name NAME] [--max-model-len N] [--dtype auto] [--kv-cache-gb 2] [--block-size N]
              [--api-key KEY | $QMC_SERVE_API_KEY] [--max-body-bytes 1048576]
              [--max-members-in-flight 1024] [--queue-timeout 0] [--shutdown-timeout 30]
              [--logprobs-mode raw_logprobs] [--structured-outputs-config JSON]
              [--data-parallel-size N ...]

vLLM's ``AsyncLLM`` runs in-process (its engine cores in child processes) with
the plugin loaded through its entry point; the model defaults to the embedded
SmolLM2-135M-Instruct. Before serving, it checks that the engine runs the
plugin (else one line and exit code 1: it would label i.i.d. samples
``lattice``). On SIGTERM it stops accepting requests, lets running ones finish
for ``--shutdown-timeout`` seconds, aborts what is left (those responses end
properly, with ``finish_reason: "abort"``), and exits 0.

Data parallelism: ``--data-parallel-size N`` starts N engine cores behind vLLM's
load balancer; each choice of a response is its own member request with an
explicit index, so members of one group may run on different engines and the
group is unchanged. Multi-node: ``--data-parallel-size-local``,
``--data-parallel-address``, ``--data-parallel-rpc-port``,
``--data-parallel-start-rank`` as in ``vllm serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from qmc_sampler.cpu_defaults import DTYPES
from qmc_sampler.designs import METHODS

__all__ = ["main"]

API_KEY_ENV = "QMC_SERVE_API_KEY"
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
log = logging.getLogger("qmc_sampler.server")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qmc-serve", description="OpenAI-compatible server with correlated sampling groups")
    p.add_argument("--model", default=None, help="local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the `model` name clients use (default: folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--sampler", choices=METHODS, default="lattice", help="design for requests without `sampler`")
    p.add_argument("--max-n", type=_positive, default=128, help="largest n a request may ask for")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bf16 where the CPU has it natively, else float32"
    )
    p.add_argument("--kv-cache-gb", type=int, default=None, help="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--block-size", type=_positive, default=None, help="KV-cache block size in tokens (CPU default: 32)")
    p.add_argument("--no-enforce-eager", action="store_true", help="let vLLM compile (slower start)")
    p.add_argument("--api-key", default=None, help=f"require this Bearer key on /v1/* (or set ${API_KEY_ENV})")
    p.add_argument("--max-body-bytes", type=_positive, default=1 << 20, help="largest request body")
    p.add_argument("--max-members-in-flight", type=_positive, default=1024, help="member requests in the engine")
    p.add_argument("--queue-timeout", type=float, default=0.0, help="seconds a request waits for room before a 429")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs")
    p.add_argument("--structured-outputs-config", default=None, help="vLLM's structured-output engine settings (JSON)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (salts auto-grouped requests per replica)")
    dp = p.add_argument_group("data parallelism (as in vllm serve)")
    dp.add_argument("--data-parallel-size", type=_positive, default=1)
    dp.add_argument("--data-parallel-size-local", type=int, default=None)
    dp.add_argument("--data-parallel-address", default=None)
    dp.add_argument("--data-parallel-rpc-port", type=int, default=None)
    dp.add_argument("--data-parallel-start-rank", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qmc-serve`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    structured = None
    if args.structured_outputs_config is not None:
        from vllm.config import StructuredOutputsConfig

        try:
            structured = StructuredOutputsConfig(**json.loads(args.structured_outputs_config))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            reason = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
            parser.error(f"--structured-outputs-config: {reason}")
    if args.kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs

    from qmc_sampler.cpu_defaults import cpu_engine_env, engine_block_size, engine_dtype
    from qmc_sampler.models import resolve_model

    try:
        model = resolve_model(args.model)
    except ValueError as e:
        parser.error(str(e))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = engine_dtype(args.dtype, device, model)
    block_size = engine_block_size(args.block_size, device)  # CPU: members share their prompt's KV blocks
    if device == "cpu":
        os.environ.update(cpu_engine_env())
    dp = {
        k: v
        for k, v in {
            "data_parallel_size": args.data_parallel_size,
            "data_parallel_size_local": args.data_parallel_size_local,
            "data_parallel_address": args.data_parallel_address,
            "data_parallel_rpc_port": args.data_parallel_rpc_port,
            "data_parallel_start_rank": args.data_parallel_start_rank,
        }.items()
        if v is not None
    }
    engine_args = AsyncEngineArgs(
        model=model,
        dtype=dtype,
        max_model_len=args.max_model_len,
        enforce_eager=not args.no_enforce_eager,
        seed=args.seed,
        logprobs_mode=args.logprobs_mode,
        **({"block_size": block_size} if block_size is not None else {}),
        **dp,
        **({"structured_outputs_config": structured} if structured is not None else {}),
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(model))
    print(
        f"qmc-serve: {name} on {device} in {dtype} ({why}); data-parallel engines: {args.data_parallel_size}; "
        f"API key: {'required' if api_key else 'none'}",
        flush=True,
    )
    app = _outer_app(engine_args, args, name, api_key)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.shutdown_timeout
    )
    _graceful_server_class(app)(config).run()
    return 0


#: Seconds the responses of aborted members get to send their last chunk and ``[DONE]``.
_ABORT_FLUSH_S = 5.0


def _graceful_server_class(app: Any) -> type:
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn with a shutdown that ends every response properly.

        At the end of ``--shutdown-timeout`` the engine requests still running are
        aborted first, so their responses finish (``finish_reason: "abort"``, then
        ``[DONE]``) instead of being cut mid-body when uvicorn cancels their tasks;
        and SIGTERM is not re-raised after the shutdown (which would exit −15, not 0).
        """

        async def shutdown(self, sockets: Any = None) -> None:
            grace = self.config.timeout_graceful_shutdown
            if grace is None:  # wait for every response, however long
                await super().shutdown(sockets)
                return

            async def abort_when_time_is_up() -> None:
                await asyncio.sleep(grace)
                abort_all = getattr(app.state, "abort_all", None)
                if abort_all is not None:
                    await abort_all()

            watcher = asyncio.create_task(abort_when_time_is_up())
            self.config.timeout_graceful_shutdown = grace + _ABORT_FLUSH_S
            try:
                await super().shutdown(sockets)
            finally:
                watcher.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _outer_app(engine_args: Any, args: argparse.Namespace, name: str, api_key: str | None) -> Any:
    from fastapi import FastAPI
    from qmc_sampler.server.app import ServerSettings, build_app
    from qmc_sampler.vllm_plugin.checks import require_plugin_async
    from vllm.v1.engine.async_llm import AsyncLLM

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine is created inside the server's event loop, which its output handler uses.
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            await require_plugin_async(engine)  # never label i.i.d. samples "lattice"
        except RuntimeError as e:
            sys.stderr.write(f"qmc-serve: error: {e}\n")
            sys.stderr.flush()
            engine.shutdown()
            os._exit(1)  # one line, not uvicorn's start-up traceback
        settings = ServerSettings(
            model_name=name,
            max_model_len=engine.model_config.max_model_len,
            vocab_size=engine.model_config.get_vocab_size(),
            default_sampler=args.sampler,
            max_n=args.max_n,
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            max_members_in_flight=args.max_members_in_flight,
            queue_timeout=args.queue_timeout,
        )
        served = build_app(engine, settings)
        app.mount("/", served)
        app.state.abort_all = served.state.abort_all  # for the server's shutdown
        try:
            yield
        finally:
            # Running requests had --shutdown-timeout to finish; abort what is left (uvicorn
            # cancels their tasks but does not wait for their cleanup), then stop the engine.
            await served.state.abort_all()
            for _ in range(50):
                if not engine.get_num_unfinished_requests():
                    break
                await asyncio.sleep(0.1)
            left = engine.get_num_unfinished_requests()
            print(f"qmc-serve: stopped; {left} engine requests unfinished", flush=True)
            engine.shutdown()

    return FastAPI(lifespan=lifespan)


if __name__ == "__main__":
    sys.exit(main())
