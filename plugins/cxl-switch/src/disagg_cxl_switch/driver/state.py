"""What the driver keeps beside the switch: the highest fencing epoch, which allocation id each DC extent
tag stands for, and which allocation id each LD of an MLD was carved for. In ``state_dir`` when there is one
(written atomically), else in memory for the process.

A DC extent carries a 16-byte tag; the driver puts the first 16 bytes of the SHA-256 of the allocation id in it,
so the switch itself groups an allocation's extents and releases them by tag. A hash cannot be read back, so
the id it came from is kept here, recorded before the extents are added so that a crash in between still names
them, and dropped once they are released. An LD carries no tag at all, so its allocation id is kept here too,
with the VCS of the host it is carved for, recorded before its allocation is set: the LD is the allocation's
only while it is unbound or bound to that VCS (another manager may bind it to another host meanwhile).

A tag carved by the pool of one DC region also records that pool (``regions``): a tag without one is the
device's pool's, as every tag the release before recorded is, when a DCD of several regions was one pool.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import ConfigError, FabricUnavailableError, StaleEpochError
from disagg.statedir import write_durably


def allocation_tag(allocation_id: str, region_pool: str | None = None) -> bytes:
    """The tag of the allocation's extents: of the id alone in the device's pool, as always; of the pool and the
    id in one region's pool, so that two region pools of a DCD (whose extent lists are the hosts', not the
    regions') may each hold an allocation of the same id, as any two pools may."""
    named = allocation_id if region_pool is None else f"{region_pool} {allocation_id}"
    return hashlib.sha256(named.encode()).digest()[:16]


@attrs.frozen
class LDRecord:
    """What an LD was carved for: the allocation id and the VCS of its host. ``vcs`` is None in a record written
    before VCSs were recorded, which is taken to be the VCS whatever holds the LD, as then."""

    allocation: str
    vcs: int | None

    def held_by(self, vcs: int) -> bool:
        """Whether an LD bound to VCS ``vcs`` is this record's allocation."""
        return self.vcs is None or self.vcs == vcs


