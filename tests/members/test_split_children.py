"""The children of one ``n > 1`` request spread over data-parallel engines (no engine).

vLLM's front end fans an ``n > 1`` request out into children and its data-parallel balancer routes
each child on its own (round robin on a burst), so one request's children reach several engines.
Two resolvers with their engines' salts (data-parallel ranks 0 and 1) stand for two engines, and
the children alternate between them. A child the front end marked with its place in its request
(``GroupArgs.child``) is that member of the one group on any engine; unmarked children are numbered
where they run, under a seed salted by rank, counted and said: distinct, never a member twice.
"""

import dataclasses

import pytest

from qmc_sampler.group import GroupSpec
from qmc_sampler.members import EXPLICIT, PER_REQUEST, EngineSalt, GroupArgs, GroupResolver, groups

PROMPT = [5, 6, 7]


class _Said:
    """Records what the grouping module says (whatever the process's logging setup did to its logger)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def warning(self, message: str, *args: object) -> None:
        self.messages.append(message % args)


@pytest.fixture
def said(monkeypatch):
    recorder = _Said()
    monkeypatch.setattr(groups, "logger", recorder)
    return recorder


def spread(request: GroupArgs, n: int, marked: bool) -> tuple[list, list[GroupResolver]]:
    """Children 0 … n − 1 of ``request``, alternating between two engines (ranks 0 and 1): their placements."""
    engines = [GroupResolver(salt=EngineSalt(0, rank)) for rank in (0, 1)]
    placements = []
    for child in range(n):
        engine = engines[child % 2]
        args = dataclasses.replace(request, child=child) if marked else request
        placements.append(engine.place(args, engine.key(args, PROMPT)))
    return placements, engines


def indexed(index: int = 8, n: int = 8, seed: int = 7) -> GroupArgs:
    # vllm_xargs {qmc_method: lattice, qmc_group: g, qmc_index: 8, qmc_n: 16, qmc_seed: 7} with n = 8
    return GroupArgs(EXPLICIT, "lattice", "id", seed, 16, "user:g:lattice:7", index, children=n, tag="request-1")


def test_marked_children_of_an_indexed_request_are_its_members_on_any_engine():
    placements, _ = spread(indexed(), 8, marked=True)
    assert [p.member for p in placements] == list(range(8, 16))  # qmc_index … qmc_index + n − 1
    assert {p.spec for p in placements} == {GroupSpec("lattice", 16, 7)}  # one group, unsalted: as on one engine
    assert not any(p.fresh for p in placements)


def test_marked_children_of_a_request_group_are_one_whole_group_over_engines():
    request = GroupArgs(PER_REQUEST, "lattice", "id", None, 8, "req:1", fresh_seed=1234)
    placements, _ = spread(request, 8, marked=True)
    assert [p.member for p in placements] == list(range(8))
    assert {p.spec for p in placements} == {GroupSpec("lattice", 8, 1234)}
    seeded, _ = spread(dataclasses.replace(request, seed=99, fresh_seed=None), 8, marked=True)
    assert {p.spec for p in seeded} == {GroupSpec("lattice", 8, 99)}  # the same seed: the same group anywhere


def test_unmarked_children_split_over_engines_are_distinct_members_counted_and_said(said):
    placements, engines = spread(indexed(), 8, marked=False)
    drawn = {(p.spec, p.member) for p in placements}
    assert len(drawn) == 8  # today's numbering without the salt: members 8, 8, 9, 9, … (4 of 8)
    assert {p.member for p in placements[0::2]} == set(range(8, 12))  # rank 0 keeps the group's seed
    assert {p.spec.seed for p in placements[0::2]} == {7}
    assert 7 not in {p.spec.seed for p in placements[1::2]}  # rank 1: a seed of its own
    assert engines[1].stats.children_unmarked == 4 and engines[0].stats.children_unmarked == 0
    assert any("without their place in their request" in m and "rank 1" in m for m in said.messages)


def test_a_marked_child_admitted_again_keeps_its_member():
    # Its parked member was dropped: its index came from the front end, not from a counter, so it is
    # the same member (the registry then continues it with fresh uniforms), never an orphan.
    r = GroupResolver(salt=EngineSalt(0, 1))
    request = dataclasses.replace(indexed(), child=3)
    first = r.place(request, r.key(request, PROMPT))
    again = r.place(request, r.key(request, PROMPT), again=True)
    assert first.member == again.member == 11 and again.spec == first.spec
    assert r.stats.orphans == 0
