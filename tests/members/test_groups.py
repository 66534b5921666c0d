"""Who is which member: the three kinds of group, seeds, salts and auto-group lifetime (no engine)."""

import numpy as np
import pytest

from qmc_sampler.group import EXTENSIBLE, GroupSpec
from qmc_sampler.members import AUTO, EXPLICIT, PER_REQUEST, EngineSalt, GroupArgs, GroupResolver

PROMPT = [5, 6, 7]


def auto(seed=None, t=0.0, ttl=10.0, key="params", method="lattice"):
    return GroupArgs(AUTO, method, "id", seed, 0, params_key=key, arrival=t, ttl=ttl)


def place(resolver, request, prompt=PROMPT):
    return resolver.place(request, resolver.key(request, prompt))


def test_auto_groups_are_extensible_lattices_numbered_by_arrival():
    r = GroupResolver()
    placements = [place(r, auto(t=1.0)) for _ in range(5)]
    assert [p.member for p in placements] == [0, 1, 2, 3, 4]
    assert {p.spec.n for p in placements} == {EXTENSIBLE}
    assert len({p.spec.seed for p in placements}) == 1


def test_other_prompts_params_or_seeds_are_other_groups():
    r = GroupResolver()
    base = place(r, auto(t=1.0))
    assert place(r, auto(t=1.0), prompt=[5, 6, 8]).member == 0
    assert place(r, auto(t=1.0, key="other")).member == 0
    assert place(r, auto(seed=3, t=1.0)).member == 0
    assert place(r, auto(t=1.0)).member == 1 and base.member == 0


