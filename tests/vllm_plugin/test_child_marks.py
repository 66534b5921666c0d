"""One ``n > 1`` request's children over two data-parallel engines, through vLLM's own fan-out (no engine).

What ``vllm serve --data-parallel-size 2`` does with such a request, piece by piece: admission
(the plugin's ``validate_params``: :func:`resolve`), vLLM's ``ParentRequest.get_child_info`` for each
child (as ``AsyncLLM.add_request`` fans it out), vLLM's msgpack coding of each child's
``EngineCoreRequest`` (what an engine core receives), and each child admitted by the engine its
balancer picked — round robin on a burst, so the children alternate between ranks 0 and 1 — where
the worker reads the placement back (:func:`read_request`) into that engine's member registry.
"""

import copy

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_plugin.request_args import install_child_marks, read_request, resolve  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.engine.parallel_sampling import ParentRequest  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from qmc_sampler.group import GroupSpec  # noqa: E402
from qmc_sampler.members import EngineSalt, GroupResolver, MemberRegistry, RowSampling  # noqa: E402

PROMPT = [1, 70, 122, 35]


def engine_requests(params: SamplingParams) -> list[EngineCoreRequest]:
    """The children of ``params``' request as an engine core receives them."""
    resolve(params)  # in the front end, before the fan-out
    request = EngineCoreRequest(
        request_id="cmpl-1-0a1b", prompt_token_ids=PROMPT, mm_features=None, sampling_params=params,
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None,
        external_req_id="cmpl-1",
    )  # fmt: skip
    parent = ParentRequest(request)
    children = []
    for index in range(params.n):  # as AsyncLLM.add_request
        request_id, child_params = parent.get_child_info(index)
        child = copy.copy(request)
        child.request_id, child.sampling_params = request_id, child_params
        children.append(MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(child)))
    return children


def drawn_on_two_engines(children: list[EngineCoreRequest]) -> list[tuple[GroupSpec, int]]:
    """(spec, member) of each child, the children alternating between data-parallel ranks 0 and 1."""
    engines = [MemberRegistry(resolver=GroupResolver(salt=EngineSalt(0, rank))) for rank in (0, 1)]
    drawn = []
    for at, child in enumerate(children):
        args = read_request(child.sampling_params.extra_args)
        member = engines[at % 2].admit(args, RowSampling(1.0, 0, 1.0, 0.0), PROMPT, [], identity=at)
        drawn.append((member.placement.spec, member.placement.member))
    return drawn


def test_an_explicit_indexed_group_split_over_two_engines_holds_its_eight_members():
    install_child_marks()  # what the plugin's hooks do in vLLM's front end
    xargs = {"qmc_method": "lattice", "qmc_group": "g", "qmc_index": 8, "qmc_n": 16, "qmc_seed": 7}
    drawn = drawn_on_two_engines(engine_requests(SamplingParams(n=8, temperature=1.0, extra_args=xargs)))
    # Members 8 … 15 of the one group, each once (without the marks: 8, 8, 9, 9, … — 4 of 8, under one seed).
    assert drawn == [(GroupSpec("lattice", 16, 7), member) for member in range(8, 16)]


def test_a_request_group_split_over_two_engines_is_one_whole_group():
    install_child_marks()
    drawn = drawn_on_two_engines(engine_requests(SamplingParams(n=8, temperature=1.0, seed=5,
                                                                extra_args={"qmc_method": "lattice"})))  # fmt: skip
    assert drawn == [(GroupSpec("lattice", 8, 5), member) for member in range(8)]


def test_requests_without_a_design_are_fanned_out_as_vllm_does():
    install_child_marks()
    params = SamplingParams(n=3, temperature=1.0, extra_args={"other": 1})
    children = engine_requests(params)
    assert [c.sampling_params.extra_args for c in children] == [{"other": 1}] * 3  # nothing of ours added
    request = EngineCoreRequest("r", PROMPT, None, params, None, 0.0, None, None, None, external_req_id="r")
    parent = ParentRequest(request)
    assert parent.get_child_info(0)[1] is parent.get_child_info(1)[1]  # vLLM's one children's params, not copies
