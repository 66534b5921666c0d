"""``QMCForcer``: the last logits processor of HF's chain, which draws each row's token by design.

transformers builds, for ``do_sample=True``, a chain of processors and warpers
(penalties, …, temperature, top-k, top-p, min-p, …) and then samples
``multinomial(softmax(scores))`` (``transformers/generation/utils.py``,
``GenerationMixin._sample``). Appended after all of them, the forcer sees exactly
the distribution HF would sample from. It

1. places each row in a group at the first step: the rows of prompts with equal
   keys form one group — :class:`~qmc_sampler.hf.QMCGenerate` keys prompts on all
   their model inputs (:func:`qmc_sampler.hf.rows.prompt_keys`: encoder inputs,
   ``inputs_embeds``, image features, …); a forcer used on its own, without keys,
   can only key rows on their decoder ``input_ids`` (see :class:`QMCForcer`). A
   merged group's member indices are spread over its prompts' copies
   (:func:`member_order`);
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
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from qmc_sampler.counter_rng import Purpose, counter_seed
from qmc_sampler.designs import get_design
from qmc_sampler.group import GroupSpec, MemberState, carry_member, draw_members

__all__ = ["ForcerStats", "GroupRecord", "QMCForcer", "member_order"]

logger = logging.getLogger("qmc_sampler.hf")

_STATS_LOCK = threading.Lock()


@dataclass
class ForcerStats:
    """What the forcers of one :class:`~qmc_sampler.hf.QMCGenerate` did (cumulative).

    Updated through :meth:`add`, which is atomic, so one object may be shared by
    concurrent ``generate`` calls in several threads.
    """

    calls: int = 0  # generate calls served
    groups: int = 0  # groups formed
    members: int = 0  # rows drawn by design
    unsampleable: int = 0  # row-steps left to HF (NaN or no finite score)
    copies_only_calls: int = 0  # calls with an input not split by row: prompts grouped by their own copies only

    def add(self, **counts: int) -> None:
        """Add ``counts`` to the named counters, atomically.

        Args:
            counts: counter name → increment, e.g. ``add(groups=2, members=16)``.

        Raises:
            ValueError: a name that is not a counter of this class.
        """
        names = {f.name for f in fields(self)}
        unknown = sorted(set(counts) - names)
        if unknown:
            raise ValueError(f"{unknown} are not ForcerStats counters; use some of {sorted(names)}")
        with _STATS_LOCK:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


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
        prompt_keys: one key per prompt, ``rows // copies`` of them
            (:attr:`qmc_sampler.hf.rows.PromptKeys.keys`); prompts with equal keys share a
            group. None keys each row on its decoder ``input_ids`` at the first step —
            all a logits processor sees, which cannot tell apart prompts that differ only
            in encoder inputs, ``inputs_embeds`` or images: use :class:`~qmc_sampler.hf.QMCGenerate`
            for those models.
        copies: rows per prompt (``num_return_sequences``): prompt p is rows
            ``p·copies … p·copies + copies − 1``. Used with ``prompt_keys``.

    Raises:
        ValueError: at the first step, ``len(prompt_keys) · copies`` is not the batch's row count.
    """

    method: str
    seed: int
    order: str = "id"
    stats: ForcerStats = field(default_factory=ForcerStats)
    prompt_keys: Sequence[bytes] | None = None
    copies: int = 1
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
        rows = int(input_ids.shape[0])
        if self.prompt_keys is None:
            keys: Sequence[bytes] = [ids.numpy().tobytes() for ids in input_ids.cpu()]
            copies = 1
        else:
            keys, copies = self.prompt_keys, self.copies
            if len(keys) * copies != rows:
                raise ValueError(
                    f"prompt_keys has {len(keys)} keys and copies={copies}, which make {len(keys) * copies} rows, "
                    f"but the batch has {rows}; pass one key per prompt and copies=num_return_sequences"
                )
        by_key: dict[bytes, list[int]] = {}
        for prompt, key in enumerate(keys):
            by_key.setdefault(key, []).append(prompt)
        members: list[MemberState | None] = [None] * rows
        for g, prompts in enumerate(by_key.values()):
            blocks = [range(p * copies, (p + 1) * copies) for p in prompts]
            order = member_order(self.method, blocks)
            seed = counter_seed(self.seed, Purpose.GROUP_SEED, g, 0)
            spec = GroupSpec(self.method, len(order), seed, self.order)
            self._placed.append((spec, tuple(order)))
            for i, row in enumerate(order):
                members[row] = MemberState(spec=spec, member=i)
        self.stats.add(groups=len(self._placed), members=rows)
        return members  # type: ignore[return-value]

    def _leave_to_hf(self, members: list[MemberState]) -> None:
        # HF chooses these tokens: the members' codes no longer describe their prefixes, so
        # they continue with fresh uniforms of their own (still exact).
        for m in members:
            m.step += 1
            m.fresh = True
        self.stats.add(unsampleable=len(members))
        if not self._warned:
            self._warned = True
            logger.warning(
                "qmc-sampler: %d row(s) have NaN scores or no finite score; transformers samples them itself "
                "(as without qmc-sampler) and those members continue with fresh uniforms. Rows left so far: %d",
                len(members),
                self.stats.unsampleable,
            )


