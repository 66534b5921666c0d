"""qmc-serve's request fields: how they become the plugin's ``vllm_xargs`` (no server needed)."""

import pytest
from qmc_sampler.server.fields import LEAST_LOADED, FieldError, plan_request


def plan(body, chat=False, **kw):
    return plan_request(body, chat=chat, default_sampler=kw.get("default", "lattice"), max_n=kw.get("max_n", 64))


def test_an_n_gt_1_request_is_an_explicit_group_of_its_own_kept_on_one_engine():
    a = plan({"prompt": "x", "n": 8, "sampler_seed": 3})
    b = plan({"prompt": "x", "n": 8, "sampler_seed": 3})
    xargs = a.body["vllm_xargs"]
    assert {k: xargs[k] for k in ("qmc_method", "qmc_seed", "qmc_index", "qmc_n")} == {
        "qmc_method": "lattice", "qmc_seed": 3, "qmc_index": 0, "qmc_n": 8}  # fmt: skip
    assert xargs["qmc_group"] != b.body["vllm_xargs"]["qmc_group"]  # two requests never share member indices
    assert (a.design, a.seed, a.members, a.groups, a.placement) == ("lattice", 3, 8, 1, LEAST_LOADED)
    assert "sampler_seed" not in a.body  # vLLM never sees our fields


def test_an_offset_extends_a_group_and_the_seed_falls_back_to_xargs_then_seed():
    extended = plan({"prompt": "x", "n": 4, "sampler_offset": 4, "sampler_group_size": 8, "seed": 9})
    assert extended.body["vllm_xargs"] | {"qmc_group": None} == {
        "qmc_method": "lattice", "qmc_seed": 9, "qmc_index": 4, "qmc_n": 8, "qmc_group": None}  # fmt: skip
    assert plan({"prompt": "x", "n": 2, "vllm_xargs": {"qmc_seed": 5}, "seed": 9}).seed == 5
    fresh = [plan({"prompt": "x", "n": 2}).seed for _ in range(2)]
    assert fresh[0] != fresh[1] and all(isinstance(s, int) for s in fresh)


def test_an_n1_request_joins_its_prompts_auto_group_on_the_engine_its_prompt_picks():
    a = plan({"prompt": "the quick", "seed": 77})
    b = plan({"prompt": "the quick", "temperature": 1.5})
    other = plan({"prompt": "pack my box"})
    assert a.body["vllm_xargs"] == {"qmc_method": "lattice", "qmc_seed": 77} and a.seed == 77
    assert b.body["vllm_xargs"] == {"qmc_method": "lattice"} and b.seed is None
    assert a.placement == b.placement != other.placement and a.placement != LEAST_LOADED
    chat = plan({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert chat.placement == plan({"messages": [{"role": "user", "content": "hi"}]}, chat=True).placement


def test_two_different_qmc_seeds_are_refused_so_the_reply_names_the_groups_own():
    mine = {"qmc_group": "g7", "qmc_index": 3, "qmc_n": 8, "qmc_seed": 1}
    with pytest.raises(FieldError, match=r"sampler_seed=2 and vllm_xargs 'qmc_seed'=1 disagree") as info:
        plan({"prompt": "x", "sampler_seed": 2, "vllm_xargs": mine})
    assert info.value.param == "sampler_seed"
    assert plan({"prompt": "x", "sampler_seed": 1, "vllm_xargs": mine}).seed == 1  # the same value in both
    with pytest.raises(FieldError, match="disagree"):
        plan({"prompt": "x", "n": 2, "sampler_seed": 2, "vllm_xargs": {"qmc_seed": 1}})
    greedy = {"prompt": "x", "temperature": 0, "sampler_seed": 2, "vllm_xargs": {"qmc_seed": 1}}
    assert plan(greedy).design is None  # no design, so neither seed is used: nothing to disagree about


def test_a_callers_own_group_in_vllm_xargs_is_kept():
    mine = {"qmc_group": "g7", "qmc_index": 3, "qmc_n": 8, "qmc_seed": 1}
    p = plan({"prompt": "x", "vllm_xargs": mine})
    assert p.body["vllm_xargs"] == mine | {"qmc_method": "lattice"} and p.seed == 1


def test_greedy_and_members():
    greedy = plan({"prompt": ["a", "b", "c"], "n": 2, "temperature": 0})
    assert (greedy.design, greedy.placement, greedy.members, greedy.groups) == (None, None, 6, 3)
    assert "vllm_xargs" not in greedy.body
    assert plan({"prompt": [[1, 2], [3]], "n": 2, "best_of": 3}).members == 6
    assert plan({"prompt": [1, 2, 3], "n": 2}).members == 2  # one prompt of token ids
    assert plan({"prompt": "x", "n": 2, "sampler": "iid", "temperature": 0}).design is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"n": True}, "n"),
        ({"sampler": "lattic"}, "sampler"),
        ({"sampler_seed": 1.5}, "sampler_seed"),
        ({"sampler_seed": 2**70}, "sampler_seed"),
        ({"sampler_seed": -(2**63) - 1}, "sampler_seed"),
        ({"seed": 2**64}, "seed"),
        ({"vllm_xargs": {"qmc_seed": 2**64}}, "vllm_xargs"),
        ({"sampler_group_size": 2**32 + 1, "sampler_seed": 1}, "sampler_group_size"),
        ({"sampler_offset": 2**32, "sampler_group_size": 2**32, "sampler_seed": 1}, "sampler_offset"),
        ({"sampler_offset": True, "sampler_group_size": 4, "sampler_seed": 1}, "sampler_offset"),
        ({"vllm_xargs": {"qmc_group": "g", "qmc_index": 0, "qmc_n": 2**32 + 1}}, "vllm_xargs"),
        ({"sampler_offset": -1}, "sampler_offset"),
        ({"sampler_group_size": 0}, "sampler_group_size"),
        ({"sampler_offset": 4}, "sampler_group_size"),
        ({"n": 8, "sampler_offset": 4, "sampler_group_size": 8, "sampler_seed": 1}, "sampler_group_size"),
        ({"sampler_offset": 4, "sampler_group_size": 8}, "sampler_seed"),
        ({"temperature": 0, "sampler": "lattice"}, "temperature"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"vllm_xargs": "qmc"}, "vllm_xargs"),
        ({"vllm_xargs": {"qmc_method": "nope"}}, "vllm_xargs"),
        ({"vllm_xargs": {"qmc_group": "g", "qmc_n": 2}, "sampler_group_size": 4}, "vllm_xargs"),
    ],
)
def test_bad_fields_name_themselves(body, param):
    with pytest.raises(FieldError) as info:
        plan({"prompt": "x"} | body)
    assert info.value.param == param and info.value.status == 400
    assert info.value.body()["error"]["param"] == param


