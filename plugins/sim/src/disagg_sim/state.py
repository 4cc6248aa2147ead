"""The simulated hardware's mutable state, saved to a JSON file so that separate processes see one fabric.

A CLI run is one process and the next run another; with a state file both drive the same "hardware". The
file holds only what differs from a freshly powered-on fabric: bindings, carved allocations, injected faults
(failed devices, links down, pending flaky binds), the health of devices repaired since the topology
described them unhealthy, and the highest fencing epoch seen. It is written whole after every change, to a
temporary file that is synced and then replaces the old one (``os.replace``), and the directory is synced
after the rename, so that a crash or a power loss leaves either the old state or the new, never half of one.
The temporary file's name holds the writer's pid, so that loading the state removes what a killed writer
left behind and never the file another live process is writing.

This module checks the file's shape; whether its contents fit the topology (known devices, hosts, pools,
links) is for the fabric to check, because only it knows the topology.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import ConfigError, InvalidRequestError
from disagg.interfaces import check_id
from disagg.model import Allocation, Extent, Health

FORMAT_1 = "disagg-sim-state/1"
FORMAT = "disagg-sim-state/2"
"""/1 plus ``health``, written only when a device's health differs from the topology's other than FAILED (a
repaired one): a /1 reader would ignore ``health`` and bring it back unhealthy, so the name differs. Otherwise
a state is written as /1, which the previous version reads too (a process not yet upgraded, or a rollback)."""
READABLE_FORMATS = (FORMAT_1, FORMAT)
MAX_EPOCH = 2**64 - 1
"""The largest fencing epoch: the driver protocol carries a ``uint64``, and the remote path refuses a larger one
(`InvalidRequestError`); remembered in process, it would fence off every epoch a manager can send."""


@attrs.frozen
class SimState:
    """A snapshot of the simulated hardware; ``failed`` maps a device to its failure message, ``health`` a
    device that is not FAILED to its health, where that differs from the topology's (a repaired device)."""

    fabric: str
    epoch: int = 0
    bindings: Mapping[str, str] = attrs.field(factory=dict)
    allocations: tuple[Allocation, ...] = ()
    failed: Mapping[str, str] = attrs.field(factory=dict)
    health: Mapping[str, Health] = attrs.field(factory=dict)
    links_down: tuple[tuple[str, str], ...] = ()
    flaky_any: int = 0
    flaky: Mapping[str, int] = attrs.field(factory=dict)


