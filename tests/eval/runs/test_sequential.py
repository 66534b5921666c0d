"""Sample until verified (:mod:`qmc_sampler.eval.runs.sequential`) on models whose distribution is exact.

What is exact, measured: the returned correct samples against p(· | correct), over many
prompts of a tabular model (tests/conftest.py's toy: vocabulary 4, three steps, 64
sequences) and of a one-step model built so that a lattice's first correct member is
biased (the issue's case: correct codes [0, 0.05) ∪ [0.5, 0.95), two lattice members).

The statistic is a Wald χ² on per-prompt counts (cluster-robust: a prompt may return
several correlated samples): for each cell c of the correct set, D_ic = X_ic − n_i·q_c
with X_ic prompt i's returned copies of c, n_i its returned samples and q = p(· | correct);
unbiasedness means E[D_i] = 0, and P·D̄ᵀ S⁺ D̄ is χ² with rank(S) degrees of freedom
(the rarest cells pooled until expected 20 times). i.i.d. is the control that must pass.

Significance: family-wise α = 1e-3, Bonferroni over every χ² test in this file (those that
must pass and those that must reject).
"""

import itertools
import json

import numpy as np
import pytest
import torch
from qmc_sampler.eval.backends.generation import Completion
from qmc_sampler.eval.runs.sequential import (
    HostBackend,
    check_until,
    design_size,
    round_seed,
    sample_until,
    sequential_designs,
)
from scipy import stats

from qmc_sampler import GroupSpec, sample_group

DESIGNS = sequential_designs()  # iid, lattice, sobol, antithetic
PROMPTS = 1500
MUST_PASS = 3 * len(DESIGNS) + 2  # unbiased mode × (toy, constructed × 2 round sizes), first mode i.i.d. × 2
MUST_REJECT = 2  # the lattice's first correct member and all its members' correct ones, constructed case
ALPHA = 1e-3 / (MUST_PASS + MUST_REJECT)
STEP1_PROBS = np.array([0.05, 0.45, 0.45, 0.05])  # codes [0,.05) [.05,.5) [.5,.95) [.95,1) in id order


def toy_case(toy_model):
    """The toy (three steps) and its correct set: token sum ≡ 0 (mod 3) — about a third of the mass."""
    joint = {}
    for seq in itertools.product(range(toy_model.vocab), repeat=3):
        p = 1.0
        for t in range(3):
            p *= torch.softmax(toy_model.table[seq[:t]].double(), 0)[seq[t]].item()
        joint[seq] = p

    def logits(prompts, prefixes):
        return toy_model.batched_logits([tuple(p) for p in prefixes])

    return logits, joint, (lambda seq: sum(seq) % 3 == 0), 3


def constructed_case():
    """One step, probabilities .05/.45/.45/.05; tokens 0 and 2 are correct."""
    row = torch.log(torch.tensor(STEP1_PROBS))

    def logits(prompts, prefixes):
        return row.expand(len(prefixes), -1).clone()

    return logits, {(t,): float(STEP1_PROBS[t]) for t in range(4)}, (lambda seq: seq[0] in (0, 2)), 1


def run(case, design, mode, cap, round_size, seed=0, prompts=PROMPTS):
    logits, _, correct, steps = case
    return sample_until(
        HostBackend(logits),
        [f"p{i}" for i in range(prompts)],
        lambda prompt, text: correct(tuple(json.loads(text))),
        want=1, cap=cap, round_size=round_size, design=design, seed=seed, mode=mode,
        sampling={"max_tokens": steps}, progress=False,
    )  # fmt: skip


MIN_EXPECTED = 20


