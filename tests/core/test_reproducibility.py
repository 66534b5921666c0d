"""Same seed ⇒ same group, whatever the batch composition, order or chunking."""

import random

import numpy as np
import torch

from qmc_sampler import METHODS, GroupSpec, MemberState, sample_group, sample_members


def test_a_group_is_the_same_whatever_else_is_in_the_batch(toy_model):
    target = GroupSpec("lattice", 8, seed=77)
    alone = sample_group(toy_model.next_logits, target, max_tokens=3)
    others = [GroupSpec(m, 8, seed=s) for m in METHODS for s in (1, 2)]
    states = [MemberState(spec=s, member=i) for s in [*others, target] for i in range(8)]
    random.Random(0).shuffle(states)
    seqs: dict[int, list[int]] = {id(s): [] for s in states}
    for _ in range(3):
        # Rows also arrive in a different order every step, like a scheduler's batch.
        random.Random(len(seqs)).shuffle(states)
        logits = toy_model.next_logits([seqs[id(s)] for s in states])
        rows = len(states)
        draw = sample_members(
            logits, states, torch.ones(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows)
        )
        for s, t in zip(states, draw.tokens.tolist(), strict=True):
            seqs[id(s)].append(t)
    mine = sorted((s for s in states if s.spec == target), key=lambda s: s.member)
    assert [seqs[id(s)] for s in mine] == alone


def test_a_member_can_be_sampled_alone_and_matches_its_group(toy_model):
    for method in METHODS:
        group = sample_group(toy_model.next_logits, GroupSpec(method, 4, seed=5), max_tokens=3)
        state = MemberState(spec=GroupSpec(method, 4, seed=5), member=2)
        seq: list[int] = []
        for _ in range(3):
            draw = sample_members(toy_model.next_logits([seq]), [state], torch.ones(1))
            seq.append(int(draw.tokens[0]))
        assert seq == group[2], method


def test_different_seeds_give_different_groups(toy_model):
    a = sample_group(toy_model.next_logits, GroupSpec("lattice", 8, seed=1), max_tokens=3)
    b = sample_group(toy_model.next_logits, GroupSpec("lattice", 8, seed=2), max_tokens=3)
    assert a != b


def test_eos_stops_a_member_and_is_kept(toy_model):
    seqs = sample_group(toy_model.next_logits, GroupSpec("iid", 16, seed=3), max_tokens=3, eos_token_id=0)
    for s in seqs:
        assert 0 not in s[:-1]
    assert any(len(s) < 3 for s in seqs)
    assert np.mean([len(s) for s in seqs]) > 1