class StateFile:
    """Loads and atomically saves a `SimState` at one path."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if "\0" in str(path):  # TOML lets a string hold one; no file name can
            raise self._error("must not hold a NUL character")

    def load(self) -> SimState | None:
        """The saved state, or None when there is no file yet. Raises ConfigError for a corrupt file."""
        self._sweep()
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise self._error(f"cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or a number of more digits than Python reads
            raise self._error(f"is not valid JSON ({exc}); delete it to start from a powered-on fabric") from None
        except RecursionError:
            raise self._error(
                "is not valid JSON (nested too deeply); delete it to start from a powered-on fabric"
            ) from None
        try:
            state = _decode(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise self._error(f"is corrupt ({exc}); delete it to start from a powered-on fabric") from None
        if state.epoch > MAX_EPOCH:  # taken in process by a release before, and saved
            raise self._error(
                f"holds epoch {state.epoch}, more than {MAX_EPOCH}, the most a fabric manager can send, so that "
                f"every call would be fenced off: set its epoch to the manager's (at most {MAX_EPOCH}), or delete "
                "it to start from a powered-on fabric"
            )
        return state

    def save(self, state: SimState) -> None:
        """Write ``state`` atomically and durably. Errors propagate (OSError, or TypeError for a value JSON
        cannot hold): the caller decides what a failed save means."""
        text = json.dumps(_encode(state), indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{self._tmp_prefix}{os.getpid()}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._sync_directory()

    def _sync_directory(self) -> None:
        """Make the rename survive a power loss. Best effort: once renamed, the new state is what every reader
        sees, so failing here would have the caller undo in memory a change the file holds."""
        with contextlib.suppress(OSError):
            fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @property
    def _tmp_prefix(self) -> str:
        return f".{self.path.name}."

    def _sweep(self) -> None:
        """Remove the temporary files of writers that are no longer running (killed between writing one and
        renaming it). A file whose name holds no pid, the pid of a live process, or is another state file's (one
        named as this one and more), is left alone."""
        try:
            names = [n for n in os.listdir(self.path.parent) if n.startswith(self._tmp_prefix) and n.endswith(".tmp")]
        except OSError:
            return
        for name in names:
            # Exactly `<pid>.<random>.tmp` (mkstemp's random part holds no dot): `.rack.7.123.x.tmp` is the file of
            # the state file `rack.7`, whose writer may be running, not one of `rack`'s by a pid 7.
            parts = name[len(self._tmp_prefix) :].split(".")
            if len(parts) == 3 and parts[0].isdigit() and not _running(int(parts[0])):
                (self.path.parent / name).unlink(missing_ok=True)

    def _error(self, message: str) -> ConfigError:
        return ConfigError(f"state file {self.path} {message}", field="state_file")


def _running(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts: it may be writing)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def _encode(state: SimState) -> dict[str, Any]:
    encoded = {
        "format": FORMAT if state.health else FORMAT_1,
        "fabric": state.fabric,
        "epoch": state.epoch,
        "bindings": dict(state.bindings),
        "allocations": [
            {
                "id": a.id,
                "pool": a.pool,
                "host": a.host,
                "amount_bytes": a.amount_bytes,
                "extents": [[e.offset, e.length] for e in a.extents],
            }
            for a in state.allocations
        ],
        "failed": dict(state.failed),
        "links_down": [list(pair) for pair in state.links_down],
        "flaky_any": state.flaky_any,
        "flaky": dict(state.flaky),
    }
    if state.health:
        encoded["health"] = {device: health.value for device, health in state.health.items()}
    return encoded


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {value!r}")
    return value


def _id(value: object, what: str) -> str:
    """An id as the fabric's calls take it (`check_id`): one that is not would be listed, and every release of it
    refused as malformed, so that it could never be given back."""
    try:
        return check_id(value, what)
    except InvalidRequestError as exc:
        raise ValueError(exc.message) from None


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{what} must be a non-negative integer, not {value!r}")
    return value


def _table(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object, not {value!r}")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list, not {value!r}")
    return value


def _decode(data: object) -> SimState:
    top = _table(data, "the file")
    if top.get("format") not in READABLE_FORMATS:
        raise ValueError(f"format is {top.get('format')!r}, expected one of {', '.join(map(repr, READABLE_FORMATS))}")
    allocations = []
    for i, raw in enumerate(_list(top.get("allocations", []), "allocations")):
        item = _table(raw, f"allocations[{i}]")
        extents = []
        for pair in _list(item["extents"], f"allocations[{i}].extents"):
            offset, length = _list(pair, f"allocations[{i}] extent")
            extents.append(Extent(_int(offset, "extent offset"), _int(length, "extent length")))
        allocations.append(
            Allocation(
                id=_id(item["id"], f"allocations[{i}].id"),
                pool=_str(item["pool"], "allocation pool"),
                host=_str(item["host"], "allocation host"),
                amount_bytes=_int(item["amount_bytes"], "allocation amount_bytes"),
                extents=tuple(extents),
            )
        )
    links_down = []
    for pair in _list(top.get("links_down", []), "links_down"):
        a, b = _list(pair, "a down link")
        links_down.append((_str(a, "link end"), _str(b, "link end")))
    return SimState(
        fabric=_str(top["fabric"], "fabric"),
        epoch=_int(top.get("epoch", 0), "epoch"),
        bindings={
            _str(k, "device"): _str(v, "bound host") for k, v in _table(top.get("bindings", {}), "bindings").items()
        },
        allocations=tuple(allocations),
        failed={_str(k, "device"): _str(v, "message") for k, v in _table(top.get("failed", {}), "failed").items()},
        health={
            _str(k, "device"): Health(_str(v, "health")) for k, v in _table(top.get("health", {}), "health").items()
        },
        links_down=tuple(links_down),
        flaky_any=_int(top.get("flaky_any", 0), "flaky_any"),
        flaky={_str(k, "device"): _int(v, "flaky count") for k, v in _table(top.get("flaky", {}), "flaky").items()},
    )
