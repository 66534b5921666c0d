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
   uniform and carries the residual — HF never discards a draw; and
3. returns a row with 0 at that token and ``-inf`` elsewhere: ``softmax`` makes it
   one-hot and ``multinomial`` returns that token. Each member is therefore an exact
   draw from HF's own processed distribution (``../shared/design/qmc-math.md`` §1, §3).

No host reads after the first step. The members' carried state (code, prefix width,
fresh flag, the step's draw) lives on the scores' device, in a
:class:`~qmc_sampler.members.registry.MemberRegistry` (the machinery the vLLM plugin uses
too): each row is admitted at the first step as a member of an *explicit* group (the
forcer names the group, its size, seed and the member index), and every step is that
registry's draw cycle — the host
supplies only the counter-based uniforms (they depend on seed, member and step), the
device draws, forces and carries. The first step may read the prompts (placement is a
host decision: a forcer without ``prompt_keys`` hashes the decoder ids) and moves the
registry's rows to the device; a step after it reads nothing back.

A row without a finite maximum (NaN scores, a ``+inf``, or every score ``-inf``) is
left as it is (HF then does what it does without the forcer) and its member continues
with fresh uniforms, whatever its design (a carried code no longer describes its prefix).
Such rows are counted on the device; the counts reach :attr:`ForcerStats.unsampleable`
— warned once — and each member's first token reaches :attr:`GroupRecord.first_tokens`
in one transfer, when the call is done (:meth:`QMCForcer.finish`, which
:class:`~qmc_sampler.hf.QMCGenerate` calls once at the end of ``generate``). Returned
``scores`` (``output_scores=True``) are the one-hot rows; ``output_logits=True`` gives the
model's raw logits, unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from qmc_sampler.counter_rng import Purpose, counter_seed
from qmc_sampler.designs import get_design
from qmc_sampler.group import GroupSpec
from qmc_sampler.kernels import upload
from qmc_sampler.members import EXPLICIT, DevicePool, GroupArgs, Member, MemberRegistry, RowSampling

__all__ = ["ForcerStats", "GroupRecord", "QMCForcer", "member_order"]

logger = logging.getLogger("qmc_sampler.hf")

_STATS_LOCK = threading.Lock()

