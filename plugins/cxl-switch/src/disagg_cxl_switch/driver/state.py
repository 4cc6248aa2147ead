"""What the driver keeps beside the switch: the highest fencing epoch, which allocation id each DC extent
tag stands for, and which allocation id each LD of an MLD was carved for. In ``state_dir`` when there is one
(written atomically), else in memory for the process.

A DC extent carries a 16-byte tag; the driver puts the first 16 bytes of the SHA-256 of the allocation id in it,
so the switch itself groups an allocation's extents and releases them by tag. A hash cannot be read back, so
the id it came from is kept here, recorded before the extents are added so that a crash in between still names
them. An LD carries no tag at all, so its allocation id is kept here too, recorded before its allocation is set.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from disagg.errors import ConfigError, StaleEpochError


def allocation_tag(allocation_id: str) -> bytes:
    return hashlib.sha256(allocation_id.encode()).digest()[:16]


class DriverState:
    def __init__(self, state_dir: Path | None) -> None:
        self._path = state_dir / "driver-state.json" if state_dir is not None else None
        self._lock = threading.Lock()
        self._epoch = 0
        self._tags: dict[str, str] = {}
        self._lds: dict[str, str] = {}
        if self._path is not None and self._path.exists():
            try:
                self._epoch, self._tags, self._lds = _parse(json.loads(self._path.read_text()))
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"the driver state {self._path} cannot be read ({exc}); restore it, or move it away to start "
                    "without it (the fencing epoch then restarts at 0, and the allocations it named are listed as "
                    "tag-<hex> or ld-<N>)",
                    field="state_dir",
                ) from None

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"epoch": self._epoch, "tags": self._tags, "lds": self._lds}, sort_keys=True))
        os.replace(tmp, self._path)

    def fence(self, epoch: int) -> None:
        """Remember ``epoch`` if it is the highest yet; refuse an older one before anything is touched."""
        with self._lock:
            if epoch < self._epoch:
                raise StaleEpochError(f"epoch {epoch} is older than {self._epoch}, already seen by this switch")
            if epoch > self._epoch:
                self._epoch = epoch
                self._save()

    def name_tag(self, allocation_id: str) -> bytes:
        tag = allocation_tag(allocation_id)
        with self._lock:
            if self._tags.get(tag.hex()) != allocation_id:
                self._tags[tag.hex()] = allocation_id
                self._save()
        return tag

    def forget_tag(self, allocation_id: str) -> None:
        """Drop the name of an allocation that the switch refused (no extent carries its tag)."""
        key = allocation_tag(allocation_id).hex()
        with self._lock:
            if self._tags.get(key) == allocation_id:
                del self._tags[key]
                self._save()

    def allocation_of(self, tag: bytes) -> str:
        """The allocation id a tag stands for; a tag the driver did not set is shown as ``tag-<hex>``."""
        with self._lock:
            return self._tags.get(tag.hex(), f"tag-{tag.hex()}")

    def name_ld(self, port: int, ld: int, allocation_id: str) -> None:
        """Record that LD ``ld`` of the MLD on ``port`` is being carved for ``allocation_id``."""
        key = f"{port}/{ld}"
        with self._lock:
            if self._lds.get(key) != allocation_id:
                self._lds[key] = allocation_id
                self._save()

    def ld_allocation(self, port: int, ld: int) -> str | None:
        """The allocation id an LD was last carved for, or None."""
        with self._lock:
            return self._lds.get(f"{port}/{ld}")

    def forget_ld(self, port: int, ld: int) -> None:
        key = f"{port}/{ld}"
        with self._lock:
            if self._lds.pop(key, None) is not None:
                self._save()


def _parse(data: Any) -> tuple[int, dict[str, str], dict[str, str]]:
    """The epoch, the tags' and the LDs' allocation ids of a state file; ValueError for any other shape."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    epoch = data.get("epoch", 0)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
    names = []
    for key in ("tags", "lds"):
        table = data.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ValueError(f"{key} is not an object of allocation ids")
        names.append(dict(table))
    return epoch, names[0], names[1]
