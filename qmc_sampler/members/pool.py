"""The device pool: the numbers of the members in the batch, one row each, on the logits' device.

A step never waits for the device: the registry writes a row at admission, the draw and the carry
update rows in place with tensor ops, and a row is read back (one transfer) only when its member
leaves the batch or its counts are asked for (docs/internals.md, "A step that does not wait for
the device").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["DevicePool"]


class DevicePool:
    """The numbers of the members in the batch, one row each, on the logits' device.

    Columns: ``code``, ``width``, the pending draw (``u``, ``start``, ``prob``,
    ``token``, ``drawn_by_us``: drawn by the kernel rather than left to the engine), ``fresh``,
    ``history`` (:func:`~qmc_sampler.members.history.token_history` of the committed tokens),
    ``accepted_token`` (the token the engine accepted for the row, where the host does not know
    it: our pending token, or what the engine reports on the device), per member constants
    (``carries``: a code design; ``alone``: the width below which it goes fresh), and event
    counts the host reads at parking (``overridden``: the engine accepted another token than
    ours; ``engine_sampled``: the engine sampled the row).
    It lives on the CPU until the first draw names the device.
    """

    FLOATS = ("code", "width", "u", "start", "prob", "alone")
    INTS = ("token", "accepted_token", "history", "overridden", "engine_sampled")
    BOOLS = ("fresh", "drawn_by_us", "carries")

    def __init__(self, capacity: int = 64) -> None:
        self.device = torch.device("cpu")
        self.columns: dict[str, torch.Tensor] = {}
        self._allocate(capacity)
        self.free = list(range(capacity - 1, -1, -1))

    def to(self, device: torch.device) -> None:
        """Move the pool to ``device`` (once: the first draw's)."""
        if device != self.device:
            self.device = device
            self.columns = {k: c.to(device) for k, c in self.columns.items()}

    def take(self) -> int:
        """A free row (the pool doubles when full: host work, at admission)."""
        if not self.free:
            size = len(self.columns["code"])
            self._allocate(2 * size)
            self.free = list(range(2 * size - 1, size - 1, -1))
        return self.free.pop()

    def put(self, slot: int, **values: float | int | bool) -> None:
        """Write one row's columns (admission: host to device)."""
        for k, v in values.items():
            self.columns[k][slot] = v

    def get(self, slot: int) -> dict[str, Any]:
        """Read one row back (parking and stats) in one device-to-host transfer.

        Model Runner V2 parks every member its step leaves out, so this runs per park:
        one scalar read per column would be one device sync each.

        Args:
            slot: the row.

        Returns:
            Column name → value: ``float`` for :attr:`FLOATS`, ``int`` for :attr:`INTS`,
            ``bool`` for :attr:`BOOLS` (bit-exact: floats travel as their int64 bits).
        """
        c = self.columns
        # One-element slices are views (no kernel); float64 and int64 share a width, so the
        # floats travel as their bits, and the ints (hashes up to 2^62) exactly.
        parts = [c[k][slot : slot + 1].view(torch.int64) for k in self.FLOATS]
        parts += [c[k][slot : slot + 1] for k in self.INTS]
        parts.append(torch.cat([c[k][slot : slot + 1] for k in self.BOOLS]).long())
        row = torch.cat(parts).cpu().numpy()
        floats, ints = len(self.FLOATS), len(self.FLOATS) + len(self.INTS)
        values = row[:floats].view(np.float64).tolist() + row[floats:ints].tolist()
        values += [bool(b) for b in row[ints:]]
        return dict(zip(self.FLOATS + self.INTS + self.BOOLS, values, strict=True))

    def __getattr__(self, name: str) -> torch.Tensor:
        columns = self.__dict__.get("columns", {})
        if name in columns:
            return columns[name]
        raise AttributeError(name)

    def _allocate(self, capacity: int) -> None:
        old = self.columns
        dtypes = {**dict.fromkeys(self.FLOATS, torch.float64), **dict.fromkeys(self.INTS, torch.int64),
                  **dict.fromkeys(self.BOOLS, torch.bool)}  # fmt: skip
        self.columns = {k: torch.zeros(capacity, dtype=t, device=self.device) for k, t in dtypes.items()}
        for k, column in old.items():
            self.columns[k][: len(column)] = column
