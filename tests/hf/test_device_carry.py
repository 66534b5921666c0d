"""The forcer's carry lives on the scores' device: no decoding step after the first reads it back.

* A real ``generate`` of the tiny Llama with :class:`~qmc_sampler.hf.QMCGenerate`, every
  ``QMCForcer.__call__`` watched by the ``host_reads`` fixture (``tolist``, ``item``, ``cpu``,
  ``numpy``, truth values, …: each one a wait for the device on a GPU): the first step may
  read (placement), the others must not; the call's one read at its end fills ``stats`` and
  ``last_groups``.
* The device carry draws exactly what the core's host-side cursor draws
  (:class:`~qmc_sampler.group.MemberState`, :func:`~qmc_sampler.group.draw_members`,
  :func:`~qmc_sampler.group.carry_member`) for every design and order, rows left to
  transformers (NaN, all ``-inf``, ``+inf``) included: such a member continues with fresh
  uniforms, and the rows are counted when the call's record is read (once, lazily).
* A row left to transformers inside a real ``generate``: counted and warned once even though
  transformers then raises on it.
"""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from qmc_sampler.hf import QMCForcer, QMCGenerate  # noqa: E402

from qmc_sampler.group import MemberState, carry_member, draw_members  # noqa: E402

PROMPTS = torch.tensor([[356, 295, 354, 83], [335, 93, 368, 353]])  # "the quick brown", "sphinx of black" (tiny BPE)
G = 4
NEW = 6


def reads_per_call(host_reads, monkeypatch) -> list[list[str]]:
    """Watch ``QMCForcer.__call__``; the returned list gets each call's host reads, in call order."""
    host_reads.watch(QMCForcer, "__call__")
    watched = QMCForcer.__call__
    calls: list[list[str]] = []

    def split(*args):
        before = len(host_reads.reads)
        try:
            return watched(*args)
        finally:
            calls.append(host_reads.reads[before:])

    monkeypatch.setattr(QMCForcer, "__call__", split)
    return calls


def test_generate_reads_nothing_back_after_the_first_step(hf_model, host_reads, monkeypatch):
    calls = reads_per_call(host_reads, monkeypatch)
    generator = QMCGenerate("lattice", seed=21)
    with torch.no_grad():
        out = hf_model.generate(input_ids=PROMPTS, attention_mask=torch.ones_like(PROMPTS), do_sample=True,
                                num_return_sequences=G, max_new_tokens=NEW, min_new_tokens=NEW, temperature=1.5,
                                pad_token_id=0, custom_generate=generator)  # fmt: skip
    assert len(calls) == NEW and host_reads.steps == [2 * G] * NEW
    after_first = {t: reads for t, reads in enumerate(calls) if t and reads}
    assert not after_first, f"steps after the first read the device back: {after_first}"
    # What the steps kept on the device reached the host at the end of the call.
    assert [g.rows for g in generator.last_groups] == [tuple(range(G)), tuple(range(G, 2 * G))]
    first = out[:, PROMPTS.shape[1]].tolist()
    assert [t for g in generator.last_groups for t in g.first_tokens] == first
    assert generator.stats.unsampleable == 0 and generator.stats.members == 2 * G


def reference_forcer(groups, scores_per_step):
    """Today's host-side algorithm, with the core's cursor: each row's token per step (-1: left to HF)."""
    rows = sum(len(g.rows) for g in groups)
    states: list[MemberState | None] = [None] * rows
    for g in groups:
        for i, row in enumerate(g.rows):
            states[row] = MemberState(spec=g.spec, member=i)
    out = []
    for scores in scores_per_step:
        ok = torch.isfinite(scores.amax(-1)).tolist()
        tokens = [-1] * rows
        drawable = [r for r in range(rows) if ok[r]]
        if drawable:
            members = [states[r] for r in drawable]
            draw, uniforms = draw_members(scores[drawable], members, torch.ones(len(drawable)))
            for j, (r, m) in enumerate(zip(drawable, members, strict=True)):
                carry_member(m, float(uniforms[j]), float(draw.starts[j]), float(draw.probs[j]))
                tokens[r] = int(draw.tokens[j])
        for r in range(rows):
            if not ok[r]:  # HF chooses it: the member goes on with fresh uniforms
                states[r].step += 1
                states[r].fresh = True
        out.append(tokens)
    return out


