"""Worker bookkeeping: member indices, pending draws, parking across preemption (no engine)."""

from qmc_sampler.vllm_plugin.members import GroupRegistry, Pending, token_history
from qmc_sampler.vllm_plugin.request_args import QMCRequest

REQ = QMCRequest(method="lattice", seed=1, n=4, order="id", group="g", index=None)
KW = dict(top_k=0, top_p=1.0, temperature=1.0, min_p=0.0)


def test_members_get_indices_in_order_of_arrival_per_group():
    reg = GroupRegistry()
    rows = [reg.admit(REQ, [], **KW) for _ in range(3)]
    other = reg.admit(QMCRequest("lattice", 1, 4, "id", "h", None), [], **KW)
    assert [r.state.member for r in rows] == [0, 1, 2]
    assert other.state.member == 0


def test_an_explicit_index_is_used():
    reg = GroupRegistry()
    row = reg.admit(QMCRequest("lattice", 1, 8, "id", "g", 5), [], **KW)
    assert row.state.member == 5


def test_a_draw_is_committed_only_when_the_engine_accepts_it():
    reg = GroupRegistry()
    row = reg.admit(REQ, [], **KW)
    row.state.code = 0.6
    row.pending = Pending(uniform=0.6, start=0.5, prob=0.25, token=9)
    row.sync(0, None, reg.stats)  # discarded (chunked prefill): nothing changes
    assert row.state.step == 0 and row.pending is None and row.state.code == 0.6
    row.pending = Pending(uniform=0.6, start=0.5, prob=0.25, token=9)
    row.sync(1, 9, reg.stats)  # accepted
    assert row.state.step == 1 and abs(row.state.code - 0.4) < 1e-12 and row.state.width == 0.25


def test_a_parked_member_is_resumed_by_its_token_history():
    reg = GroupRegistry()
    a, b = reg.admit(REQ, [], **KW), reg.admit(REQ, [], **KW)
    for row, tok in ((a, 3), (b, 4)):
        row.pending = Pending(uniform=0.5, start=0.25, prob=0.5, token=tok)
        row.sync(1, tok, reg.stats)
    reg.park(a)
    reg.park(b)
    assert reg.admit(REQ, [4], **KW) is b
    assert reg.admit(REQ, [3], **KW) is a
    assert reg.stats.restored == 2 and reg.stats.lost_members == 0


def test_a_pending_draw_accepted_while_parked_is_committed_on_resume():
    reg = GroupRegistry()
    row = reg.admit(REQ, [], **KW)
    row.pending = Pending(uniform=0.5, start=0.25, prob=0.5, token=7)
    reg.park(row)
    again = reg.admit(REQ, [7], **KW)
    assert again is row
    again.sync(1, 7, reg.stats)
    assert again.state.step == 1 and not again.state.fresh


def test_an_unrecoverable_member_continues_fresh_and_is_counted():
    reg = GroupRegistry()
    row = reg.admit(REQ, [1, 2, 3], **KW)
    assert row.state.fresh and row.state.step == 3 and reg.stats.lost_members == 1


def test_members_beyond_n_fall_back_to_fresh_uniforms():
    reg = GroupRegistry()
    rows = [reg.admit(REQ, [], **KW) for _ in range(5)]
    assert rows[4].state.fresh and reg.stats.overflow == 1


def test_token_history_tells_sequences_apart():
    assert token_history([1, 2]) != token_history([2, 1])
    assert token_history([]) != token_history([0])


def test_a_new_request_never_takes_a_parked_siblings_member():
    reg = GroupRegistry()
    first = reg.admit(REQ, [], key=object(), **KW)
    first.pending = Pending(uniform=0.5, start=0.25, prob=0.5, token=7)
    reg.park(first)  # preempted before its first token was known to be accepted
    newcomer = reg.admit(REQ, [], key=object(), **KW)
    assert newcomer is not first and newcomer.state.member == 1
    owner_ids = [7]
    assert reg.admit(REQ, owner_ids, key=first.key, **KW) is first


def test_identity_wins_over_history():
    reg = GroupRegistry()
    a, b = reg.admit(REQ, [], key="a", **KW), reg.admit(REQ, [], key="b", **KW)
    reg.park(a)
    reg.park(b)
    assert reg.admit(REQ, [], key="b", **KW) is b
