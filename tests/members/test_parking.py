"""Parked members at scale (no engine): the history index, its bounds, expiry with the group, the read-back.

A hot identical prompt (lm-eval repeats, the server's default design) parks thousands
of members under one group key. Admission must find a returning request's member in
constant work, pick exactly the member the specification picks (the linear scan over
:meth:`Member.consistent_with` in park order), and parked members must stay bounded.
No test here times anything: costs are counted (hash computations, candidate checks).
"""

import logging
import random

import pytest
import torch

from qmc_sampler.members import (
    AUTO,
    PER_REQUEST,
    DevicePool,
    GroupArgs,
    GroupResolver,
    Member,
    MemberRegistry,
    Pending,
    RowSampling,
    token_history,
)
from qmc_sampler.members import history as history_module

PLAIN = RowSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
PROMPT = [1, 2, 3]


def request(group="req:g", n=1 << 20):
    return GroupArgs(PER_REQUEST, "lattice", "id", 1, n, group)


def auto(arrival, ttl=5.0, key="k"):
    return GroupArgs(AUTO, "lattice", "id", None, 0, params_key=key, arrival=arrival, ttl=ttl)


def admit(reg, req=None, output=(), identity=None, prompt=PROMPT):
    return reg.admit(req or request(), PLAIN, prompt, list(output), identity)


def accept(reg, member, token):
    reg.record_draw(member, Pending(uniform=0.5, start=0.25, prob=0.5, token=token))
    reg.sync(member, member.state.step + 1, token)


def parked_at(reg, tokens, count, req=None, identity=None):
    """``count`` members of one key, each parked after accepting ``tokens``."""
    members = []
    for _ in range(count):
        m = admit(reg, req, identity=identity)
        for t in tokens:
            accept(reg, m, t)
        reg.park(m)
        members.append(m)
    return members


def scan(parked_in_order, key, identity, output):
    """The specification: the linear scan admission did before the index (kept verbatim)."""
    candidates = [m for m in parked_in_order if m.group_key == key and m.consistent_with(output)]
    found = None
    if identity is not None:
        found = next((m for m in candidates if m.identity == identity), None)
    if found is None and output and candidates:
        found = next((m for m in candidates if m.state.step == len(output)), candidates[0])
    return found


@pytest.mark.parametrize("seed", range(4))
def test_admission_takes_the_member_the_linear_scan_takes(seed):
    # Random traffic over two keys, a two-token alphabet (many identical histories, so
    # buckets hold several members and order matters), shared identities (MRV2's params
    # objects), pending draws, discarded and skipped counts, reclaims (MRV2) and V1 parks.
    rng = random.Random(seed)
    reg = MemberRegistry()
    keys = [request("req:a"), request("req:b")]
    active: list[Member] = []
    parked: list[Member] = []  # park order, as the specification sees it
    checked = {"restored": 0, "new": 0}
    logging.getLogger("vllm.qmc_sampler").setLevel(logging.ERROR)  # lost members warn each
    try:
        for _ in range(3000):
            op = rng.random()
            if op < 0.3 or not active:
                req = rng.choice(keys)
                output = [rng.choice((3, 4)) for _ in range(rng.choice((0, 0, 1, 2, 3)))]
                identity = rng.choice((None, 1, 2))
                expected = scan(parked, req.group, identity, output)
                got = admit(reg, req, output, identity)
                if expected is None:
                    assert got not in parked and got not in active
                    checked["new"] += 1
                else:
                    assert got is expected, (output, identity)
                    parked.remove(got)
                    checked["restored"] += 1
                active.append(got)
            elif op < 0.55:
                accept(reg, rng.choice(active), rng.choice((3, 4)))
            elif op < 0.65:
                m = rng.choice(active)
                reg.record_draw(m, Pending(uniform=0.5, start=0.25, prob=0.5, token=rng.choice((3, 4))))
            elif op < 0.68:
                m = rng.choice(active)
                reg.sync(m, m.state.step + 2, None)  # a count that skipped a token: history unknown
            elif op < 0.9:
                m = active.pop(rng.randrange(len(active)))
                if rng.random() < 0.5:
                    reg.park(m)  # MRV2: a pending draw stays in doubt
                else:  # V1: the engine's list settles it (accepted, or discarded)
                    accepted = m.state.step + (1 if m.draw_pending and rng.random() < 0.7 else 0)
                    reg.park(m, accepted, rng.choice((3, 4)) if accepted else None)
                parked.append(m)
            elif parked:
                m = parked.pop(rng.randrange(len(parked)))
                assert reg.reclaim(m)
                active.append(m)
            assert reg.parked() == len(parked)
    finally:
        logging.getLogger("vllm.qmc_sampler").setLevel(logging.NOTSET)
    assert checked["restored"] > 100 and checked["new"] > 100, checked