def wald_pvalue(returned: list[list[tuple[int, ...]]], joint: dict, correct) -> tuple[float, float]:
    """(p-value, total variation) of the returned samples against p(· | correct) (module docstring)."""
    cells = [c for c in joint if correct(c)]
    q = np.array([joint[c] for c in cells])
    q /= q.sum()
    assert all(correct(s) for got in returned for s in got), "a returned sample is not correct"
    x = np.array([[sum(1 for s in got if s == c) for c in cells] for got in returned], dtype=float)
    n = x.sum(axis=1)
    # The rarest cells are pooled into one until it is expected at least MIN_EXPECTED times (a cell
    # seen a handful of times, or never, gives the per-prompt covariance nothing to estimate).
    order = np.argsort(q)
    pooled = np.searchsorted(np.cumsum(q[order]) * n.sum(), MIN_EXPECTED) + 1
    rare = np.zeros(len(q), dtype=bool)
    rare[order[: min(pooled, len(q))]] = True
    if rare.sum() > 1:
        x = np.column_stack([x[:, ~rare], x[:, rare].sum(axis=1)])
        q = np.append(q[~rare], q[rare].sum())
    d = (x - n[:, None] * q[None, :])[:, :-1]  # the last cell is the others' complement
    mean = d.mean(axis=0)
    cov = np.atleast_2d(np.cov(d, rowvar=False))
    rank = np.linalg.matrix_rank(cov)
    t2 = len(d) * mean @ np.linalg.pinv(cov) @ mean
    tv = 0.5 * np.abs(x.sum(axis=0) / n.sum() - q).sum()
    return float(stats.chi2.sf(t2, rank)), float(tv)


def returned_tokens(results, which="returned"):
    return [[tuple(m.token_ids) for m in (r.returned if which == "returned" else [x for x in r.members if x.correct])]
            for r in results]  # fmt: skip


@pytest.mark.parametrize(("case_name", "cap", "r"), [("toy", 4, 2), ("constructed", 2, 1), ("constructed", 4, 2)])
@pytest.mark.parametrize("design", DESIGNS)
def test_the_unbiased_mode_returns_draws_from_p_given_correct(toy_model, design, case_name, cap, r):
    """A round of one member is one uniform code, i.i.d. under every design: on the constructed case
    rounds of 1 catch one extensible group whose every correct member is kept (share of token 0
    0.055, not 0.1), but not a selection within a round. Rounds of 2 (issue 48) make each round a
    2-lattice, the design whose first correct member is biased there: keeping only the first correct
    member of each round fails them (0.058), passes rounds of 1. (One extensible group is 0.093 at
    rounds of 2: too close to 0.1 for 1500 prompts.)"""
    case = toy_case(toy_model) if case_name == "toy" else constructed_case()
    results = run(case, design, "unbiased", cap, r)
    p, tv = wald_pvalue(returned_tokens(results), case[1], case[2])
    assert p > ALPHA, f"{design}: unbiased mode's returned samples differ from p(.|correct): p={p:.2e}, TV={tv:.3f}"


@pytest.mark.parametrize("case_name", ["toy", "constructed"])
def test_iid_first_correct_is_the_control(toy_model, case_name):
    case = toy_case(toy_model) if case_name == "toy" else constructed_case()
    cap, r = (4, 2) if case_name == "toy" else (2, 1)
    p, tv = wald_pvalue(returned_tokens(run(case, "iid", "first", cap, r)), case[1], case[2])
    assert p > ALPHA, f"i.i.d. first correct differs from p(.|correct): p={p:.2e}, TV={tv:.3f}"


def test_a_lattice_first_correct_member_is_biased_on_the_constructed_case():
    """The issue's case: the first hit is token 0 with probability .05/.9, not .05/.5; so are all correct
    members of one extensible group — which is why the unbiased mode gives each round its own group."""
    case = constructed_case()
    results = run(case, "lattice", "first", 2, 1)
    p, _tv = wald_pvalue(returned_tokens(results), case[1], case[2])
    share = np.mean([r.returned[0].token_ids == (0,) for r in results if r.solved])
    assert p < ALPHA and abs(share - 0.05 / 0.9) < 0.02, (p, share)
    p_all, _ = wald_pvalue(returned_tokens(results, "all"), case[1], case[2])
    assert p_all < ALPHA, p_all


