"""The V1 runner's batch updates (vLLM's own BatchUpdate, no engine) keep each row on its member.

vLLM's CPU attention never reorders the batch, so swaps (which GPU attention backends issue
to put decodes first) cannot happen in an engine on this machine; they are driven here with
vLLM's real types.
"""

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_plugin.adapters import V1Rows
from qmc_sampler.vllm_plugin.request_args import resolve
from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

from qmc_sampler.members import MemberRegistry

PROMPT = [1, 2, 3]


def params(index: int) -> SamplingParams:
    """A member's parameters as the front end hands them to the engine (resolved)."""
    extra = {"qmc_method": "lattice", "qmc_seed": 5, "qmc_group": "g", "qmc_index": index, "qmc_n": 8}
    sampling = SamplingParams(temperature=1.0, extra_args=extra)
    resolve(sampling)
    return sampling


def batch(size, removed=(), added=(), moved=()) -> BatchUpdate:
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def row_members(rows: V1Rows) -> dict[int, int]:
    row_ids, members = rows.active()
    return {row: member.placement.member for row, member in zip(row_ids, members, strict=True)}


@pytest.fixture
def three_rows():
    registry = MemberRegistry()
    rows = V1Rows(registry)
    rows.update(batch(3, added=[(i, params(i), PROMPT, []) for i in range(3)]))
    assert row_members(rows) == {0: 0, 1: 1, 2: 2}
    return registry, rows


def test_a_swap_exchanges_the_two_rows_members(three_rows):
    registry, rows = three_rows
    rows.update(batch(3, moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert row_members(rows) == {0: 2, 1: 1, 2: 0}
    assert registry.parked() == 0


def test_condensing_moves_a_member_into_the_hole_of_one_that_left(three_rows):
    registry, rows = three_rows
    # Row 1 finished; vLLM condenses by moving row 2 onto it and lists only the move.
    rows.update(batch(2, moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert row_members(rows) == {0: 0, 1: 2}
    assert registry.parked() == 1  # member 1 left (parked in case it comes back)


def test_a_removed_row_is_parked_and_a_new_request_takes_its_index(three_rows):
    registry, rows = three_rows
    rows.update(batch(3, removed=[1], added=[(1, params(3), PROMPT, [])]))
    assert row_members(rows) == {0: 0, 1: 3, 2: 2}
    assert registry.parked() == 1


def test_a_70_bit_top_k_keeps_every_token_and_fits_the_batch_tensors():
    # vLLM takes any top_k >= -1 (it clamps to the vocabulary itself); an int64 batch tensor of 2**70
    # failed every step of the batch the request was in, every designed row of it left to vLLM.
    from qmc_sampler.vllm_plugin.adapters import row_sampling

    sampling = row_sampling(SamplingParams(temperature=1.0, top_k=2**70))
    assert sampling.top_k == 2**31 - 1
    np.array([sampling.top_k], dtype=np.int64)
