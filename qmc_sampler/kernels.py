"""Backends for the fused step "processed distribution → inverse CDF → (token, start, prob)".

* ``cpp`` — ``qmc_sampler._C.fused_inverse_cdf`` (``csrc/cpu_sampling.cpp``): CPU
  tensors, one row per task of torch's thread pool, vectorised. Built by setup.py
  when a compiler is present; needs AVX2 on x86-64.
* ``triton`` — :mod:`qmc_sampler.triton_kernels` for CUDA tensors: temperature,
  min-p, top-k and top-p (no sort) and the token-id-order CDF walk in one kernel
  (``sorted`` order uses the torch path).
* ``torch`` — :func:`qmc_sampler.processing.process_logits` then
  :func:`qmc_sampler.inverse_cdf.inverse_cdf`: any device, the reference.

The backend is chosen once per device type at first use (fastest available), the
choice is logged once, and a missing kernel falls back to ``torch`` with one
warning. ``QMC_SAMPLER_BACKEND=torch|cpp|triton`` forces one; forcing an unavailable
backend raises (``triton`` also runs on CPU tensors under ``TRITON_INTERPRET=1``,
which the tests use to check the kernel without a GPU).

Agreement: the backends compute the same distribution in different floating-point
orders (float32 exponentials and blocked sums in ``cpp``, float64 in ``torch``),
so they pick the same token except when u lies within :data:`EDGE_TOLERANCE` of
an interval edge of the reference CDF; ``tests/core/test_kernels.py`` checks it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from functools import lru_cache

import numpy as np
import torch

from qmc_sampler.inverse_cdf import Draw, inverse_cdf, reject_bad_rows
from qmc_sampler.processing import process_logits

__all__ = ["BACKENDS", "EDGE_TOLERANCE", "backend_for", "draw_by_order", "fused_draw", "pure_torch", "upload"]

BACKENDS = ("cpp", "triton", "torch")
#: How far (in CDF units) u may lie from a reference interval edge for the
#: backends to disagree: float32 weights have relative error ~1e-7 each, and the
#: CDF accumulates them.
EDGE_TOLERANCE = 1e-5

logger = logging.getLogger("qmc_sampler")


@lru_cache(maxsize=1)
def _cpp_kernel():  # -> module | None, with the reason logged/warned once
    try:
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") and os.uname().machine == "x86_64":
            raise ImportError("this CPU has no AVX2")
        _check_kernel_record()  # before the .so is loaded: loading another torch's C++ ABI can crash
        from qmc_sampler import _C

        built_with = getattr(_C, "built_with_torch", "unknown")  # the same, as compiled in (a stale record)
        if built_with != torch.__version__:
            raise ImportError(_rebuild(f"it was built against torch {built_with}"))
    except ImportError as e:
        warnings.warn(f"qmc-sampler: fused CPU kernel unavailable ({e}); using the pure-torch path", stacklevel=3)
        return None
    return _C


#: setup.py's record beside the built kernel: the torch version it was built against, one line.
KERNEL_RECORD = "_C.built_with_torch"


def _rebuild(reason: str) -> str:
    return (f"{reason}, this is torch {torch.__version__}; "
            "reinstall qmc-llm-sampler to rebuild it (pip install --no-build-isolation)")  # fmt: skip


def _check_kernel_record() -> None:
    """Refuse the fused kernel, without loading it, unless the record beside its ``.so`` names this torch.

    Raises:
        ImportError: no kernel was built (no ``.so``), or its record is missing, unreadable or names
            another torch.
    """
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("qmc_sampler._C")  # finds the file; loads nothing
    if spec is None or not spec.origin:
        raise ImportError("no kernel was built (no qmc_sampler._C)")
    record = Path(spec.origin).with_name(KERNEL_RECORD)
    try:
        built_with = record.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise ImportError(_rebuild(f"{record} is missing, so the torch it was built against is unknown")) from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable: refused as missing, never raised past the fallback
        unknown = f"{record} cannot be read ({e}), so the torch it was built against is unknown"
        raise ImportError(_rebuild(unknown)) from None
    if built_with != torch.__version__:
        raise ImportError(_rebuild(f"it was built against torch {built_with} ({record})"))


@contextlib.contextmanager
def pure_torch() -> Iterator[None]:
    """Draw on the pure-torch path inside this block, in this thread or task only (a context variable:
    the environment is the process's, and an engine's other threads must not see the switch).

    The plugin draws a step again this way when a fused backend fails (exact too: the same
    distribution and inverse CDF; ``qmc_sampler.processing`` and ``qmc_sampler.inverse_cdf``).
    """
    token = _OVERRIDE.set("torch")
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar("qmc_sampler_backend", default=None)


def backend_for(device: torch.device) -> str:
    """The backend used for logits on ``device`` (see module docstring).

    Decided once per device type and setting of ``QMC_SAMPLER_BACKEND`` and
    ``TRITON_INTERPRET`` (this runs in every decoding step; probing Triton and CUDA
    costs tens of microseconds); inside :func:`pure_torch`, ``"torch"``.

    Raises:
        ValueError: ``QMC_SAMPLER_BACKEND`` names an unknown or unavailable backend.
    """
    override = _OVERRIDE.get()
    if override is not None:
        return override
    forced = os.environ.get("QMC_SAMPLER_BACKEND", "").strip()
    # Only a choice that may involve Triton depends on TRITON_INTERPRET (read by triton_available).
    involves_triton = device.type != "cpu" or forced == "triton"
    return _backend(device.type, forced, os.environ.get("TRITON_INTERPRET") if involves_triton else None)


@lru_cache(maxsize=32)
def _backend(device_type: str, forced: str, triton_interpret: str | None) -> str:
    # triton_interpret is only part of the cache key: triton_available reads it.
    if forced and forced not in BACKENDS:
        raise ValueError(f"QMC_SAMPLER_BACKEND={forced!r} is not a backend; use one of {list(BACKENDS)}")
    if forced == "torch":
        return "torch"
    from qmc_sampler.triton_kernels import triton_available

    if forced == "triton":
        if not triton_available():
            raise ValueError(
                "QMC_SAMPLER_BACKEND='triton' but Triton has no device here (no CUDA, no TRITON_INTERPRET)"
            )
        return "triton"
    cpp_ok = device_type == "cpu" and _cpp_kernel() is not None
    if forced == "cpp" and not cpp_ok:
        raise ValueError(f"QMC_SAMPLER_BACKEND='cpp' but the fused CPU kernel is unavailable for {device_type} logits")
    if cpp_ok:
        choice = "cpp"
    elif device_type == "cuda" and triton_available():
        choice = "triton"
    else:
        choice = "torch"
    _log_choice(device_type, choice)
    return choice


@lru_cache(maxsize=8)
def _log_choice(device_type: str, choice: str) -> None:
    logger.info("qmc-sampler: %s logits use the %s sampling backend", device_type, choice)


def fused_draw(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    order: str,
    check: bool = True,
) -> Draw:
    """Processed distribution and inverse CDF for a batch, on the fastest backend.

    Args:
        logits: ``[batch, vocab]`` raw logits (not modified).
        uniforms: ``[batch]`` float64 in [0, 1).
        temperature, top_k, top_p, min_p: ``[batch]`` (None: disabled for every row).
        order: ``"id"`` or ``"sorted"``.
        check: raise for a bad row (NaN, nothing admissible), which costs a host round trip;
            False: such a row's token is -1 and nothing leaves the device.

    Returns:
        :class:`qmc_sampler.inverse_cdf.Draw`.
    """
    backend = backend_for(logits.device)
    if backend == "torch" or (backend == "triton" and order == "sorted"):
        return inverse_cdf(process_logits(logits, temperature, top_k, top_p, min_p), uniforms, order, check)
    batch = logits.shape[0]
    if backend == "triton":
        from qmc_sampler.triton_kernels import triton_inverse_cdf

        tokens, starts, probs = triton_inverse_cdf(logits, uniforms, temperature, min_p, top_k, top_p)
        return _checked(Draw(tokens=tokens, starts=starts, probs=probs), check)
    tokens, starts, probs = _cpp_kernel().fused_inverse_cdf(
        logits,
        temperature,
        top_k if top_k is not None else _constant(batch, 0, torch.long),
        top_p if top_p is not None else _constant(batch, 1.0, torch.float32),
        min_p if min_p is not None else _constant(batch, 0.0, torch.float32),
        uniforms,
        order == "sorted",
    )
    return _checked(Draw(tokens=tokens, starts=starts, probs=probs), check)


def draw_by_order(
    logits: torch.Tensor,
    orders: Sequence[str],
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    check: bool = True,
) -> Draw:
    """:func:`fused_draw` for a batch whose rows may use different vocabulary orders.

    One :func:`fused_draw` call for a batch of one order; otherwise one per order, on that
    order's rows, scattered back. The row indices reach each tensor's device through
    :func:`upload` (no wait for the device).

    Args:
        logits: ``[batch, vocab]`` raw logits (not modified).
        orders: ``batch`` vocabulary orders, ``"id"`` or ``"sorted"``, one per row.
        uniforms, temperature, top_k, top_p, min_p, check: as :func:`fused_draw` (each tensor
            may be on the CPU or on the logits' device).

    Returns:
        :class:`qmc_sampler.inverse_cdf.Draw`, on the logits' device.

    Raises:
        ValueError: with ``check``, a bad row (NaN, nothing admissible).
    """
    distinct = sorted(set(orders))
    if len(distinct) == 1:
        return fused_draw(logits, uniforms, temperature, top_k, top_p, min_p, distinct[0], check=check)
    device = logits.device
    tokens = torch.empty(len(orders), dtype=torch.int64, device=device)
    starts = torch.empty(len(orders), dtype=torch.float64, device=device)
    probs = torch.empty_like(starts)
    names = np.array(orders)
    for order in distinct:
        rows = _RowIndex(np.flatnonzero(names == order))
        at = rows.on(device)
        part = fused_draw(
            logits[at], rows.of(uniforms), rows.of(temperature), rows.of(top_k), rows.of(top_p), rows.of(min_p),
            order, check=check,
        )  # fmt: skip
        tokens[at], starts[at], probs[at] = part.tokens.to(device), part.starts.to(device), part.probs.to(device)
    return Draw(tokens=tokens, starts=starts, probs=probs)


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host values on ``device`` without waiting: through pinned memory, copied asynchronously
    (torch's pinned-memory allocator keeps the block until the copy is done).

    Args:
        values: any numpy array (made contiguous if it is not).
        device: where they are needed.

    Returns:
        The values as a tensor on ``device`` (on the CPU: sharing ``values``' memory).
    """
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class _RowIndex:
    """Some rows of a batch, as an index on each device it is needed on (uploaded once per device)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = upload(self.rows, device)
        return self._on[device]

    def of(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[self.on(t.device)]


@lru_cache(maxsize=64)
def _constant(batch: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    # A disabled filter's [batch] CPU parameter, made once per batch size: the kernel only reads it.
    return torch.full((batch,), value, dtype=dtype)


def _checked(draw: Draw, check: bool) -> Draw:
    if check:
        reject_bad_rows(draw.tokens < 0)
    return draw