#: HF's scores are already processed (temperature, top-k, …): the draw takes ``softmax(scores)`` as it is.
_AS_GIVEN = RowSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@dataclass
class ForcerStats:
    """What the forcers of one :class:`~qmc_sampler.hf.QMCGenerate` did (cumulative).

    Updated through :meth:`add`, which is atomic, so one object may be shared by
    concurrent ``generate`` calls in several threads. ``unsampleable`` is counted on
    the device and added when a call ends (:meth:`QMCForcer.finish`).
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
class _DeviceCarry:
    """One generate call's members and what the device keeps of them (made at the first step).

    Attributes:
        registry: the members' :class:`~qmc_sampler.members.registry.MemberRegistry`; its
            pool (code, width, fresh flag, the step's draw) lives on the scores' device.
        members: batch row → its member.
        slots: ``[rows] int64`` on the device, each row's pool row.
        ones: ``[rows] float32`` on the device, the draw's temperature (HF's scores are processed).
        left: ``[rows] int64`` on the device, each row's steps left to transformers.
        first_tokens: ``[rows] int64`` on the device, the first step's tokens (-1: left to
            transformers); None before the first step and once read back.
    """

    registry: MemberRegistry
    members: list[Member]
    slots: torch.Tensor
    ones: torch.Tensor
    left: torch.Tensor
    first_tokens: torch.Tensor | None = None


@dataclass
class QMCForcer:
    """Draw each row's token from its group's design (see the module docstring).

    Every step after the first runs on the scores' device without reading anything back;
    what the host needs of the device's record — rows left to transformers, each member's
    first token — comes back in one transfer in :meth:`finish` (also run by :attr:`groups`).

    Args:
        method: the design (``qmc_sampler.METHODS``); order: ``"id"`` or ``"sorted"``.
        seed: 64-bit base seed of this generate call's groups (already mixed with the
            call counter and the process rank by :class:`~qmc_sampler.hf.QMCGenerate`).
        stats: counters shared with the caller (``unsampleable`` is added by :meth:`finish`).
        prompt_keys: one key per prompt, ``rows // copies`` of them
            (:attr:`qmc_sampler.hf.rows.PromptKeys.keys`); prompts with equal keys share a
            group. None keys each row on its decoder ``input_ids`` at the first step —
            all a logits processor sees, which cannot tell apart prompts that differ only
            in encoder inputs, ``inputs_embeds`` or images: use :class:`~qmc_sampler.hf.QMCGenerate`
            for those models. (This reads the ids back once, at the first step.)
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
    _carry: _DeviceCarry | None = field(default=None, repr=False)  # set at the first step
    _placed: list[tuple[GroupSpec, tuple[int, ...]]] = field(default_factory=list)
    _first: dict[int, int] = field(default_factory=dict)
    _left_folded: int = 0
    _warned: bool = False

    @property
    def groups(self) -> list[GroupRecord]:
        """The groups formed at the first step, with their members' first tokens (runs :meth:`finish`)."""
        self.finish()
        return [GroupRecord(spec, rows, tuple(self._first.get(r, -1) for r in rows)) for spec, rows in self._placed]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Impose each row's drawn token.

        Reads nothing back from the device after the first step (the first places the rows).

        Args:
            input_ids: ``[rows, length] int64``, the prompt (left-padded) and the tokens so far.
            scores: ``[rows, vocab] float``, HF's processed scores for the next token.

        Returns:
            ``scores`` with every entry but the drawn token of each drawable row set to ``-inf``
            (a row without a finite maximum is returned as it is).

        Raises:
            ValueError: at the first step, ``len(prompt_keys) · copies`` is not the batch's row count.
        """
        first_step = self._carry is None
        carry = self._place(input_ids, scores.device) if self._carry is None else self._carry
        registry, slots = carry.registry, carry.slots
        # A row without a finite maximum (NaN, all -inf, +inf) is HF's: NaN makes the kernel leave it (token -1).
        drawable = torch.isfinite(scores.amax(dim=-1))
        draw = registry.draw(torch.where(drawable.unsqueeze(1), scores, float("nan")), carry.members, carry.ones,
                             None, None, None, slots)  # fmt: skip
        drawn = draw.tokens >= 0
        # HF chooses a left row's token: whatever the design, its member continues with fresh uniforms
        # of its own (still exact). The registry's commit already makes a code design fresh there.
        pool = registry.pool
        pool.fresh[slots] = pool.fresh[slots] | ~drawn
        for m in carry.members:
            registry.sync(m, m.state.step + 1, None)  # HF takes the forced token: the device knows it
        carry.left += (~drawn).long()
        if first_step:
            carry.first_tokens = draw.tokens
        forced = torch.full_like(scores, float("-inf")).scatter_(1, draw.tokens.clamp(min=0).unsqueeze(1), 0.0)
        return torch.where(drawn.unsqueeze(1), forced, scores)

    def finish(self) -> None:
        """Bring the device's record of the call to the host, in one transfer (a sync on a GPU).

        Adds the rows left to transformers since the last ``finish`` to
        :attr:`ForcerStats.unsampleable` (warning once per forcer if there were any) and
        records each member's first token for :attr:`groups`. Run it after the last step;
        :class:`~qmc_sampler.hf.QMCGenerate` does, once per ``generate`` call. Does nothing
        before the first step.
        """
        carry = self._carry
        if carry is None:
            return
        first = carry.first_tokens
        host = (carry.left if first is None else torch.cat([carry.left, first])).tolist()  # the one transfer
        rows = len(carry.members)
        if first is not None:
            self._first = dict(enumerate(host[rows:]))  # -1: left to transformers
            carry.first_tokens = None
        left = host[:rows]
        total = sum(left)
        new, self._left_folded = total - self._left_folded, total
        if not new:
            return
        self.stats.add(unsampleable=new)
        if not self._warned:
            self._warned = True
            logger.warning(
                "qmc-sampler: %d row-step(s) of %d row(s) had NaN scores or no finite score; transformers sampled "
                "them itself (as without qmc-sampler) and those members continued with fresh uniforms. Rows left "
                "so far: %d",
                total,
                sum(1 for n in left if n),
                self.stats.unsampleable,
            )

    def _place(self, input_ids: torch.LongTensor, device: torch.device) -> _DeviceCarry:
        """Admit every row as a member of an explicit group and move the registry's rows to ``device``.

        Args:
            input_ids: ``[rows, length]``, read back only without ``prompt_keys`` (to key the rows).
            device: the scores' device.

        Returns:
            The call's :class:`_DeviceCarry` (also kept in ``self._carry``).

        Raises:
            ValueError: ``len(prompt_keys) · copies`` is not the batch's row count.
        """
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
        # The rows' numbers are written on the host (the pool starts on the CPU), then moved once.
        registry = MemberRegistry(pool=DevicePool(max(rows, 1)))
        members: list[Member | None] = [None] * rows
        for g, prompts in enumerate(by_key.values()):
            blocks = [range(p * copies, (p + 1) * copies) for p in prompts]
            order = member_order(self.method, blocks)
            seed = counter_seed(self.seed, Purpose.HF_GROUP_SEED, g, 0)
            # An explicit group: this forcer names its size, seed and every member index.
            request = GroupArgs(EXPLICIT, self.method, self.order, seed, len(order), group=f"hf:{g}")
            for i, row in enumerate(order):
                members[row] = registry.admit(dataclasses.replace(request, index=i), _AS_GIVEN, (), ())
            self._placed.append((members[order[0]].state.spec, tuple(order)))  # type: ignore[union-attr]
        registry.pool.to(device)
        placed: list[Member] = members  # type: ignore[assignment]  # every row got its member
        self._carry = _DeviceCarry(
            registry=registry,
            members=placed,
            slots=upload(np.array([m.slot for m in placed], dtype=np.int64), device),
            ones=torch.ones(rows, device=device),
            left=torch.zeros(rows, dtype=torch.int64, device=device),
        )
        self.stats.add(groups=len(self._placed), members=rows)
        return self._carry


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