@pytest.mark.parametrize("pending_first", [True, False])
def test_both_histories_of_a_pending_member_are_searched_in_park_order(pending_first):
    # One history, two members of one params object (MRV2 identity): one parked exactly at
    # it, one whose pending draw completes it. The identity rule takes the earlier parked
    # of the two; without an identity, the member exactly at the history comes first.
    def pending_member(reg):
        m = admit(reg, identity=5)
        accept(reg, m, 3)
        reg.record_draw(m, Pending(uniform=0.5, start=0.25, prob=0.5, token=4))
        reg.park(m)  # its draw of 4 still in doubt
        return m

    for identity in (5, None):
        reg = MemberRegistry()
        if pending_first:
            early, late = pending_member(reg), parked_at(reg, [3, 4], 1, identity=5)[0]
        else:
            early, late = parked_at(reg, [3, 4], 1, identity=5)[0], pending_member(reg)
        exact = late if pending_first else early
        expected = early if identity is not None else exact
        assert admit(reg, output=[3, 4], identity=identity) is expected


def test_admission_hashes_the_history_once_however_many_are_parked(monkeypatch):
    # Before the index, every admission checked every parked member of its key and
    # rehashed its own output per candidate at the same length: O(parked) per admission.
    reg = MemberRegistry()
    parked_at(reg, [3, 4], 300)
    target = parked_at(reg, [4, 4], 1)[0]
    parked_at(reg, [4, 3], 300)
    hashes, checks = [], []
    real_hash, real_check = history_module.token_history, Member.consistent_with
    monkeypatch.setattr(history_module, "token_history", lambda *a: hashes.append(1) or real_hash(*a))
    monkeypatch.setattr(Member, "consistent_with", lambda self, o: checks.append(1) or real_check(self, o))
    assert admit(reg, output=[4, 4]) is target
    assert len(hashes) <= 2 and not checks, (len(hashes), len(checks))  # the prefix, then one more token
    assert admit(reg, output=[3, 3]).state.fresh  # no member there: a new one, same cost
    assert len(hashes) <= 4 and not checks, (len(hashes), len(checks))


def test_parked_members_are_bounded_per_group_key_oldest_first(caplog):
    # vLLM's logging setup stops "vllm.*" loggers from propagating to the root logger (and other
    # imports in a session can raise the root level): capture on the plugin's logger itself.
    logger = logging.getLogger("vllm.qmc_sampler")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.qmc_sampler"):
            reg = MemberRegistry(max_parked_per_key=3)
            hot = [parked_at(reg, [t], 1)[0] for t in (10, 11, 12, 13, 14)]
            other = parked_at(reg, [10], 2, request("req:other"))
    finally:
        logger.removeHandler(caplog.handler)
    assert reg.parked() == 5 and reg.stats.parked_dropped == 2
    assert "dropped parked member" in caplog.text and "max_parked_per_key" in caplog.text
    for m, t in zip(hot[2:], (12, 13, 14), strict=True):  # the hot key keeps its newest three
        assert admit(reg, output=[t]) is m
    assert [admit(reg, request("req:other"), [10]) for _ in other] == other  # the other key untouched
    # A dropped member's request comes back: unmatched, so an orphan — a seed of its own, fresh
    # uniforms (exact), counted as lost and as an orphan — never a sibling's member.
    lost = reg.stats.lost
    again = admit(reg, output=[10])
    assert again is not hot[0] and again.state.fresh and reg.stats.lost == lost + 1
    assert again.placement.spec.seed not in {m.placement.spec.seed for m in hot} and reg.resolver.stats.orphans == 1


def test_parked_members_are_bounded_in_all():
    reg = MemberRegistry(max_parked=4)
    members = [parked_at(reg, [t], 1, request(f"req:{t}"))[0] for t in range(6)]
    assert reg.parked() == 4 and reg.stats.parked_evicted == 2 and reg.stats.parked_dropped == 0
    assert admit(reg, request("req:0"), [0]) is not members[0]
    assert admit(reg, request("req:5"), [5]) is members[5]


