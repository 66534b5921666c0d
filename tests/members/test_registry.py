"""The member registry (no engine): placement, the draw cycle on the device, parking and resumption."""

import gc
import weakref

import numpy as np
import torch

from qmc_sampler.group import member_uniforms
from qmc_sampler.members import (
    AUTO,
    EXPLICIT,
    PER_REQUEST,
    GroupArgs,
    GroupResolver,
    MemberRegistry,
    Pending,
    RowSampling,
    extend_history,
    token_history,
)

REQ = GroupArgs(PER_REQUEST, "lattice", "id", 1, 4, "req:g")
PLAIN = RowSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
PROMPT = [1, 2, 3]


def admit(reg, request=REQ, output=(), identity=None):
    return reg.admit(request, PLAIN, PROMPT, list(output), identity)


def accept(reg, member, token, accepted):
    reg.record_draw(member, Pending(uniform=0.5, start=0.25, prob=0.5, token=token))
    reg.sync(member, accepted, token)


def test_members_get_indices_in_order_of_arrival_per_group():
    reg = MemberRegistry()
    rows = [admit(reg) for _ in range(3)]
    other = admit(reg, GroupArgs(PER_REQUEST, "lattice", "id", 1, 4, "req:h"))
    assert [r.placement.member for r in rows] == [0, 1, 2]
    assert other.placement.member == 0


def test_an_explicit_index_is_used():
    reg = MemberRegistry()
    member = admit(reg, GroupArgs(EXPLICIT, "lattice", "id", 1, 8, "user:g", 5))
    assert member.placement.member == 5 and member.state.member == 5


def test_a_draw_is_committed_only_when_the_engine_accepts_it():
    reg = MemberRegistry()
    m = admit(reg)
    start = m.state.code  # the member's start code, written to the device at admission
    reg.record_draw(m, Pending(uniform=0.6, start=0.5, prob=0.25, token=9))
    reg.sync(m, 0, None)  # discarded (chunked prefill): nothing changes
    state = reg.settle(m)
    assert state.step == 0 and m.pending is None and state.code == start
    reg.record_draw(m, Pending(uniform=0.6, start=0.5, prob=0.25, token=9))
    reg.sync(m, 1, 9)  # accepted: carried on the device
    state = reg.settle(m)
    assert state.step == 1 and abs(state.code - 0.4) < 1e-12 and state.width == 0.25 and not state.fresh
    assert m.history == token_history([9])


def test_a_token_the_engine_chose_instead_is_counted_and_the_member_goes_on_fresh():
    reg = MemberRegistry()
    m = admit(reg)
    reg.record_draw(m, Pending(uniform=0.5, start=0.25, prob=0.5, token=7))
    reg.sync(m, 1, 8)  # the engine accepted 8, not our 7 (found on the device, counted when read)
    assert reg.settle(m).fresh and reg.counters().lost == 1 and m.history == token_history([8])


def test_the_device_extends_a_token_history_exactly_as_the_host_does():
    gen = np.random.default_rng(0)
    tokens = gen.integers(0, 262_144, size=(64, 40))  # vocabularies up to 2^18
    device_h = torch.zeros(64, dtype=torch.int64)
    for step in range(tokens.shape[1]):
        device_h = extend_history(device_h, torch.from_numpy(tokens[:, step]))
    assert device_h.tolist() == [token_history(row) for row in tokens.tolist()]
    assert len(set(device_h.tolist())) == 64 and all(0 <= h < 2**62 for h in device_h.tolist())
    assert token_history([5, 6]) != token_history([6, 5]) and token_history([0]) != token_history([])


def test_model_runner_v2s_tokens_are_taken_on_the_device():
    # MRV2: the host knows counts only; the accepted tokens are the runner's device tensor.
    reg = MemberRegistry()
    ours, other = admit(reg), admit(reg)
    for m in (ours, other):
        reg.record_draw(m, Pending(uniform=0.6, start=0.5, prob=0.25, token=9))
    reg.sync_all([ours, other], [1, 1], torch.tensor([9, 4]))  # the runner fed 9 and 4
    assert abs(reg.settle(ours).code - 0.4) < 1e-12  # (u - start) / q, carried
    assert ours.history == token_history([9]) and not ours.state.fresh
    assert reg.settle(other).fresh and other.history == token_history([4]) and reg.counters().lost == 1


def test_a_row_the_kernel_cannot_draw_from_is_left_to_the_engine_and_counted():
    reg = MemberRegistry()
    a, b = admit(reg), admit(reg)
    logits = torch.zeros(2, 5)
    logits[1] = float("nan")
    ones, slots = torch.ones(2), torch.tensor([a.slot, b.slot])
    draw = reg.draw(logits, [a, b], ones, None, None, None, slots=slots)
    assert draw.tokens[0] >= 0 and draw.tokens[1] == -1  # no exception: the engine samples row 1
    reg.sync(a, 1, int(draw.tokens[0]))
    reg.sync(b, 1, 3)
    assert reg.settle(a).step == reg.settle(b).step == 1 and reg.settle(b).fresh
    assert (reg.counters().unsampleable, reg.counters().lost) == (1, 0)