#: (step, row, what): rows with no finite maximum, left to transformers.
BAD_ROWS = [(0, 4, "-inf"), (2, 1, "-inf"), (2, 6, "nan"), (3, 2, "+inf"), (5, 1, "nan"), (5, 7, "-inf")]


@pytest.mark.parametrize("order", ["id", "sorted"])
@pytest.mark.parametrize("method", ["lattice", "stratified", "arithmetic", "sobol", "antithetic", "iid"])
def test_the_device_carry_draws_what_the_cores_host_cursor_draws(method, order, host_reads, monkeypatch):
    # Two prompts of 4 copies (one group each), 10 steps of a toy model whose next scores depend on the
    # last token; some rows have no finite maximum at some steps (transformers would choose those tokens:
    # here, token 0).
    calls = reads_per_call(host_reads, monkeypatch)
    table = torch.randn(64, 300, generator=torch.Generator().manual_seed(5)) * 1.5
    forcer = QMCForcer(method, 77, order, prompt_keys=[b"a", b"b"], copies=4)
    ids = torch.tensor([[1, 2, 3]] * 8)
    seen, tokens = [], []
    for t in range(10):
        scores = table[ids[:, -1] % 64].clone()
        for step, row, what in BAD_ROWS:
            if step == t:
                scores[row, :: (1 if what == "-inf" else 7)] = float(what)
        seen.append(scores.clone())
        forced = forcer(ids, scores.clone())
        left = ~torch.isfinite(scores.amax(-1))
        assert torch.equal(forced[left].nan_to_num(), scores[left].nan_to_num())  # a left row: as it is
        assert bool((forced[~left] == 0).sum(-1).eq(1).all())  # one-hot rows
        tokens.append(torch.where(left, -1, forced.argmax(-1)).tolist())
        ids = torch.cat([ids, torch.where(left, 0, forced.argmax(-1))[:, None]], 1)
    assert not [reads for reads in calls[1:] if reads]
    assert forcer.stats.unsampleable == 0  # counted on the device until the call's record is read
    groups = forcer.groups  # one transfer: counts and first tokens
    assert forcer.stats.unsampleable == len(BAD_ROWS)
    assert [g.first_tokens for g in groups] == [tuple(tokens[0][r] for r in g.rows) for g in groups]
    assert tokens == reference_forcer(groups, seen)
    forcer.finish()  # read again: nothing new to add
    assert forcer.stats.unsampleable == len(BAD_ROWS)


class NaNRow(transformers.LogitsProcessor):
    """Makes one row's scores NaN at one step (before the forcer, as a faulty processor or model would)."""

    def __init__(self, step: int, row: int) -> None:
        self.step, self.row, self.calls = step, row, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            scores = scores.clone()
            scores[self.row] = float("nan")
        self.calls += 1
        return scores


def test_a_row_left_to_transformers_is_counted_and_warned_once_when_the_call_ends(hf_model, caplog):
    # transformers then samples the NaN row itself and raises, as it does without qmc-sampler; the row is
    # counted and warned about all the same (read once, as the call unwinds).
    generator = QMCGenerate("lattice", seed=22)
    with caplog.at_level(logging.WARNING, logger="qmc_sampler.hf"), pytest.raises(RuntimeError), torch.no_grad():
        hf_model.generate(input_ids=PROMPTS[:1], attention_mask=torch.ones_like(PROMPTS[:1]), do_sample=True,
                          num_return_sequences=G, max_new_tokens=NEW, min_new_tokens=NEW, temperature=1.5,
                          pad_token_id=0, custom_generate=generator,
                          logits_processor=transformers.LogitsProcessorList([NaNRow(step=2, row=1)]))  # fmt: skip
    assert generator.stats.unsampleable == 1
    warned = [r for r in caplog.records if "NaN scores or no finite score" in r.getMessage()]
    assert len(warned) == 1
