"""The SQLite ledger's backup and restore, followed as docs/durability.md writes them against a real `disagg serve`:
a backup taken while the server composes, restored, gives a server that reconciles to the hardware, with nothing
lost or held twice; a backup moved into place under a running server stops it, and the restore after it gives the
backup, not the backup mixed with the replaced file's write-ahead log."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from crash_helpers import (
    GIB,
    CrashRig,
    Quarantine,
    ServeProcess,
    compose_request,
    cordoned_devices,
    list_compositions,
    quarantine_events,
    violations,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.model import Composition, CompositionState
from disagg.wire.fabric import composition_from_wire

LOAD = 6
"""Compositions composed while the backup is taken."""
WAIT_S = 30.0


def _compose(server: ServeProcess, name: str, *, memory_gib: int = 0) -> Composition:
    resources = [fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)]
    if memory_gib:
        resources.append(fm.ResourceRequest(kind=pb.DEVICE_KIND_CXL_MEMORY, amount_bytes=memory_gib * GIB))
    answer = server.call("Compose", compose_request(name, resources, f"compose-{name}"))
    return composition_from_wire(answer.composition)


def _online_backup(rig: CrashRig, to: Path) -> None:
    """What `sqlite3 ledger.db ".backup to"` does: SQLite's online backup of the ledger in use."""
    with sqlite3.connect(rig.ledger_path) as live, sqlite3.connect(to) as copy:
        live.backup(copy)
    copy.close()
    live.close()


def _restore(rig: CrashRig, backup: Path) -> None:
    """The restore as written: the backup at the ledger's path, its `-wal` and `-shm` deleted."""
    backup.replace(rig.ledger_path)
    for suffix in ("-wal", "-shm"):
        rig.ledger_path.with_name(rig.ledger_path.name + suffix).unlink(missing_ok=True)


def _by_name(server: ServeProcess) -> dict[str, Composition]:
    comps = list_compositions(server)
    assert len({c.name for c in comps}) == len(comps), comps
    return {c.name: c for c in comps}


def _agrees_with_the_hardware(rig: CrashRig, server: ServeProcess) -> None:
    """No device or memory in two compositions, nothing stuck, and what the hardware holds beyond the ledger is
    what the server reported quarantined."""
    quarantine = Quarantine(frozenset(cordoned_devices(server)), quarantine_events(rig.ledger_events()))
    unexplained = [v for v in violations(list_compositions(server), rig.hardware(), quarantine) if "[reported" not in v]
    assert not unexplained, unexplained


class TestAnOnlineBackupRestored:
    def test_it_reconciles_to_the_hardware_with_nothing_lost_or_doubled(self, tmp_path: Path) -> None:
        rig = CrashRig(tmp_path)
        backup = tmp_path / "backup.db"
        server = rig.start()
        loads: list[Composition] = []
        first_answered = threading.Event()

        def load() -> None:
            for i in range(LOAD):
                loads.append(_compose(server, f"load{i}"))
                first_answered.set()

        try:
            kept = _compose(server, "kept", memory_gib=2)
            gone = _compose(server, "gone")
            loader = threading.Thread(target=load)
            loader.start()
            assert first_answered.wait(WAIT_S)  # a write after kept's and gone's last records: they are on disk
            _online_backup(rig, backup)
            loader.join(WAIT_S)
            later = _compose(server, "later", memory_gib=1)
            server.call("Decompose", fm.DecomposeRequest(id=gone.id))
        finally:
            server.stop_cleanly("the first")
        assert len(loads) == LOAD
        _restore(rig, backup)
        server = rig.start()
        try:
            comps = _by_name(server)
            assert comps["kept"].state is CompositionState.COMPOSED
            assert comps["kept"].allocations == kept.allocations
            assert comps["gone"].state is CompositionState.DEGRADED
            assert "later" not in comps
            cordoned = cordoned_devices(server)
            quarantined = {e["subject"] for e in quarantine_events(rig.ledger_events())}
            assert set(later.device_ids) <= cordoned & quarantined
            assert {a.id for a in later.allocations} <= quarantined
            for made in loads:  # in the backup (finished, as the hardware holds it all) or quarantined
                if made.name in comps:
                    assert comps[made.name].state is CompositionState.COMPOSED, comps[made.name]
                    assert comps[made.name].device_ids == made.device_ids
                else:
                    assert set(made.device_ids) <= cordoned & quarantined, made
            server.call("Decompose", fm.DecomposeRequest(id=comps["gone"].id))  # "decompose it again"
            assert "gone" not in _by_name(server)
            _agrees_with_the_hardware(rig, server)
        finally:
            server.stop_cleanly("the restored")


class TestABackupMovedIntoPlaceWhileServing:
    def test_the_server_stops_and_the_restore_gives_the_backup(self, tmp_path: Path) -> None:
        rig = CrashRig(tmp_path)
        backup = tmp_path / "backup.db"
        server = rig.start()
        try:
            kept = _compose(server, "kept")
            _compose(server, "next")  # its first write follows kept's last
            _online_backup(rig, backup)
            later = _compose(server, "later")
            server.call("Decompose", fm.DecomposeRequest(id=kept.id))
            staged = tmp_path / "staged.db"
            staged.write_bytes(backup.read_bytes())
            staged.replace(rig.ledger_path)  # `mv`, under the running server
            status = server.wait_exit()
        finally:
            server.kill()
        assert status == 2, server.output
        assert "was removed or replaced" in server.output
        _restore(rig, backup)
        server = rig.start()
        try:
            comps = _by_name(server)
            assert set(comps) == {"kept", "next"}, server.output
            assert comps["kept"].state is CompositionState.DEGRADED
            assert comps["next"].state is CompositionState.COMPOSED
            assert set(later.device_ids) <= cordoned_devices(server)
            server.call("Decompose", fm.DecomposeRequest(id=comps["kept"].id))
            _agrees_with_the_hardware(rig, server)
        finally:
            server.stop_cleanly("the restored")
