"""The driver's state file: allocation id -> (host, downstream port, Type-3 device, serial, size), the highest
fencing epoch and the next serial number.

QEMU knows devices, not allocation ids, so the mapping has to live somewhere that outlives the driver: a JSON
file in ``state_dir``, replaced atomically (write, fsync, rename) so that a crash leaves the old or the new
file, never half of one. QMP discovery stays the truth for what a host holds; this file only names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import FabricUnavailableError
from disagg.statedir import write_durably

FIRST_SERIAL = 0x1000
STATE_VERSION = 1


@attrs.frozen
class Record:
    """One allocation as the driver carved it. ``releasing`` marks one whose host is being restarted
    without it, so that a crash midway never cold-plugs it again. ``plugged`` is False while the hot-add that
    the record announces has not been seen to happen (its answer may have been lost): such a record holds no
    port, so a restart of its host must not cold-plug it beside an allocation that took that port since."""

    allocation: str
    host: str
    port: int
    sn: int
    size: int
    extents: tuple[tuple[int, int], ...]
    volatile: bool = False
    releasing: bool = False
    plugged: bool = True

    @property
    def device(self) -> str:
        """The Type-3's QOM id; derived from the fabric-unique serial, so it is unique too."""
        return f"cxl-t3-{self.sn:x}"

    @property
    def memdev(self) -> str:
        return f"cxl-mem-{self.sn:x}"

    @property
    def lsa(self) -> str:
        return f"cxl-lsa-{self.sn:x}"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "sn": self.sn,
            "size": self.size,
            "extents": [list(e) for e in self.extents],
            "volatile": self.volatile,
            "releasing": self.releasing,
            "plugged": self.plugged,
        }

    @classmethod
    def from_json(cls, allocation: str, doc: dict[str, Any]) -> Record:
        return cls(
            allocation=allocation,
            host=str(doc["host"]),
            port=int(doc["port"]),
            sn=int(doc["sn"]),
            size=int(doc["size"]),
            extents=tuple((int(a), int(b)) for a, b in doc["extents"]),
            volatile=bool(doc.get("volatile", False)),
            releasing=bool(doc.get("releasing", False)),
            plugged=bool(doc.get("plugged", True)),
        )


@attrs.frozen
class State:
    epoch: int = 0
    next_sn: int = FIRST_SERIAL
    records: tuple[Record, ...] = ()

    def record(self, allocation: str) -> Record | None:
        return next((r for r in self.records if r.allocation == allocation), None)

    def on_host(self, host: str) -> list[Record]:
        return [r for r in self.records if r.host == host]

    def cold_plugged(self, host: str) -> list[Record]:
        """The records a start of ``host``'s QEMU plugs: those its QEMU held, and that no release is taking away."""
        return [r for r in self.on_host(host) if r.plugged and not r.releasing]

    def with_record(self, record: Record) -> State:
        others = tuple(r for r in self.records if r.allocation != record.allocation)
        return attrs.evolve(self, records=(*others, record))

    def without(self, allocation: str) -> State:
        return attrs.evolve(self, records=tuple(r for r in self.records if r.allocation != allocation))


class StateFile:
    """Load and atomically save `State`. Not thread-safe: the fabric serialises its mutations."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> State:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return State()
        except (OSError, ValueError) as exc:
            raise FabricUnavailableError(f"cannot read the qemu-cxl state file {self.path}: {exc}") from None
        try:
            allocations = doc["allocations"]
            if not isinstance(allocations, dict):
                raise TypeError(f"allocations is {type(allocations).__name__}, not a table of allocation ids")
            records = tuple(Record.from_json(a, r) for a, r in allocations.items())
            return State(epoch=int(doc["epoch"]), next_sn=int(doc["next_sn"]), records=records)
        except (KeyError, TypeError, ValueError) as exc:
            raise FabricUnavailableError(f"the qemu-cxl state file {self.path} is malformed: {exc!r}") from None

    def save(self, state: State) -> None:
        doc = {
            "version": STATE_VERSION,
            "epoch": state.epoch,
            "next_sn": state.next_sn,
            "allocations": {r.allocation: r.to_json() for r in sorted(state.records, key=lambda r: r.allocation)},
        }
        try:
            write_durably(self.path, json.dumps(doc, indent=1))
        except OSError as exc:
            raise FabricUnavailableError(f"cannot write the qemu-cxl state file {self.path}: {exc}") from None
