"""qmc-serve's ``sampler``, ``sampler_seed``, ``sampler_offset``, ``sampler_group_size``, mapped onto
the plugin's ``vllm_xargs`` before vLLM parses the body (docs/serving.md, "qmc-serve").

An ``n = 1`` request without offset or size joins its prompt's *auto* group (as on
``vllm serve`` with the drop-in); any other designed request is an *explicit* group
of its own (a fresh ``qmc_group``), whose member i depends only on (design, seed, i);
a caller's own ``qmc_group`` is kept. The rest of the body is vLLM's to validate.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from qmc_sampler.designs import METHODS, get_design
from qmc_sampler.limits import MAX_GROUP_SIZE, SEED_MAX, SEED_MIN, check_int, is_int
from qmc_sampler.members.keys import ENV_AUTO_GROUP, check_extra_args
from qmc_sampler.processing import SAMPLING_EPS

__all__ = ["FIELDS", "LEAST_LOADED", "FieldError", "Plan", "plan_other_route", "plan_request"]

FIELDS = ("sampler", "sampler_seed", "sampler_offset", "sampler_group_size")
LEAST_LOADED = ""
#: The body field whose entries are a route's prompts, each its own engine request (``items`` elsewhere).
PROMPTS_OF = {"/v1/chat/completions/batch": "messages", "/v1/systemone": "questions"}


class FieldError(ValueError):
    """A request qmc-serve refuses (HTTP ``status``, OpenAI's error shape naming ``param``)."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None,
                 retry_after: float | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.param, self.status, self.code, self.retry_after = param, status, code, retry_after

    def body(self) -> dict[str, Any]:
        """The response body, in OpenAI's error shape."""
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What qmc-serve does with one request: ``body`` for vLLM (our fields removed,
    ``vllm_xargs`` completed), the ``design`` applied (None: greedy), the ``seed`` reported
    (None: an auto group without one), ``n``, ``members`` (n × prompts), ``groups``
    (prompts), and ``placement`` under data parallelism: None (anywhere),
    :data:`LEAST_LOADED` (one engine: an ``n > 1`` group), or a key (auto-group repeats of
    a prompt, or the requests of a caller's ``qmc_group`` without ``qmc_index``, meet on the
    engine it picks).
    """

    body: dict[str, Any]
    design: str | None
    seed: int | None
    n: int
    members: int
    groups: int
    placement: str | None


def plan_request(body: dict[str, Any], *, chat: bool, default_sampler: str, max_n: int) -> Plan:
    """Validate qmc-serve's fields of a completion or chat request and map them onto ``vllm_xargs``.

    Args:
        body: the parsed JSON body (not modified).
        chat: a ``/v1/chat/completions`` body (one prompt).
        default_sampler: the design of requests that name none (``--sampler``).
        max_n: the largest ``n`` accepted (``--max-n``).

    Returns:
        The :class:`Plan`.

    Raises:
        FieldError: naming the field and its allowed values.
    """
    n = _int(body, "n", 1, low=1)
    if n > max_n:
        raise FieldError(f"n={n} must be between 1 and {max_n} (this server's --max-n)", "n")
    best_of = body.get("best_of")
    per_prompt = max(n, best_of) if is_int(best_of) else n
    groups = 1 if chat else _prompt_count(body.get("prompt"))
    members = per_prompt * groups
    xargs = body.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        raise FieldError("vllm_xargs must be an object of strings, numbers or lists of them", "vllm_xargs")
    # As vLLM's request model parses vllm_xargs (JSON true/false become 1/0), so that a body means
    # the same here as on vllm serve.
    xargs = {k: int(v) if isinstance(v, bool) else v for k, v in xargs.items()}
    try:
        check_extra_args(xargs)
    except ValueError as e:
        raise FieldError(str(e), "vllm_xargs") from None
    sampler = body.get("sampler")
    if sampler is not None and sampler not in METHODS:
        raise FieldError(f"sampler={sampler!r} is not a design; use one of {list(METHODS)}", "sampler")
    sources = [("sampler_seed", body.get("sampler_seed")), ("vllm_xargs", xargs.get("qmc_seed"))]
    sources.append(("seed", body.get("seed")))
    given = [(k, s) for k, s in sources if s is not None]
    for key, value in given:
        try:
            check_int(key if key != "vllm_xargs" else "vllm_xargs 'qmc_seed'", value, SEED_MIN, SEED_MAX)
        except ValueError as e:
            raise FieldError(str(e), key) from None
    seed = given[0][1] if given else None
    offset = _int(body, "sampler_offset", 0, low=0, high=MAX_GROUP_SIZE - 1)
    size = _int(body, "sampler_group_size", None, low=1, high=MAX_GROUP_SIZE)
    asked = sampler or xargs.get("qmc_method")
    method = asked or default_sampler
    temperature = as_number(body.get("temperature"))  # as vLLM's parser reads it ("0", false: greedy too)
    if isinstance(temperature, int | float) and temperature < SAMPLING_EPS:
        if asked not in (None, "iid"):
            raise FieldError(
                f"temperature={temperature} is greedy decoding, which has nothing to correlate: "
                f"use temperature > 0 with sampler={asked!r}, or sampler='iid'",
                "temperature",
            )
        method = None
    if method is not None and body.get("use_beam_search"):
        raise FieldError(
            f"use_beam_search does not sample, so sampler={method!r} cannot apply; send temperature=0 "
            "or leave use_beam_search out",
            "use_beam_search",
        )
    out = {k: v for k, v in body.items() if k not in FIELDS}
    if method is None:
        return Plan(out, None, None, n, members, groups, None)
    ours = {k: v for k, v in given if k != "seed"}  # vLLM's own seed counts only where neither of ours is sent
    if len(ours) == 2 and ours["sampler_seed"] != ours["vllm_xargs"]:
        raise FieldError(  # else the reply would name one seed and the group use the other
            f"sampler_seed={ours['sampler_seed']} and vllm_xargs 'qmc_seed'={ours['vllm_xargs']} disagree: "
            "send one of them (or the same value in both)",
            "sampler_seed",
        )
    xargs = dict(xargs, qmc_method=method)
    if "qmc_group" in xargs:  # the caller's own explicit group, as on vllm serve
        if offset or size is not None:
            raise FieldError(
                "sampler_offset/sampler_group_size and vllm_xargs 'qmc_group' both name a group; send one", "vllm_xargs"
            )
        if seed is not None:
            xargs.setdefault("qmc_seed", seed)
    elif n == 1 and offset == 0 and size is None:  # one repeat of its prompt: the auto group
        auto = xargs.get("qmc_auto_group", 1) not in (0, False) and os.environ.get(ENV_AUTO_GROUP) != "0"
        if auto and not get_design(method).extensible:  # it has no size: the plugin groups it as a lattice
            method = "lattice"  # (said in the reply's sampler, not only in the engine's log)
            xargs["qmc_method"] = method
        if seed is not None:
            xargs["qmc_seed"] = seed
        out["vllm_xargs"] = xargs
        prompt = body.get("messages") if chat else body.get("prompt")
        return Plan(out, method, seed, n, members, groups, _key(prompt))
    else:
        size = offset + n if size is None else size
        if offset > 0 and body.get("sampler_group_size") is None:
            raise FieldError(
                "sampler_offset needs sampler_group_size (the size of the group being extended)", "sampler_group_size"
            )
        if size < offset + n:
            raise FieldError(f"sampler_group_size={size} must be >= sampler_offset + n = {offset + n}",
                             "sampler_group_size")  # fmt: skip
        if offset > 0 and seed is None:
            raise FieldError(
                "sampler_offset extends an existing group, which needs its seed: send sampler_seed "
                "(the sampler_seed of the response that started the group)",
                "sampler_seed",
            )
        seed = secrets.randbits(63) if seed is None else seed
        xargs |= {"qmc_group": uuid.uuid4().hex, "qmc_seed": seed, "qmc_index": offset, "qmc_n": size}
    out["vllm_xargs"] = xargs
    return Plan(out, method, seed, n, members, groups, _group_engine(xargs) or (LEAST_LOADED if n > 1 else None))


def plan_other_route(path: str, body: dict[str, Any], *, max_n: int) -> Plan:
    """The members and engine placement of a request on one of vLLM's other sampling routes
    (``/v1/chat/completions/batch``, ``/v1/responses``, ``/inference/v1/generate``, …), which
    qmc-serve passes on unchanged: the same ``--max-n``, member limit and pinning as
    ``/v1/completions``.

    Members are n × prompts: ``n`` at the top level or in ``sampling_params`` (the token route),
    prompts the conversations of a batch-chat body, the items of a generative-scoring body or the
    questions of a structured-decision body (``/v1/systemone``: one engine request per question at
    most; one otherwise). Several members stay on one engine (:data:`LEAST_LOADED`); a lone member goes where
    its prompt hashes (auto-group repeats meet), and a caller's ``qmc_group`` without ``qmc_index``
    to its group's engine.

    Raises:
        FieldError: ``n`` not an integer in [1, ``max_n``], naming the route.
    """
    params = body.get("sampling_params")
    # Both places a route may read n from are bounded, and the larger counts: the token route reads
    # sampling_params.n and ignores a top-level n, the others the reverse.
    sizes = [body.get("n"), params.get("n") if isinstance(params, dict) else None]
    for size in sizes:
        if size is not None and (not is_int(size) or not 1 <= size <= max_n):
            raise FieldError(
                f"n={size!r} on {path} must be an integer between 1 and {max_n} (this server's --max-n)", "n"
            )
    n = max([1, *(size for size in sizes if size is not None)])
    prompts = body.get(PROMPTS_OF.get(path, "items"))
    groups = len(prompts) if isinstance(prompts, list | dict) and prompts else 1
    members = n * groups
    xargs = body.get("vllm_xargs")
    if isinstance(params, dict) and not isinstance(xargs, dict):
        xargs = params.get("extra_args")
    placement = _group_engine(xargs) if isinstance(xargs, dict) else None
    if placement is None:
        prompt = {k: body.get(k) for k in ("messages", "input", "prompt", "token_ids", "query", "items")}
        placement = LEAST_LOADED if members > 1 else _key(prompt)
    return Plan(body, None, None, n, members, groups, placement)


def _group_engine(xargs: dict[str, Any]) -> str | None:
    """The engine key of a caller's explicit group whose members the engine numbers by arrival
    (``qmc_group`` without ``qmc_index``): all of them on one engine, so that one counter numbers
    them (the plugin salts such groups per engine, so two engines never repeat a member, but they
    would split it into two groups)."""
    if xargs.get("qmc_group") is None or xargs.get("qmc_index") is not None:
        return None
    return _key(["qmc_group", xargs["qmc_group"]])


def _key(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


def _int(body: dict[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if high is not None:
        try:
            return check_int(name, value, low, high)
        except ValueError as e:
            raise FieldError(str(e), name) from None
    if not is_int(value) or value < low:
        raise FieldError(f"{name}={value!r} must be an integer >= {low}", name)
    return value


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completion body: a string or token list is one; a list of them is several."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def as_number(value: Any) -> Any:
    """``value`` as vLLM's request parser (pydantic, lax) reads a float field: a bool or a numeric
    string becomes its number; anything else is returned as it is (vLLM refuses it)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
