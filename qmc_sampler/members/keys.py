"""The request contract every door reads: the ``qmc_*`` keys of ``extra_args`` / ``vllm_xargs``
and the ``QMC_SAMPLER*`` variables (both tables in docs/serving.md), and the keys' validation.
"""

from __future__ import annotations

from typing import Any

from qmc_sampler.designs import METHODS
from qmc_sampler.inverse_cdf import ORDERS
from qmc_sampler.limits import MAX_GROUP_ID_LENGTH, MAX_GROUP_SIZE, SEED_MAX, SEED_MIN, check_int, is_int

__all__ = [
    "ENV_AUTO_GROUP",
    "ENV_GROUP_TTL",
    "ENV_METHOD",
    "ENV_ORDER",
    "ENV_SALT",
    "KEYS",
    "PRIVATE_PREFIX",
    "check_extra_args",
]

ENV_METHOD = "QMC_SAMPLER"
ENV_ORDER = "QMC_SAMPLER_ORDER"
ENV_AUTO_GROUP = "QMC_SAMPLER_AUTO_GROUP"
ENV_GROUP_TTL = "QMC_SAMPLER_GROUP_TTL"
ENV_SALT = "QMC_SAMPLER_SALT"
KEYS = ("qmc_method", "qmc_seed", "qmc_order", "qmc_group", "qmc_index", "qmc_n", "qmc_auto_group")
#: Keys beginning with this are qmc-sampler's own: its admission writes them for itself and its workers
#: (``vllm_plugin/request_args.py``), and a caller never sets one (issue 50, item 5).
PRIVATE_PREFIX = "_qmc"


def check_extra_args(extra: dict[str, Any]) -> None:
    """Validate the plugin's keys in a flat ``extra_args`` / ``vllm_xargs`` dict, bounds included.

    Seeds and integer group ids are 64-bit words (``qmc_sampler.limits``), ``qmc_n`` is at
    most ``MAX_GROUP_SIZE``, a string ``qmc_group`` at most ``MAX_GROUP_ID_LENGTH``
    characters: nothing the engine computes from them grows with a value a client chose. A key
    beginning ``_qmc`` (:data:`PRIVATE_PREFIX`) is refused: those are written by qmc-sampler's own
    admission, which takes its own out of the dict before it calls this.

    Raises:
        ValueError: naming the key and its allowed values.
    """
    private = sorted(k for k in extra if isinstance(k, str) and k.startswith(PRIVATE_PREFIX))
    if private:
        raise ValueError(
            f"extra_args/vllm_xargs key {private[0]!r} is qmc-sampler's own (its admission writes it), never a "
            f"caller's: drop it; a request sets its group seed with vLLM's 'seed' or 'qmc_seed', and the keys a "
            f"caller may set are {list(KEYS)}"
        )
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
    if seed is not None:
        check_int("vllm_xargs 'qmc_seed'", seed, SEED_MIN, SEED_MAX)
    group = extra.get("qmc_group")
    if group is not None:
        if isinstance(group, str):
            if not 1 <= len(group) <= MAX_GROUP_ID_LENGTH:
                raise ValueError(
                    f"vllm_xargs 'qmc_group' is a string of {len(group)} characters; use 1 to "
                    f"{MAX_GROUP_ID_LENGTH}, or an integer"
                )
        elif not is_int(group) or not SEED_MIN <= group <= SEED_MAX:
            raise ValueError(
                f"vllm_xargs 'qmc_group'={group!r} must be a string of 1 to {MAX_GROUP_ID_LENGTH} characters "
                f"or an integer between {SEED_MIN} and {SEED_MAX}"
            )
    n = extra.get("qmc_n")
    if n is not None:
        check_int("vllm_xargs 'qmc_n'", n, 1, MAX_GROUP_SIZE)
    index = extra.get("qmc_index")
    if index is not None:
        check_int("vllm_xargs 'qmc_index'", index, 0, MAX_GROUP_SIZE - 1)
        if group is None or n is None:
            raise ValueError("vllm_xargs 'qmc_index' needs 'qmc_group' and 'qmc_n' (the group it is a member of)")
        if index >= n:
            raise ValueError(f"vllm_xargs 'qmc_index'={index} must be < 'qmc_n'={n}")
    if (group is None) != (n is None):
        raise ValueError("vllm_xargs 'qmc_group' and 'qmc_n' go together: give both or neither")
    auto = extra.get("qmc_auto_group")
    if auto is not None and (not isinstance(auto, int) or auto not in (0, 1)):  # False/True are 0/1 here
        raise ValueError(f"vllm_xargs 'qmc_auto_group'={auto!r} must be 0 or 1")
