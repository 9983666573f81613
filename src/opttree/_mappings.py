"""Which of the process's memory may be written, from the kernel's list of its mappings.

A tensor whose storage torch did not allocate (``torch.from_numpy`` of a read-only memory
map, as ``np.load(..., mmap_mode="r")`` gives; ``torch.frombuffer``) may lie in memory
mapped read-only, and zeroing it kills the process with SIGSEGV. torch keeps no record of
whether memory is writable; Linux lists each mapping and its permissions in
``/proc/self/maps``. Only storages torch cannot resize (memory it did not allocate) are
looked up, so the list is read only where there are such.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_MAPS = "/proc/self/maps"


class Mappings:
    """The process's writable memory as sorted, disjoint ``[start, end)`` ranges, adjacent
    ones merged, read at the first question and kept for the next; where the list cannot
    be read, no memory is known to be writable."""

    def __init__(self) -> None:
        self._read: tuple[list[int], list[int]] | None = None

    def _ranges(self) -> tuple[list[int], list[int]]:
        if self._read is None:
            self._read = self._parse()
        return self._read

    def _parse(self) -> tuple[list[int], list[int]]:
        starts: list[int] = []
        ends: list[int] = []
        try:
            with open(_MAPS, encoding="ascii") as maps:
                lines = maps.read().splitlines()
        except (OSError, UnicodeDecodeError):  # not Linux: nothing known to be writable
            return starts, ends
        for line in lines:
            fields = line.split(maxsplit=2)
            if len(fields) < 2 or "w" not in fields[1]:
                continue
            low, _, high = fields[0].partition("-")
            start, end = int(low, 16), int(high, 16)
            if ends and ends[-1] == start:
                ends[-1] = end
            else:
                starts.append(start)
                ends.append(end)
        return starts, ends

    def writable(self, start: int, end: int) -> bool:
        """Whether every byte of ``[start, end)`` lies in one writable range (an empty
        range does); False where the list could not be read."""
        if end <= start:
            return True
        starts, ends = self._ranges()
        index = bisect.bisect_right(starts, start) - 1
        return index >= 0 and ends[index] >= end

    def first_unwritable(self, starts: Sequence[int], ends: Sequence[int]) -> int | None:
        """The index of the first range that is not wholly writable, or None."""
        return next((i for i, (start, end) in enumerate(zip(starts, ends, strict=True)) if not self.writable(start, end)), None)