class DriverState:
    def __init__(self, state_dir: Path | None) -> None:
        self._path = state_dir / "driver-state.json" if state_dir is not None else None
        self._lock = threading.Lock()
        self._epoch = 0
        self._tags: dict[str, str] = {}
        self._lds: dict[str, LDRecord] = {}
        self._regions: dict[str, str] = {}
        if self._path is not None and self._path.exists():
            try:
                data = json.loads(self._path.read_text())
                self._epoch, self._tags, self._lds = _parse(data)
                self._regions = _regions(data)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"the driver state {self._path} cannot be read ({exc}); restore it, or move it away to start "
                    "without it (the fencing epoch then restarts at 0, and the allocations it named are listed as "
                    "tag-<hex> or ld-<N>)",
                    field="state_dir",
                ) from None

    def _save(
        self, epoch: int, tags: dict[str, str], lds: dict[str, LDRecord], regions: dict[str, str] | None = None
    ) -> None:
        """Write ``epoch``, ``tags``, ``lds`` and ``regions`` (None: as they are) as the state, durably (the file
        and its directory synced), before the caller takes them into memory: a state that could not be saved is
        not taken, so the call that needed it fails and its retry saves it again. An epoch held in memory only
        would be forgotten by a restart, and a deposed manager's older one accepted again."""
        if self._path is None:
            return
        body = {
            "epoch": epoch,
            "tags": tags,
            "lds": {key: attrs.asdict(record) for key, record in lds.items()},
            "regions": self._regions if regions is None else regions,
        }
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            write_durably(self._path, json.dumps(body, sort_keys=True))
        except OSError as exc:
            raise FabricUnavailableError(
                f"the driver state {self._path} cannot be written ({exc}); nothing was changed: retry once it can"
            ) from exc

    def fence(self, epoch: int) -> None:
        """Remember ``epoch`` if it is the highest yet; refuse an older one before anything is touched."""
        with self._lock:
            if epoch < self._epoch:
                raise StaleEpochError(f"epoch {epoch} is older than {self._epoch}, already seen by this switch")
            if epoch > self._epoch:
                self._save(epoch, self._tags, self._lds)
                self._epoch = epoch

    def name_tag(self, allocation_id: str, region_pool: str | None = None) -> bytes:
        """The allocation's tag, recorded with the id and, when one region's pool carves it, that pool."""
        tag = allocation_tag(allocation_id, region_pool)
        key = tag.hex()
        with self._lock:
            if self._tags.get(key) != allocation_id or self._regions.get(key) != region_pool:
                tags = {**self._tags, key: allocation_id}
                regions = {k: v for k, v in self._regions.items() if k != key}
                if region_pool is not None:
                    regions[key] = region_pool
                self._save(self._epoch, tags, self._lds, regions)
                self._tags, self._regions = tags, regions
        return tag

    def forget_tag(self, allocation_id: str, region_pool: str | None = None) -> None:
        """Drop the name of an allocation that the switch refused or released (no extent carries its tag)."""
        key = allocation_tag(allocation_id, region_pool).hex()
        with self._lock:
            if self._tags.get(key) == allocation_id:
                tags = {k: v for k, v in self._tags.items() if k != key}
                regions = {k: v for k, v in self._regions.items() if k != key}
                self._save(self._epoch, tags, self._lds, regions)
                self._tags, self._regions = tags, regions

    def allocation_of(self, tag: bytes) -> str:
        """The allocation id a tag stands for; a tag the driver did not set is shown as ``tag-<hex>``."""
        with self._lock:
            return self._tags.get(tag.hex(), f"tag-{tag.hex()}")

    def region_pool_of(self, tag: bytes) -> str | None:
        """The pool of one DC region that carved the tag's extents; None for the device's pool, or a tag the
        driver did not set."""
        with self._lock:
            return self._regions.get(tag.hex())

    def has_tags_without_region(self) -> bool:
        """Whether a tag is recorded without the pool of one region: the device's pool's."""
        with self._lock:
            return any(key not in self._regions for key in self._tags)

    def recorded(self, tag: bytes) -> bool:
        """Whether the driver set the tag (it knows its allocation id)."""
        with self._lock:
            return tag.hex() in self._tags

    def name_ld(self, port: int, ld: int, allocation_id: str, vcs: int) -> None:
        """Record that LD ``ld`` of the MLD on ``port`` is being carved for ``allocation_id`` on VCS ``vcs``."""
        key, record = f"{port}/{ld}", LDRecord(allocation_id, vcs)
        with self._lock:
            if self._lds.get(key) != record:
                lds = {**self._lds, key: record}
                self._save(self._epoch, self._tags, lds)
                self._lds = lds

    def ld_record(self, port: int, ld: int) -> LDRecord | None:
        """What an LD was last carved for, or None."""
        with self._lock:
            return self._lds.get(f"{port}/{ld}")

    def forget_ld(self, port: int, ld: int) -> None:
        key = f"{port}/{ld}"
        with self._lock:
            if key in self._lds:
                lds = {k: v for k, v in self._lds.items() if k != key}
                self._save(self._epoch, self._tags, lds)
                self._lds = lds


def _parse(data: Any) -> tuple[int, dict[str, str], dict[str, LDRecord]]:
    """The epoch, the tags' allocation ids and the LDs' records of a state file; ValueError for any other shape."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    epoch = data.get("epoch", 0)
    if not _is_count(epoch):
        raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
    tags = data.get("tags", {})
    if not isinstance(tags, dict) or not all(isinstance(v, str) for v in tags.values()):
        raise ValueError("tags is not an object of allocation ids")
    lds = data.get("lds", {})
    if not isinstance(lds, dict):
        raise ValueError("lds is not an object of LD records")
    return epoch, dict(tags), {key: _ld_record(value) for key, value in lds.items()}


def _regions(data: dict[str, Any]) -> dict[str, str]:
    """The region pools of a state file's tags; none in a file the release before wrote."""
    regions = data.get("regions", {})
    if not isinstance(regions, dict) or not all(isinstance(v, str) for v in regions.values()):
        raise ValueError("regions is not an object of pool ids")
    return dict(regions)


def _ld_record(value: Any) -> LDRecord:
    """An LD's record: ``{"allocation": id, "vcs": n}``, or the bare id a driver wrote before it kept VCSs."""
    if isinstance(value, str):
        return LDRecord(value, None)
    if not isinstance(value, dict) or set(value) != {"allocation", "vcs"}:
        raise ValueError(f"LD record {value!r} is not an allocation id and a VCS")
    allocation, vcs = value["allocation"], value["vcs"]
    if not isinstance(allocation, str) or not (vcs is None or _is_count(vcs)):
        raise ValueError(f"LD record {value!r} is not an allocation id and a VCS")
    return LDRecord(allocation, vcs)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
