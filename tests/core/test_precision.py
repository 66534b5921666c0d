"""Deep sequences stay exact: the carried code switches to fresh uniforms in time.

A member that carries a float64 code for hundreds of steps of small probabilities
consumes far more than 53 bits. Tests:

* deep steps: the token distribution long after every member went fresh, pooled
  over members and groups, matches the model; and the same run with the
  precision floor disabled is detectably wrong, which shows the floor is what
  keeps it exact (a uniform 4-token model: its CDF is exact in float64, so the
  carry shifts out exactly two bits a step and a code with no floor is all
  zeros after ~27 steps);
* *near* the floor: the tokens a member draws while it still carries, with a
  prefix width W between the floor F and 16·F (24–32 bits of the code already
  consumed at F = 2^-32), match the model. Which steps qualify depends only on
  the past, so each selected token is still a draw from q. The same check with a
  floor too low for float64 (2^-52) fails: that is the regime the floor avoids.

Significance: α = 1e-3 / 8 checks (Bonferroni).
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

import qmc_sampler.group as group_module
from qmc_sampler import GroupSpec, MemberState, sample_members

STEPS = 300
SKEWED = np.array([0.05, 0.15, 0.8])  # ~0.9 bits a step on average, 3-4 bits on rare tokens
UNIFORM = np.full(4, 0.25)
ALPHA = 1e-3 / 8


def deep_tokens(method: str, q: np.ndarray, groups: int = 400, n: int = 2) -> tuple[np.ndarray, list[MemberState]]:
    logits = torch.tensor(np.log(q), dtype=torch.float32)
    states = [MemberState(spec=GroupSpec(method, n, seed=g), member=i) for g in range(groups) for i in range(n)]
    rows = len(states)
    out = np.empty((rows, STEPS), dtype=np.int64)
    for t in range(STEPS):
        draw = sample_members(logits.expand(rows, -1), states, torch.ones(rows))
        out[:, t] = draw.tokens.numpy()
    return out, states


@pytest.mark.parametrize("q", [SKEWED, UNIFORM], ids=["skewed", "uniform"])
@pytest.mark.parametrize("method", ["stratified", "lattice"])
def test_deep_steps_follow_the_model(method, q):
    tokens, states = deep_tokens(method, q)
    assert all(s.fresh for s in states)
    counts = np.bincount(tokens[:, 100:].ravel(), minlength=len(q))
    assert stats.chisquare(counts, q * counts.sum()).pvalue > ALPHA


def test_without_the_floor_a_deep_carry_degenerates(monkeypatch):
    # Stratified has no alone width, so only the precision floor stands between the
    # carry and float64 underflow of the code's information.
    monkeypatch.setattr(group_module, "PRECISION_FLOOR", 0.0)
    tokens, _ = deep_tokens("stratified", UNIFORM)
    counts = np.bincount(tokens[:, 100:].ravel(), minlength=4)
    assert stats.chisquare(counts, UNIFORM * counts.sum()).pvalue < ALPHA
    assert (tokens[:, 100:] == 0).all()  # the code has run out of bits: always the first token


def near_floor_tokens(method: str, q: np.ndarray, floor: float, groups: int = 1500) -> np.ndarray:
    """Tokens drawn while carrying with a prefix width W ∈ [floor, 16·floor), pooled."""
    logits = torch.tensor(np.log(q), dtype=torch.float32)
    states = [MemberState(spec=GroupSpec(method, 2, seed=g), member=i) for g in range(groups) for i in range(2)]
    rows = len(states)
    picked = []
    for _ in range(160):
        near = np.array([not s.fresh and floor <= s.width < 16 * floor for s in states])
        draw = sample_members(logits.expand(rows, -1), states, torch.ones(rows))
        picked.append(draw.tokens.numpy()[near])
    return np.concatenate(picked)


@pytest.mark.parametrize("q", [SKEWED, UNIFORM], ids=["skewed", "uniform"])
def test_the_carry_is_exact_just_above_the_floor(q):
    tokens = near_floor_tokens("stratified", q, group_module.PRECISION_FLOOR)
    assert len(tokens) > 2000
    counts = np.bincount(tokens, minlength=len(q))
    assert stats.chisquare(counts, q * counts.sum()).pvalue > ALPHA


def test_a_floor_too_low_for_float64_is_caught_by_the_near_floor_check(monkeypatch):
    floor = 2.0**-52
    monkeypatch.setattr(group_module, "PRECISION_FLOOR", floor)
    tokens = near_floor_tokens("stratified", UNIFORM, floor)
    counts = np.bincount(tokens, minlength=4)
    assert stats.chisquare(counts, UNIFORM * counts.sum()).pvalue < ALPHA


ONE_MINUS = math.nextafter(1.0, 0.0)
#: (u, F(y⁻), q(y), W, alone width): an inner code, a quotient rounded onto 1.0 or below 0
#: (clamped into [0, 1)), a tiny q, and W·q landing exactly on the alone width and just below it.
CARRY_EDGES = [
    (0.3, 0.25, 0.1, 1.0, 2.0**-32),
    (0.75, 0.5, 0.25, 1.0, 2.0**-32),
    (0.5, math.nextafter(0.5, 1.0), 0.5, 1.0, 2.0**-32),
    (0.5 + 2.0**-45, 0.5, 2.0**-40, 2.0**-10, 2.0**-32),
    (0.7, 0.5, 0.5, 0.25, 0.125),
    (0.7, 0.5, 0.5, 0.25, math.nextafter(0.125, 1.0)),
]


def test_the_shared_carry_is_the_formula_row_by_row_at_its_edges():
    # carry_codes serves the host and the device paths: here against the carry written out in
    # plain floats (qmc-math.md §2): u ← clamp((u − F(y⁻)) / q(y)) into [0, 1), W ← W·q(y), alone once W < alone.
    def written_out(u, start, prob, width, alone):
        width = width * prob
        return min(max((u - start) / prob, 0.0), ONE_MINUS), width, width < alone

    columns = [torch.tensor(column, dtype=torch.float64) for column in zip(*CARRY_EDGES, strict=True)]
    code, width, alone_now = group_module.carry_codes(*columns)
    for j, edge in enumerate(CARRY_EDGES):
        assert (code[j].item(), width[j].item(), bool(alone_now[j])) == written_out(*edge), edge
    assert [bool(a) for a in alone_now] == [False, False, False, True, False, True]
    assert code[1].item() == ONE_MINUS and code[2].item() == 0.0
    for method in ("lattice", "sobol", "stratified"):  # the alone width is never below the precision floor
        spec = GroupSpec(method, 4, 0)
        design = float(group_module.get_design(method).alone_widths(np.array([4]))[0])
        assert group_module.alone_width(spec) == max(design, group_module.PRECISION_FLOOR)
