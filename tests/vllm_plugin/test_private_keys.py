"""The plugin's private ``_qmc*`` keys at admission (issue 50, item 5; no engine needed).

Admission writes ``_qmc`` (the placement, for the worker), ``_qmc_user_seed`` (vLLM's ``seed``,
moved out of vLLM's way) and the route's ``_qmc_prompt`` into ``extra_args`` for itself; a caller
who sets one in ``extra_args`` / ``vllm_xargs`` is refused there, naming the key, whatever its
value — before anything reaches an engine step — while the keys admission wrote keep working when
a params object is reused.
"""

import math

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_plugin.request_args import prompt_index, prompt_seed, read_request, resolve  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from qmc_sampler.members import PER_REQUEST  # noqa: E402

HOSTILE = [2**70, -1, 0, 5, 0.5, math.nan, "x", [1, 2], None, True]
PRIVATE = ["_qmc_user_seed", "_qmc_prompt", "_qmc", "_qmc_seal", "_qmc_other"]


def params_with(extra, **kw):
    """A ``SamplingParams`` whose ``extra_args`` is set after construction: vLLM 0.32 refuses an integer
    beyond 64 bits when it builds one, older releases do not, and admission must not rely on it."""
    sp = SamplingParams(**({"n": 4} | kw))
    sp.extra_args = dict(extra)
    return sp


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("key", PRIVATE)
def test_a_callers_private_key_is_refused_at_admission_naming_it(key, value):
    for extra in (
        {"qmc_method": "lattice", key: value},
        {"qmc_method": "lattice", "qmc_seed": 3, key: value},
        {key: value},
    ):
        sp = params_with(extra)
        with pytest.raises(ValueError, match=rf"key '{key}' is qmc-sampler's own .* never a caller's"):
            resolve(sp)
        assert sp.extra_args == extra and sp.seed is None  # refused as sent: nothing placed for a worker


@pytest.mark.parametrize("value", [5, 0.5, 2**62])
def test_an_in_range_user_seed_from_a_caller_does_not_seed_the_group(value):
    # Today's admission took it as the request's seed (0.5 as 0; AUTO kept 0.5 for the engine step).
    with pytest.raises(ValueError, match="_qmc_user_seed"):
        resolve(params_with({"qmc_method": "lattice", "_qmc_user_seed": value}))
    with pytest.raises(ValueError, match="_qmc_user_seed"):
        resolve(params_with({"qmc_method": "lattice", "_qmc_user_seed": value}, n=1))


def test_vllms_own_admission_refuses_it_as_the_clients_error():
    # vLLM's front end runs the processor's validate_params per request (HTTP 400 on its server).
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    sp = params_with({"qmc_method": "lattice", "_qmc_user_seed": 0.5}, n=1)
    with pytest.raises(VLLMValidationError, match="_qmc_user_seed"):
        validate_logits_processors_parameters(["qmc_sampler.vllm_plugin:QMCLogitsProcessor"], sp)


def test_a_seal_a_caller_writes_or_copies_covers_nothing():
    ours = params_with({"qmc_method": "lattice"}, seed=9)
    resolve(ours)
    seal = ours.extra_args["_qmc_seal"]
    forged = {"qmc_method": "lattice", "_qmc_user_seed": 5, "_qmc_seal": ["0" * 32, "_qmc_user_seed"]}
    with pytest.raises(ValueError, match="_qmc_seal"):
        resolve(params_with(forged))
    copied = {k: v for k, v in ours.extra_args.items()} | {"_qmc_user_seed": 10}  # our seal, another value
    with pytest.raises(ValueError, match="_qmc"):
        resolve(params_with(copied))
    with pytest.raises(ValueError, match="_qmc_seal"):
        resolve(params_with({"qmc_method": "lattice", "_qmc_seal": ["é", "_qmc_user_seed"], "_qmc_user_seed": 1}))
    assert seal == ours.extra_args["_qmc_seal"]


def test_the_keys_admission_wrote_keep_working_when_the_params_are_reused():
    sp = params_with({"qmc_method": "lattice"}, seed=123)
    first = resolve(sp)
    assert sp.seed is None and sp.extra_args["_qmc_user_seed"] == 123
    again = resolve(sp)
    assert (first.kind, first.seed, again.seed) == (PER_REQUEST, 123, 123)
    assert again.group != first.group and read_request(sp.extra_args) == again
    import copy

    assert resolve(copy.deepcopy(sp)).seed == 123  # a copy in this process is still ours


def test_a_callers_prompt_mark_never_moves_the_seed_and_ours_does():
    from qmc_sampler.vllm_plugin.request_args import mark_prompt

    assert prompt_index(params_with({"_qmc_prompt": 5})) == 0  # not ours: not read
    with pytest.raises(ValueError, match="_qmc_prompt"):
        resolve(params_with({"qmc_method": "lattice", "qmc_seed": 7, "_qmc_prompt": 5}))

    import asyncio

    async def route(extra):
        params = [params_with(extra) for _ in range(3)]
        for p in params:
            mark_prompt(p)
        return params

    marked = asyncio.run(route({"qmc_method": "lattice", "qmc_seed": 7}))
    assert [prompt_index(p) for p in marked] == [0, 1, 2]
    assert [resolve(p).seed for p in marked] == [7, prompt_seed(7, 1), prompt_seed(7, 2)]
    hostile = asyncio.run(route({"qmc_method": "lattice", "qmc_seed": 7, "_qmc_prompt": 0}))
    assert [p.extra_args.get("_qmc_prompt") for p in hostile] == [0, 0, 0]  # never overwritten, never sealed
    for p in hostile:
        with pytest.raises(ValueError, match="'_qmc_prompt'"):
            resolve(p)