def test_a_parked_member_is_resumed_by_its_token_history():
    reg = MemberRegistry()
    a, b = admit(reg), admit(reg)
    accept(reg, a, 3, 1)
    accept(reg, b, 4, 1)
    reg.park(a)
    reg.park(b)
    assert admit(reg, output=[4]) is b
    assert admit(reg, output=[3]) is a
    assert reg.stats.restored == 2 and reg.stats.lost == 0


def test_a_pending_draw_accepted_while_parked_is_committed_on_resume():
    reg = MemberRegistry()
    m = admit(reg)
    reg.record_draw(m, Pending(uniform=0.5, start=0.25, prob=0.5, token=7))
    reg.park(m)
    again = admit(reg, output=[7])
    assert again is m
    reg.sync(again, 1, 7)
    assert reg.settle(again).step == 1 and not again.state.fresh


def test_identity_is_checked_against_the_token_history():
    # Model Runner V2 identifies members by the params object, which the children
    # of one request share: a sibling with another history must not be taken.
    reg = MemberRegistry()
    shared = 1234  # one params object for both children
    a, b = admit(reg, identity=shared), admit(reg, identity=shared)
    accept(reg, a, 3, 1)
    accept(reg, b, 4, 1)
    reg.park(a)
    reg.park(b)
    assert admit(reg, output=[4], identity=shared) is b
    assert admit(reg, output=[3], identity=shared) is a


def test_an_unrecoverable_member_continues_fresh_and_is_counted():
    reg = MemberRegistry()
    m = admit(reg, output=[1, 2, 3])
    assert m.state.fresh and m.state.step == 3 and reg.stats.lost == 1


def test_members_beyond_n_draw_their_own_fresh_streams():
    # A per-step design's extra member used to take member % n and repeat a
    # sibling's completion exactly; it must get a stream of its own.
    for method in ("iid", "sobol", "antithetic", "lattice", "stratified"):
        reg = MemberRegistry()
        request = GroupArgs(PER_REQUEST, method, "id", 7, 4, "req:x")
        members = [admit(reg, request) for _ in range(6)]
        assert [m.placement.member for m in members] == [0, 1, 2, 3, 4, 5]
        assert members[4].state.fresh and members[5].state.fresh
        assert reg.resolver.stats.overflow == 2
        for step in range(5):
            for m in members:
                m.state.step = step
            u = member_uniforms([m.state for m in members])
            for extra in (4, 5):
                assert not np.isin(u[extra], np.delete(u, extra)), (method, step, u)


def test_parked_members_hold_no_engine_buffers():
    class OutputIds(list):  # a list the test can watch
        pass

    reg = MemberRegistry()
    output = OutputIds(range(1000))
    watch = weakref.ref(output)
    m = reg.admit(REQ, PLAIN, PROMPT, output, id(output))
    reg.park(m)
    del output
    gc.collect()
    assert watch() is None, "a parked member keeps the engine's output-id list alive"
    assert reg.parked() == 1


def test_a_new_request_never_takes_a_parked_siblings_member():
    reg = MemberRegistry()
    first = admit(reg, identity=1)
    reg.record_draw(first, Pending(uniform=0.5, start=0.25, prob=0.5, token=7))
    reg.park(first)  # preempted before its first token was known to be accepted
    newcomer = admit(reg, identity=2)
    assert newcomer is not first and newcomer.placement.member == 1
    assert admit(reg, output=[7], identity=1) is first


def test_auto_group_members_are_counted_live_while_in_the_batch():
    reg = MemberRegistry(resolver=GroupResolver())
    request = GroupArgs(AUTO, "lattice", "id", None, 0, params_key="k", arrival=100.0, ttl=5.0)
    a, b = admit(reg, request), admit(reg, request)
    assert (a.placement.member, b.placement.member) == (0, 1)
    reg.park(a)
    reg.park(b)
    later = GroupArgs(AUTO, "lattice", "id", None, 0, params_key="k", arrival=104.0, ttl=5.0)
    assert admit(reg, later).placement.member == 2  # still open: never reuses an index


def test_a_member_that_finished_after_one_draw_is_never_taken_by_a_new_request():
    # A request that finishes right after its first token leaves before that draw is
    # committed. A new request (whose output list may even reuse the freed list's id)
    # must not take the member's code and repeat its token.
    reg = MemberRegistry()
    first = admit(reg, identity=1)
    reg.record_draw(first, Pending(uniform=0.5, start=0.25, prob=0.5, token=7))
    reg.park(first)  # MRV2: the adapter cannot tell whether the draw was accepted
    assert admit(reg, identity=1) is not first
    second = admit(reg, identity=2)
    reg.record_draw(second, Pending(uniform=0.5, start=0.25, prob=0.5, token=8))
    reg.park(second, accepted=1, last_token=8)  # V1: the engine's list settles it
    assert second.state.step == 1 and second.pending is None
    assert admit(reg, identity=2) is not second


def test_a_row_left_to_the_engine_is_counted_once_and_its_member_goes_on_fresh():
    reg = MemberRegistry()
    member = admit(reg)
    accept(reg, member, token=7, accepted=1)
    reg.leave_to_engine([member], "its logits are NaN or all -inf")
    reg.sync(member, 2, 11)  # the engine chose token 11 itself
    assert member.state.step == 2 and reg.settle(member).fresh
    assert member.history == token_history([7, 11])  # still found again after a preemption
    assert (reg.stats.unsampleable, reg.stats.lost) == (1, 0)