def test_the_largest_group_is_accepted_with_its_bound_named_in_the_error():
    biggest = plan({"prompt": "x", "sampler": "stratified", "sampler_seed": 3, "sampler_group_size": 2**32})
    assert biggest.body["vllm_xargs"]["qmc_n"] == 2**32
    with pytest.raises(FieldError, match=r"sampler_group_size=4294967297 must be an integer between 1 and 4294967296"):
        plan({"prompt": "x", "sampler_seed": 3, "sampler_group_size": 2**32 + 1})


def test_json_booleans_in_vllm_xargs_mean_what_vllm_parses_them_to():
    # vLLM's request model turns true/false in vllm_xargs into 1/0; so does qmc-serve.
    off = plan({"prompt": "x", "vllm_xargs": {"qmc_auto_group": False}})
    assert off.body["vllm_xargs"]["qmc_auto_group"] == 0
    seeded = plan({"prompt": "x", "n": 2, "vllm_xargs": {"qmc_seed": True}})
    assert seeded.seed == 1


@pytest.mark.parametrize("temperature", ["0", "0.0", False, 0])
def test_a_greedy_temperature_is_read_as_vllm_reads_it(temperature):
    with pytest.raises(FieldError, match="is greedy decoding") as info:
        plan({"prompt": "x", "n": 2, "sampler": "lattice", "temperature": temperature})
    assert info.value.param == "temperature"
    assert plan({"prompt": "x", "n": 2, "sampler": "iid", "temperature": temperature}).design is None


def test_a_lone_repeat_keeps_its_design_where_auto_groups_are_off(monkeypatch):
    assert plan({"prompt": "x", "sampler": "stratified"}).design == "lattice"  # grouped as one by the plugin
    off = plan({"prompt": "x", "sampler": "stratified", "vllm_xargs": {"qmc_auto_group": 0}})
    assert off.design == "stratified" and off.body["vllm_xargs"]["qmc_method"] == "stratified"
    monkeypatch.setenv("QMC_SAMPLER_AUTO_GROUP", "0")
    assert plan({"prompt": "x", "sampler": "stratified"}).design == "stratified"