def test_rounds_are_consecutive_members_of_one_group_and_stop_at_want_or_cap(toy_model):
    logits, _, correct, steps = toy_case(toy_model)
    results = run(toy_case(toy_model), "lattice", "first", cap=8, round_size=3, prompts=40)
    for r in results:
        whole = sample_group(lambda p: logits(None, p), GroupSpec("lattice", design_size(8), _seed(r.index)), steps)
        assert [m.member for m in r.members] == list(range(r.spent))
        assert [list(m.token_ids) for m in r.members] == whole[: r.spent]
        hits = [correct(tuple(t)) for t in whole[:8]]
        first = hits.index(True) + 1 if any(hits) else None
        assert r.samples_to_want == first
        assert r.spent == (8 if first is None else min(8, -(-first // 3) * 3))  # whole rounds, the last one cut
        assert [m.round for m in r.members] == [i // 3 for i in range(r.spent)]
    assert any(r.spent == 8 and not r.solved for r in results) or all(r.solved for r in results)


def test_the_unbiased_mode_gives_each_round_its_own_group(toy_model):
    logits, _, _, _steps = toy_case(toy_model)
    results = run(toy_case(toy_model), "lattice", "unbiased", cap=6, round_size=2, prompts=30)
    for r in results:
        for j in range(r.spent // 2):
            group = sample_group(lambda p: logits(None, p), GroupSpec("lattice", 2, round_seed(_seed(r.index), j)), 3)
            assert [list(m.token_ids) for m in r.members[2 * j : 2 * j + 2]] == group
        assert r.returned == [m for m in r.members if m.correct]


def _seed(index: int) -> int:
    from qmc_sampler.eval.runs.sequential import prompt_seed

    return prompt_seed(0, index)


def test_an_interrupted_run_resumes_from_its_file(toy_model, tmp_path, interrupting):
    case = toy_case(toy_model)
    logits, _, correct, _ = case

    def verify(prompt, text):
        return correct(tuple(json.loads(text)))

    kwargs = dict(want=2, cap=8, round_size=2, sampling={"max_tokens": 3}, progress=False)
    prompts = [f"p{i}" for i in range(25)]
    whole = sample_until(HostBackend(logits), prompts, verify, **kwargs)
    out = tmp_path / "until.jsonl"
    with pytest.raises(KeyboardInterrupt):
        sample_until(interrupting(logits, 2), prompts, verify, out=out, **kwargs)
    written = out.read_text().splitlines()
    assert 0 < len(written) < sum(r.spent for r in whole)
    out.write_text("\n".join(written[:-1]) + "\n" + written[-1][:10])  # a torn last round
    resumed = sample_until(HostBackend(logits), prompts, verify, out=out, **kwargs)
    assert [(r.spent, r.samples_to_want) for r in resumed] == [(r.spent, r.samples_to_want) for r in whole]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == sum(r.spent for r in whole)  # every member once
    assert len({(x["problem"], x["round"], x["member"]) for x in lines}) == len(lines)
    with pytest.raises(ValueError, match="round_size"):
        sample_until(HostBackend(logits), prompts, verify, out=out, **(kwargs | {"round_size": 4}))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(want=0, cap=8, round_size=2, design="lattice"), "want"),
        (dict(want=9, cap=8, round_size=2, design="lattice"), "want"),
        (dict(want=1, cap=8, round_size=9, design="lattice"), "round_size"),
        (dict(want=1, cap=8, round_size=2, design="stratified"), "cannot grow"),
        (dict(want=1, cap=8, round_size=2, design="lattice", mode="best"), "mode"),
        (dict(want=1, cap=8, round_size=2, design="nope"), "design"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(settings, match):
    with pytest.raises(ValueError, match=match):
        check_until(**settings)


def test_a_backend_without_rounds_is_refused():
    class Whole:
        def run(self, jobs, on_group):
            on_group(jobs[0], [Completion("x", "stop")])

    with pytest.raises(ValueError, match="cannot serve rounds"):
        sample_until(Whole(), ["p"], lambda p, t: True, cap=4, round_size=2, progress=False)