def test_parked_members_expire_with_their_auto_group():
    now = [100.0]
    reg = MemberRegistry(resolver=GroupResolver(clock=lambda: now[0]))
    a, b = admit(reg, auto(100.0)), admit(reg, auto(100.0))
    accept(reg, a, 3)
    accept(reg, b, 4)
    reg.park(a)
    reg.park(b)  # the group is idle from 100.0
    assert reg.parked() == 2
    late = admit(reg, auto(106.0))  # after the TTL: the group is closed, and its parked members with it
    assert reg.resolver.stats.auto_expired == 1 and reg.parked() == 0 and reg.stats.parked_expired == 2
    assert late.placement.member == 0 and late.placement.spec.seed != a.placement.spec.seed
    back = admit(reg, auto(106.0), [3])  # a's request returns: fresh uniforms, exact, counted
    assert back is not a and back.state.fresh and reg.stats.lost == 1


def test_parked_members_go_when_their_auto_group_is_evicted():
    now = [100.0]
    reg = MemberRegistry(resolver=GroupResolver(max_open_groups=1, clock=lambda: now[0]))
    a = admit(reg, auto(100.0, key="first"))
    accept(reg, a, 3)
    reg.park(a)
    admit(reg, auto(101.0, key="second"))  # a second open group evicts the idle first one
    assert reg.resolver.stats.auto_evicted == 1 and reg.parked() == 0 and reg.stats.parked_expired == 1
    assert admit(reg, auto(101.0, key="first"), [3]) is not a


def test_a_group_opened_while_every_other_is_live_is_kept():
    # At max_open_groups with every group live, the group being opened was the only idle
    # one, and eviction took it before its first member was placed (a KeyError in the step).
    resolver = GroupResolver(max_open_groups=1, clock=lambda: 100.0)
    first = resolver.place(auto(100.0, key="first"), resolver.key(auto(100.0, key="first"), PROMPT))
    resolver.joined(first)
    second = resolver.place(auto(100.0, key="second"), resolver.key(auto(100.0, key="second"), PROMPT))
    assert second.member == 0 and resolver.open_auto_groups() == 2 and resolver.stats.auto_evicted == 0


def test_a_live_auto_groups_parked_members_stay():
    reg = MemberRegistry(resolver=GroupResolver(clock=lambda: 100.0))
    a, b = admit(reg, auto(100.0)), admit(reg, auto(100.0))
    accept(reg, a, 3)
    reg.park(a)  # b is still in the batch: the group stays open whatever the time
    assert admit(reg, auto(1000.0)).placement.member == 2
    assert admit(reg, auto(1000.0), [3]) is a and b.slot >= 0 and reg.stats.parked_expired == 0


def test_a_reclaimed_member_is_out_of_the_index():
    # Model Runner V2 parks a member its step leaves out and reclaims it when its slot
    # returns: no admission may take it while it is back in the batch.
    reg = MemberRegistry()
    m = parked_at(reg, [3], 1)[0]
    assert reg.reclaim(m)
    other = admit(reg, output=[3])
    assert other is not m and reg.parked() == 0
    reg.park(m)
    assert admit(reg, output=[3]) is m


def test_a_pool_row_is_read_back_in_one_transfer(monkeypatch):
    pool = DevicePool(capacity=4)
    values = dict(code=0.1 + 2**-40, width=1e-300, u=0.7, start=0.5, prob=1 / 3, alone=2**-52, token=262_143,
                  accepted_token=-1, history=2**62 - 1, overridden=3, engine_sampled=2, fresh=True, drawn_by_us=False,
                  carries=True)  # fmt: skip
    pool.put(2, **values)
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a scalar read per column"))
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(1) or real_cpu(self, *a, **k))
    row = pool.get(2)
    assert row == values and len(reads) == 1
    assert [type(row[k]) for k in ("code", "history", "fresh")] == [float, int, bool]


def test_parking_and_counters_read_the_device_without_scalar_reads(monkeypatch):
    reg = MemberRegistry()
    a, b = admit(reg), admit(reg)
    reg.record_draw(a, Pending(uniform=0.5, start=0.25, prob=0.5, token=7))
    reg.sync(a, 1, 8)  # the engine took another token: an event count on the device
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a scalar read"))
    assert reg.counters().lost == 1
    reg.record_draw(b, Pending(uniform=0.5, start=0.25, prob=0.5, token=7))
    reg.sync(b, 1, 8)
    reg.park(b)
    assert reg.stats.lost == 2 and b.history == token_history([8]) and b.state.fresh
