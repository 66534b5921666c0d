"""Engine settings that depend on the CPU: the dtype vLLM computes in, its reserved core, its KV block size.

:func:`engine_dtype` computes a bf16 or fp16 checkpoint in bf16 where the CPU has native bf16
(:func:`cpu_flags`: ``avx512_bf16`` / ``amx_bf16`` on x86-64, ``bf16`` on Arm) and in float32
elsewhere (a float32 checkpoint stays float32, :func:`checkpoint_dtype`; GPUs get vLLM's
``auto``); :func:`cpu_engine_env` frees vLLM's reserved scheduler core
(``VLLM_CPU_NUM_OF_RESERVED_CPU``) on ≤ 4 cores unless the user set it;
:func:`engine_block_size` gives KV blocks of :data:`CPU_BLOCK_SIZE` = 32 tokens on a CPU, so a
group's members share their prompt's cached blocks; :func:`describe_cpu` names the CPU for
benchmarks. The measurements behind each choice: docs/performance.md, "Engine settings on a CPU".
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CPU_BLOCK_SIZE",
    "DTYPES",
    "checkpoint_dtype",
    "cpu_engine_env",
    "cpu_flags",
    "describe_cpu",
    "engine_block_size",
    "engine_dtype",
    "native_bf16",
]

#: What ``--dtype`` accepts; ``auto`` is this module's choice, not vLLM's.
DTYPES = ("auto", "bfloat16", "float16", "float32")
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86-64 flags / Arm "Features"
_SMALL_MACHINE_CORES = 4
#: KV-cache block size (tokens) for CPU engines: the smallest the CPU attention kernel takes.
CPU_BLOCK_SIZE = 32


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86-64, ``Features`` on Arm).

    Args:
        cpuinfo: the file's text (default: read ``/proc/cpuinfo``; empty where it does not exist).
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def native_bf16(cpuinfo: str | None = None) -> bool:
    """True if the CPU computes bf16 natively (see the module docstring)."""
    return bool(cpu_flags(cpuinfo) & _BF16_FLAGS)


def engine_dtype(
    requested: str = "auto", device_type: str = "cpu", model_dir: str | None = None, cpuinfo: str | None = None
) -> tuple[str, str]:
    """The dtype to give vLLM, and why (one phrase for the console).

    Args:
        requested: one of :data:`DTYPES`; anything but ``auto`` is used as given.
        device_type: ``cpu`` or an accelerator (``cuda``, …): accelerators get vLLM's ``auto``.
        model_dir: a Hugging Face folder; a float32 checkpoint keeps float32.
        cpuinfo: ``/proc/cpuinfo`` text, for tests.

    Raises:
        ValueError: ``requested`` is not one of :data:`DTYPES`.
    """
    if requested not in DTYPES:
        raise ValueError(f"dtype={requested!r} is not supported; use one of {list(DTYPES)}")
    if requested != "auto":
        return requested, "as requested"
    if device_type != "cpu":
        return "auto", f"the model's own dtype on {device_type}"
    if model_dir is not None and checkpoint_dtype(model_dir) == "float32":
        return "float32", "the model's own dtype"
    if native_bf16(cpuinfo):
        return "bfloat16", "this CPU has native bf16"
    return "float32", "this CPU has no native bf16, which it would emulate several times slower"


def engine_block_size(requested: int | None = None, device_type: str = "cpu") -> int | None:
    """The KV-cache block size to give vLLM (None: vLLM's own default).

    Args:
        requested: the user's choice, used as given.
        device_type: ``cpu`` gets :data:`CPU_BLOCK_SIZE` (see the module docstring); accelerators vLLM's default.
    """
    if requested is not None:
        return requested
    return CPU_BLOCK_SIZE if device_type == "cpu" else None


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype a Hugging Face folder's ``config.json`` declares (``torch_dtype`` / ``dtype``), if any."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value) if value else None


def cpu_engine_env(cores: int | None = None) -> dict[str, str]:
    """Environment for vLLM's CPU engine processes (set before the engine starts).

    Returns:
        ``{"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}`` on machines with at most 4 cores
        when the user has not set it, else nothing.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores <= _SMALL_MACHINE_CORES and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return {}


def describe_cpu(cpuinfo: str | None = None) -> str:
    """One line naming the CPU a timing ran on: model, usable cores, and whether bf16 is native."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    model = next(
        (line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
        os.uname().machine,
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    bf16 = "native bf16" if native_bf16(cpuinfo) else "no native bf16"
    return f"CPU: {model}, {cores} cores, {bf16}"
