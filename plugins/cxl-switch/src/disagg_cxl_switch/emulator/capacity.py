"""Dynamic capacity bookkeeping: finding free DPA ranges in a DC region, checking and applying extent lists.

Kept apart from the command handlers because it is pure interval arithmetic over `DynamicCapacityDevice`, and
the rules (block alignment, no overlap, a release must lie inside what the host holds) are where bugs hide.
A rule broken raises `CommandError` with the return code the handler answers.
"""

from __future__ import annotations

import itertools

from disagg_cxl_switch.emulator.errors import CommandError
from disagg_cxl_switch.emulator.state import DCRegion, DynamicCapacityDevice, HostExtent
from disagg_cxl_switch.fmapi import Extent
from disagg_cxl_switch.returncodes import ReturnCode


def free_ranges(dcd: DynamicCapacityDevice, region: DCRegion) -> list[tuple[int, int]]:
    """The unallocated [start, end) DPA ranges of a region, lowest first (extents of every host count)."""
    taken = sorted((e.start_dpa, e.end) for e in dcd.all_extents() if e.start_dpa < region.end and e.end > region.base)
    ranges: list[tuple[int, int]] = []
    cursor = region.base
    for start, end in taken:
        if start > cursor:
            ranges.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < region.end:
        ranges.append((cursor, region.end))
    return ranges


def choose_extents(
    dcd: DynamicCapacityDevice, region: DCRegion, length: int, *, contiguous: bool
) -> list[tuple[int, int]]:
    """First fit: one range for the contiguous policy, the lowest free ranges for the free policy."""
    if length == 0 or length % region.block_size:
        raise CommandError(ReturnCode.INVALID_INPUT, "length must be a non-zero multiple of the block size")
    chosen: list[tuple[int, int]] = []
    wanted = length
    for start, end in free_ranges(dcd, region):
        size = end - start
        if contiguous:
            if size >= length:
                return [(start, length)]
            continue
        take = min(size, wanted)
        chosen.append((start, take))
        wanted -= take
        if wanted == 0:
            return chosen
    raise CommandError(ReturnCode.RESOURCES_EXHAUSTED, f"region has no {length} bytes free for this policy")


def check_prescribed(dcd: DynamicCapacityDevice, region: DCRegion, extents: tuple[Extent, ...]) -> None:
    """A prescribed add list: non-empty, block-aligned, inside the region, overlapping neither itself nor any
    extent already handed out."""
    if not extents:
        raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "the prescriptive policy needs an extent list")
    spans = sorted((e.start_dpa, e.start_dpa + e.length) for e in extents)
    for extent in extents:
        if extent.length == 0 or extent.start_dpa % region.block_size or extent.length % region.block_size:
            raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "extent not aligned to the region's block size")
        if extent.start_dpa < region.base or extent.start_dpa + extent.length > region.end:
            raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "extent outside the DC region")
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "extents of the list overlap")
    for start, end in spans:
        for held in dcd.all_extents():
            if start < held.end and held.start_dpa < end:
                raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "extent overlaps capacity already added")


def check_budget(dcd: DynamicCapacityDevice, tags: list[bytes]) -> None:
    """The DCD tracks at most `total_supported_extents` extents and `total_supported_tags` distinct tags; an add
    of one extent per entry of ``tags`` must fit both, its new tags counted together."""
    if len(dcd.all_extents()) + len(tags) > dcd.total_supported_extents:
        raise CommandError(ReturnCode.RESOURCES_EXHAUSTED, "no extent tracking left")
    in_use = dcd.tags_in_use()
    if len(in_use | set(tags)) > dcd.total_supported_tags:
        raise CommandError(ReturnCode.RESOURCES_EXHAUSTED, "no tag tracking left")


def release_prescribed(dcd: DynamicCapacityDevice, host: int, extents: tuple[Extent, ...]) -> list[HostExtent]:
    """What the host keeps after giving back the listed ranges; each must be block-aligned and lie inside one held
    extent (which is split around it), and the ranges must not overlap. A split that would take the DCD past its
    extent tracking is Resources Exhausted, as CXL r3.1 has a device answer a release it cannot track."""
    held = dcd.host_extents[host]
    spans = sorted((e.start_dpa, e.start_dpa + e.length) for e in extents)
    if not spans or any(start >= end for start, end in spans):
        raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "empty extent list or zero-length extent")
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "extents of the list overlap")
    kept = list(held)
    for start, end in spans:
        owner = next((e for e in kept if e.start_dpa <= start and end <= e.end), None)
        if owner is None:
            raise CommandError(ReturnCode.INVALID_EXTENT_LIST, f"{start:#x}..{end:#x} is not held by the host")
        block = dcd.regions[owner.region].block_size
        if start % block or end % block:
            raise CommandError(ReturnCode.INVALID_EXTENT_LIST, f"{start:#x}..{end:#x} not aligned to {block:#x}")
        index = kept.index(owner)
        pieces = [
            HostExtent(s, e - s, owner.tag, owner.region, owner.poisoned)
            for s, e in ((owner.start_dpa, start), (end, owner.end))
            if e > s
        ]
        kept[index : index + 1] = pieces
    added = len(kept) - len(held)
    if added > 0 and len(dcd.all_extents()) + added > dcd.total_supported_extents:
        raise CommandError(ReturnCode.RESOURCES_EXHAUSTED, "splitting the extent needs extent tracking left")
    return kept
