"""Block-granular carving of a memory pool: the free ranges of a DCD's or MLD's capacity.

Capacity is counted in whole blocks, as the hardware carves it (a DC extent or an LD range is a whole number
of blocks), so byte arithmetic and rounding live in one place: the pool. Free space is a sorted list of
disjoint ``(start, length)`` block ranges, merged on release, so a long-lived pool never accumulates slivers.
"""

from __future__ import annotations

import bisect


class BlockAllocator:
    """First-fit allocation of block ranges out of ``blocks`` blocks. Not thread-safe: the pool locks."""

    def __init__(self, blocks: int) -> None:
        if blocks < 0:
            raise ValueError("a pool cannot have a negative number of blocks")
        self._blocks = blocks
        self._starts: list[int] = [0] if blocks else []
        self._lengths: list[int] = [blocks] if blocks else []
        self._free = blocks

    @property
    def total_blocks(self) -> int:
        return self._blocks

    @property
    def free_blocks(self) -> int:
        return self._free

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(start, length)`` ranges in address order."""
        return list(zip(self._starts, self._lengths, strict=True))

    def carve(self, blocks: int, *, contiguous: bool) -> list[tuple[int, int]] | None:
        """Take ``blocks`` blocks, first fit in address order; None (and nothing taken) when they don't fit.

        With ``contiguous`` the blocks come from one free range (an MLD's logical device is one range);
        without, they may span several ranges (a DCD adds capacity as a list of extents).
        """
        if blocks <= 0:
            raise ValueError("carve at least one block")
        if blocks > self._free:
            return None
        if contiguous:
            for start, length in zip(self._starts, self._lengths, strict=True):
                if length >= blocks:
                    self._take(start, blocks)
                    return [(start, blocks)]
            return None
        taken: list[tuple[int, int]] = []
        need = blocks
        for start, length in zip(self._starts, self._lengths, strict=True):
            part = min(length, need)
            taken.append((start, part))
            need -= part
            if need == 0:
                break
        for start, part in taken:
            self._take(start, part)
        return taken

    def claim(self, start: int, blocks: int) -> None:
        """Take exactly the range ``[start, start + blocks)``; raises ValueError unless it is wholly free.

        Used to restore carved state saved earlier.
        """
        if blocks <= 0 or start < 0 or start + blocks > self._blocks:
            raise ValueError(f"blocks [{start}, {start + blocks}) are outside the pool's {self._blocks} blocks")
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._starts[i] + self._lengths[i] < start + blocks:
            raise ValueError(f"blocks [{start}, {start + blocks}) are not free")
        self._take(start, blocks)

    def release(self, start: int, blocks: int) -> None:
        """Give a carved range back, merging it with free neighbours. Raises ValueError if any of it is free."""
        if blocks <= 0 or start < 0 or start + blocks > self._blocks:
            raise ValueError(f"blocks [{start}, {start + blocks}) are outside the pool's {self._blocks} blocks")
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start:
            raise ValueError(f"blocks [{start}, {start + blocks}) overlap free space")
        if i < len(self._starts) and self._starts[i] < start + blocks:
            raise ValueError(f"blocks [{start}, {start + blocks}) overlap free space")
        merge_left = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_right = i < len(self._starts) and self._starts[i] == start + blocks
        if merge_left and merge_right:
            self._lengths[i - 1] += blocks + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_left:
            self._lengths[i - 1] += blocks
        elif merge_right:
            self._starts[i] = start
            self._lengths[i] += blocks
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, blocks)
        self._free += blocks

    def _take(self, start: int, blocks: int) -> None:
        """Remove ``[start, start + blocks)`` from the free range that wholly contains it."""
        i = bisect.bisect_right(self._starts, start) - 1
        range_start, range_len = self._starts[i], self._lengths[i]
        before = start - range_start
        after = range_start + range_len - (start + blocks)
        if before and after:
            self._lengths[i] = before
            self._starts.insert(i + 1, start + blocks)
            self._lengths.insert(i + 1, after)
        elif before:
            self._lengths[i] = before
        elif after:
            self._starts[i] = start + blocks
            self._lengths[i] = after
        else:
            del self._starts[i], self._lengths[i]
        self._free -= blocks