def member_order(method: str, blocks: Sequence[Sequence[int]]) -> list[int]:
    """The rows of one group in member order, spreading each block's members over the design.

    A group merges every copy of one prompt: ``blocks`` are its prompts' row blocks
    (the ``num_return_sequences`` copies of a prompt given k times — TRL's GRPO gives each
    prompt G times with one copy each). Member indices are assigned so that each block's
    members are a spread subset of the group's codes, not a narrow interval:

    * round-robin over the blocks (member b + k·j is row j of block b) when the design's
      start codes increase with the member index — ``lattice`` with n not a power of two
      (c_i = frac(i/n + Δ)) and ``arithmetic``. For ``lattice`` each block then holds
      frac(Δ + b/n + j/G), j < G: a shifted lattice of size G; for ``arithmetic``,
      G codes evenly spaced k/(n+1) apart;
    * contiguous blocks (row order) otherwise — ``lattice`` with n = 2^m, whose
      radical-inverse order makes every aligned block of G = n/k members a shifted
      lattice of size G (round-robin would put each block in one interval of width 1/k);
      ``sobol`` (aligned blocks of 2^j points of a scrambled Sobol' sequence are nets);
      ``antithetic`` (keeps the pairs 2j, 2j+1 in one block) and ``iid``. (``stratified``
      places members in strata by a keyed random permutation, so whichever of the two
      applies, each block gets random strata.)

    What is exact and balanced: the assignment is a bijection of the group's rows onto
    member indices 0..n−1 fixed by the inputs alone, before any draw, so each member is
    still an exact draw (its code or uniforms are U[0, 1) whatever its index) and the
    group's set of codes — hence its balance, each first token ⌊n·q⌋ or ⌈n·q⌉ times for
    ``lattice`` — is unchanged. With ``lattice`` each block is in addition balanced on
    its own (⌊G·q⌋ or ⌈G·q⌉ times), as if it were a group of G.

    Args:
        method: the design, one of ``qmc_sampler.METHODS``.
        blocks: the group's row blocks, each a sequence of batch row indices; round-robin
            needs blocks of equal size (otherwise row order is kept).

    Returns:
        The group's rows, member 0 first.

    Raises:
        ValueError: an unknown method.
    """
    design = get_design(method)
    flat = [row for block in blocks for row in block]
    sizes = {len(block) for block in blocks}
    if len(blocks) < 2 or len(sizes) != 1 or sizes == {1} or not design.carries:
        return flat
    n = len(flat)
    codes = design.start_codes(np.zeros(n, dtype=np.uint64), np.full(n, n, dtype=np.int64), np.arange(n))
    offsets = np.mod(codes - codes[0], 1.0)
    if not np.all(np.diff(offsets) > 0):
        return flat  # codes not in member order (radical inverse, random strata): contiguous blocks
    return [block[j] for j in range(len(blocks[0])) for block in blocks]
