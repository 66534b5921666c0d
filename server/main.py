"""``qmc-serve``: the OpenAI-compatible server with correlated n > 1 groups.

    qmc-serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--sampler lattice] [--max-n 128]
              [--served-model-name NAME] [--max-model-len N] [--dtype auto] [--kv-cache-gb 2]

vLLM's ``AsyncLLM`` runs in-process (its engine core in a child process) with the
plugin loaded through its entry point; the model defaults to the embedded
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from typing import NoReturn

from qmc_sampler.cpu_defaults import DTYPES
from qmc_sampler.designs import METHODS

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qmc-serve", description="OpenAI-compatible server with correlated sampling groups")
    p.add_argument("--model", default=None, help="local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the `model` name clients use (default: folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--sampler", choices=METHODS, default="lattice", help="design for requests without `sampler`")
    p.add_argument("--max-n", type=int, default=128, help="largest n a request may ask for")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="engine dtype; auto: bf16 where the CPU has native bf16, else float32 (GPUs: the model's)",
    )
    p.add_argument("--kv-cache-gb", type=int, default=None, help="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--no-enforce-eager", action="store_true", help="let vLLM compile (slower start)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qmc-serve`` console script."""
    args = _parser().parse_args(argv)
    if args.max_n < 1:
        _parser().error(f"--max-n {args.max_n} must be >= 1")
    if args.kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import torch
    import uvicorn
    from fastapi import FastAPI
    from qmc_sampler.server.app import ServerSettings, build_app
    from qmc_sampler.vllm_plugin.checks import require_plugin_async
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from qmc_sampler.cpu_defaults import cpu_engine_env, engine_dtype
    from qmc_sampler.models import resolve_model

    try:
        model = resolve_model(args.model)
    except ValueError as e:
        _parser().error(str(e))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = engine_dtype(args.dtype, device, model)
    if device == "cpu":
        os.environ.update(cpu_engine_env())
    print(f"qmc-serve: {model} on {device} in {dtype} ({why})", flush=True)
    engine_args = AsyncEngineArgs(
        model=model, dtype=dtype, max_model_len=args.max_model_len, enforce_eager=not args.no_enforce_eager, seed=0
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(model))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine is created inside the server's event loop, which its output handler uses.
        engine = AsyncLLM.from_engine_args(engine_args)
        await require_plugin_async(engine)  # never label i.i.d. samples "lattice"
        settings = ServerSettings(
            model_name=name,
            max_model_len=engine.model_config.max_model_len,
            default_sampler=args.sampler,
            max_n=args.max_n,
        )
        app.mount("/", build_app(engine, settings))
        try:
            yield
        finally:
            engine.shutdown()

    outer = FastAPI(lifespan=lifespan)
    uvicorn.run(outer, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
