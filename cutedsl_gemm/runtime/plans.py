"""The one cache of prepared calls: per op, a call signature -> what a repeated call with that signature reuses (a
launch plan and the few facts its fast path needs), so that it is one lookup and a launch.

Each op builds its own signature (what chooses its plan: shapes, dtypes, device, scale shapes and strides, the
arguments) and its own value; the cache only keeps them, bounded as a whole: past ``LIMIT`` entries (many distinct
shapes, e.g. every batch size of a server) it starts over. What the compiled functions check before every launch
(TVM-FFI: dtypes, extents, strides, alignment, one device) is not part of a signature: a kept launch that refuses a
call sends the op the long way, whose validation names what was expected.
"""

from __future__ import annotations

from typing import Hashable

LIMIT = 16384


class PreparedCalls:
    """``get(op, sig)`` / ``keep(op, sig, value)``, one dict per op, one bound for all."""

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._by_op: dict = {}
        self._size = 0

    def get(self, op: str, sig: Hashable):
        """The value kept for ``sig`` of ``op``, or None. An unhashable ``sig`` raises TypeError (the caller then
        validates the long way and keeps nothing)."""
        table = self._by_op.get(op)
        return None if table is None else table.get(sig)

    def keep(self, op: str, sig: Hashable, value) -> None:
        if self._size >= self.limit:
            self.clear()
        table = self._by_op.setdefault(op, {})
        self._size += sig not in table
        table[sig] = value

    def clear(self) -> None:
        self._by_op.clear()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def count(self, op: str) -> int:
        """Entries kept for ``op``."""
        return len(self._by_op.get(op, ()))


#: The process's prepared calls (every op's).
PREPARED = PreparedCalls()