class Clock:
    """The worker's wall clock, set by the test."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_open_group_never_reuses_an_index_and_an_expired_one_starts_again():
    clock = Clock()
    r = GroupResolver(clock=clock)
    first = [place(r, auto(seed=42, t=10.0)) for _ in range(3)]
    clock.now = 12.0
    for p in first:
        r.joined(p)
        r.left(p)  # all members finished at 12.0: the group is idle from then
    assert place(r, auto(seed=42, t=21.0)).member == 3  # within the ttl of the last leave: continue
    again = place(r, auto(seed=42, t=30.0))  # long after: the same group from the start
    assert again.member == 0 and again.spec.seed == first[0].spec.seed
    assert r.stats.auto_expired == 1


def test_sequential_repeats_longer_than_the_ttl_stay_one_group():
    # lm-eval with num_concurrent=1: each repeat arrives when the previous one finished,
    # and every generation takes longer than the ttl.
    clock = Clock()
    r = GroupResolver(clock=clock)
    members = []
    for k in range(4):
        t = 5.0 * k
        p = place(r, auto(seed=1234, t=t, ttl=1.0))
        r.joined(p)
        clock.now = t + 4.5  # a 4.5 s generation, then it leaves
        r.left(p)
        members.append(p.member)
    assert members == [0, 1, 2, 3] and r.stats.auto_expired == 0


def test_a_group_with_live_members_does_not_expire():
    r = GroupResolver()
    p = place(r, auto(t=0.0, ttl=1.0))
    r.joined(p)
    assert place(r, auto(t=1000.0, ttl=1.0)).member == 1


def test_unseeded_groups_are_fresh_and_seeded_ones_reproduce():
    def run():
        r = GroupResolver()
        fresh = [place(r, auto(t=0.0), prompt=[i]).spec.seed for i in range(3)]
        return fresh, place(r, auto(seed=9, t=0.0)).spec.seed

    (fresh_a, seeded_a), (fresh_b, seeded_b) = run(), run()
    assert len(set(fresh_a)) == 3  # every new group its own seed
    assert fresh_a == fresh_b  # and the same sequence in every worker of one engine
    assert seeded_a == seeded_b


def test_engines_are_salted_apart_but_explicit_groups_are_not():
    a, b = GroupResolver(salt=EngineSalt(0, 0)), GroupResolver(salt=EngineSalt(0, 1))
    assert place(a, auto(seed=5)).spec.seed != place(b, auto(seed=5)).spec.seed
    request = GroupArgs(PER_REQUEST, "lattice", "id", 5, 8, "req:1")
    assert place(a, request).spec.seed == 5  # rank 0 keeps the user's seed
    assert place(b, request).spec.seed != 5
    explicit = GroupArgs(EXPLICIT, "lattice", "id", 5, 8, "user:g", 3)
    assert place(a, explicit).spec == place(b, explicit).spec == GroupSpec("lattice", 8, 5)


def test_the_children_of_an_n_request_with_an_explicit_index_are_consecutive_members():
    r = GroupResolver()
    request = GroupArgs(EXPLICIT, "lattice", "id", 5, 16, "user:g", 8, children=8, tag="request-1")
    assert [place(r, request).member for _ in range(8)] == list(range(8, 16))
    again = GroupArgs(EXPLICIT, "lattice", "id", 5, 16, "user:g", 0, children=8, tag="request-2")
    assert [place(r, again).member for _ in range(8)] == list(range(8))


def test_overflow_is_counted_and_fresh():
    r = GroupResolver()
    request = GroupArgs(PER_REQUEST, "iid", "id", 1, 2, "req:z")
    placements = [place(r, request) for _ in range(3)]
    assert [p.fresh for p in placements] == [False, False, True]
    assert r.stats.overflow == 1


def test_open_groups_are_bounded_and_live_ones_are_kept():
    r = GroupResolver(max_open_groups=4)
    live = place(r, auto(t=0.0), prompt=[0])
    r.joined(live)
    for i in range(1, 10):
        place(r, auto(t=0.0), prompt=[i])
    assert r.open_auto_groups() == 4
    assert r.stats.auto_evicted == 6
    assert place(r, auto(t=0.0), prompt=[0]).member == 1  # the live group was kept


@pytest.mark.parametrize("method", ["stratified", "arithmetic"])
def test_designs_that_need_their_size_cannot_be_extensible(method):
    with pytest.raises(ValueError, match="needs its group size"):
        GroupSpec(method, EXTENSIBLE, 1)


def test_the_extensible_lattice_is_balanced_over_every_power_of_two_prefix():
    from qmc_sampler.designs import get_design

    codes = get_design("lattice").start_codes(np.full(64, 3, np.uint64), np.zeros(64, np.int64), np.arange(64))
    for m in (1, 2, 4, 8, 16, 32, 64):
        # The first m codes are Δ + {0, 1/m, …, (m−1)/m}: one in each of m equal cells.
        offsets = np.rint(((codes[:m] - codes[0]) % 1.0) * m).astype(int) % m
        assert sorted(offsets) == list(range(m)), m


def _salted(request, salt):
    from dataclasses import replace

    return replace(request, salt=salt)


def test_two_replicas_given_lm_evals_seeded_repeats_alternately_build_no_equal_group(monkeypatch):
    from qmc_sampler.vllm_plugin.request_args import instance_salt

    from qmc_sampler.members.keys import ENV_SALT

    monkeypatch.delenv(ENV_SALT, raising=False)
    # Two replicas started alike (engine seed 0, rank 0), each with its front end's instance salt;
    # lm-eval sends `seed: 1234` with each of 16 repeats, alternately to the two.
    replicas = [(GroupResolver(salt=EngineSalt(0, 0)), instance_salt()) for _ in range(2)]
    members = [place(r, _salted(auto(seed=1234), salt)) for k in range(16)
               for r, salt in [replicas[k % 2]]]  # fmt: skip
    identities = {(p.spec.seed, p.member) for p in members}
    assert len(identities) == 16  # no answer is another's copy
    assert len({p.spec.seed for p in members}) == 2  # one group per replica, not equal groups
    # Pinned (QMC_SAMPLER_SALT): reproducible, and so the same group on both replicas (the documented cost).
    monkeypatch.setenv(ENV_SALT, "77")
    pinned = [place(GroupResolver(), _salted(auto(seed=1234), instance_salt())) for _ in range(2)]
    assert pinned[0].spec == pinned[1].spec and instance_salt() == 77


@pytest.mark.parametrize("raw", ["-1", "x", str(2**64)])
def test_a_bad_pinned_salt_is_refused_naming_the_variable(monkeypatch, raw):
    from qmc_sampler.vllm_plugin.request_args import instance_salt

    from qmc_sampler.members.keys import ENV_SALT

    monkeypatch.setenv(ENV_SALT, raw)
    with pytest.raises(ValueError, match="QMC_SAMPLER_SALT"):
        instance_salt()


def test_an_explicit_group_numbered_by_arrival_never_restarts_a_used_member():
    r = GroupResolver(max_open_groups=1)
    group = GroupArgs(EXPLICIT, "lattice", "id", 5, 8, "user:g:lattice:5", salt=3)
    first = [place(r, group) for _ in range(3)]
    assert [p.member for p in first] == [0, 1, 2] and len({p.spec for p in first}) == 1
    place(r, GroupArgs(EXPLICIT, "lattice", "id", 5, 8, "user:other:lattice:5", salt=3))  # pushes g's counter out
    assert r.stats.arrivals_forgotten == 1
    again = place(r, group)
    assert again.member == 0 and again.spec.seed != first[0].spec.seed  # a new group: never a used member
    # Two engines of one server, and another replica (another salt): other seeds too.
    other_rank = place(GroupResolver(salt=EngineSalt(0, 1)), group)
    other_replica = place(GroupResolver(), GroupArgs(EXPLICIT, "lattice", "id", 5, 8, "user:g:lattice:5", salt=4))
    assert len({first[0].spec.seed, other_rank.spec.seed, other_replica.spec.seed}) == 3


def test_a_readmitted_child_and_a_child_whose_counter_was_forgotten_are_orphans():
    r = GroupResolver(max_open_groups=1)
    request = GroupArgs(PER_REQUEST, "lattice", "id", 9, 3, "req:a")
    assert place(r, request).member == 0
    place(r, GroupArgs(PER_REQUEST, "lattice", "id", 9, 3, "req:b"))  # req:a's counter (1 of 3) forgotten
    assert r.stats.children_forgotten == 1
    late = place(r, request)
    readmitted = r.place(GroupArgs(PER_REQUEST, "lattice", "id", 9, 3, "req:b"), "req:b", again=True)
    assert late.fresh and readmitted.fresh and late.spec.seed != readmitted.spec.seed != 9
    assert r.stats.orphans == 2
