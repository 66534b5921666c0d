"""``QMCForcer``: the last logits processor of HF's chain, which draws each row's token by design.

transformers builds, for ``do_sample=True``, a chain of processors and warpers
(penalties, …, temperature, top-k, top-p, min-p, …) and then samples
``multinomial(softmax(scores))`` (``transformers/generation/utils.py``,
``GenerationMixin._sample``). Appended after all of them, the forcer sees exactly
the distribution HF would sample from. It

1. places each row in a group at the first step: rows whose prompt tokens are
   identical (``num_return_sequences`` copies, or a batch of repeated prompts as
   TRL's GRPO sends) form one group, members numbered in row order;
2. draws each row's token by inverse CDF of ``softmax(scores)`` with the member's
   uniform (:func:`qmc_sampler.group.draw_members`), carries the residual
   (:func:`qmc_sampler.group.carry_member`) — HF never discards a draw; and
3. returns a row with 0 at that token and ``-inf`` elsewhere: ``softmax`` makes it
   one-hot and ``multinomial`` returns that token. Each member is therefore an exact
   draw from HF's own processed distribution (``../shared/design/qmc-math.md`` §1, §3).

A row with NaN scores or no finite score is left as it is (HF then does what it
does without the forcer), counted in :attr:`ForcerStats.unsampleable` and warned
once. Returned ``scores`` (``output_scores=True``) are the one-hot rows;
``output_logits=True`` gives the model's raw logits, unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from qmc_sampler.counter_rng import Purpose, counter_seed
from qmc_sampler.group import GroupSpec, MemberState, carry_member, draw_members

__all__ = ["ForcerStats", "GroupRecord", "QMCForcer"]

logger = logging.getLogger("qmc_sampler.hf")


@dataclass
class ForcerStats:
    """What the forcers of one :class:`~qmc_sampler.hf.QMCGenerate` did (cumulative)."""

    calls: int = 0  # generate calls served
    groups: int = 0  # groups formed
    members: int = 0  # rows drawn by design
    unsampleable: int = 0  # row-steps left to HF (NaN or no finite score)


@dataclass(frozen=True)
class GroupRecord:
    """One group of a generate call: its spec, the batch rows of its members (member order) and
    each member's first token (-1 where transformers chose it)."""

    spec: GroupSpec
    rows: tuple[int, ...]
    first_tokens: tuple[int, ...] = ()


@dataclass
class QMCForcer:
    """Draw each row's token from its group's design (see the module docstring).

    Args:
        method: the design (``qmc_sampler.METHODS``); order: ``"id"`` or ``"sorted"``.
        seed: 64-bit base seed of this generate call's groups (already mixed with the
            call counter and the process rank by :class:`~qmc_sampler.hf.QMCGenerate`).
        stats: counters shared with the caller.
    """

    method: str
    seed: int
    order: str = "id"
    stats: ForcerStats = field(default_factory=ForcerStats)
    _members: list[MemberState] | None = None
    _placed: list[tuple[GroupSpec, tuple[int, ...]]] = field(default_factory=list)
    _first: dict[int, int] = field(default_factory=dict)
    _warned: bool = False

    @property
    def groups(self) -> list[GroupRecord]:
        """The groups formed at the first step, with their members' first tokens."""
        return [GroupRecord(spec, rows, tuple(self._first.get(r, -1) for r in rows)) for spec, rows in self._placed]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Impose each row's drawn token.

        Args:
            input_ids: ``[rows, length] int64``, the prompt (left-padded) and the tokens so far.
            scores: ``[rows, vocab] float32``, HF's processed scores for the next token.

        Returns:
            ``scores`` with every entry but the drawn token of each drawable row set to ``-inf``.
        """
        first_step = self._members is None
        if first_step:
            self._members = self._place(input_ids)
        drawable = torch.isfinite(scores.amax(dim=-1))
        rows = torch.nonzero(drawable).squeeze(1).tolist()
        if len(rows) < scores.shape[0]:
            self._leave_to_hf([m for m, ok in zip(self._members, drawable.tolist(), strict=True) if not ok])
        if not rows:
            return scores
        members = [self._members[r] for r in rows]
        index = torch.tensor(rows, device=scores.device)
        ones = torch.ones(len(rows))
        draw, uniforms = draw_members(scores.index_select(0, index), members, temperature=ones)
        starts, probs = draw.starts.tolist(), draw.probs.tolist()
        for j, m in enumerate(members):
            carry_member(m, float(uniforms[j]), starts[j], probs[j])
        if first_step:
            self._first = dict(zip(rows, draw.tokens.tolist(), strict=True))
        forced = torch.full_like(scores, float("-inf"))
        forced[index, draw.tokens.to(scores.device)] = 0.0
        keep = ~drawable
        forced[keep] = scores[keep]
        return forced

    def _place(self, input_ids: torch.LongTensor) -> list[MemberState]:
        by_prompt: dict[bytes, list[int]] = {}
        for row, ids in enumerate(input_ids.cpu()):
            by_prompt.setdefault(ids.numpy().tobytes(), []).append(row)
        members: list[MemberState | None] = [None] * input_ids.shape[0]
        for g, rows in enumerate(by_prompt.values()):
            seed = counter_seed(self.seed, Purpose.GROUP_SEED, g, 0)
            spec = GroupSpec(self.method, len(rows), seed, self.order)
            self._placed.append((spec, tuple(rows)))
            for i, row in enumerate(rows):
                members[row] = MemberState(spec=spec, member=i)
        self.stats.groups += len(self._placed)
        self.stats.members += len(members)
        return members  # type: ignore[return-value]

    def _leave_to_hf(self, members: list[MemberState]) -> None:
        # HF chooses these tokens: the members' codes no longer describe their prefixes, so
        # they continue with fresh uniforms of their own (still exact).
        for m in members:
            m.step += 1
            m.fresh = True
        self.stats.unsampleable += len(members)
        if not self._warned:
            self._warned = True
            logger.warning(
                "qmc-sampler: %d row(s) have NaN scores or no finite score; transformers samples them itself "
                "(as without qmc-sampler) and those members continue with fresh uniforms. Rows left so far: %d",
                len(members),
                self.stats.unsampleable,
            )
