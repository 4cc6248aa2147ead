"""A SQLite ledger that is damaged, removed or replaced, or written by a newer disagg: each is refused (or fails the
store) with what the operator must do, and nothing is written into it."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from disagg.cli.main import main
from disagg.errors import ConfigError, FabricUnavailableError
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.model import (
    Composition,
    CompositionState,
    DeviceKind,
    Event,
    EventType,
    ResourceRequest,
    Selector,
    SelectorOp,
)
from disagg.store import SqliteStore
from disagg.store.sqlite import APPLICATION_ID, IN_PLACE_CHECK_S, SCHEMA_VERSION
from server_helpers import WAIT_S, compose_request, serve_child

PAGE = 4096
"""SQLite's page size, as the ledger is made."""
FAILED_WITHIN_S = 10 * IN_PLACE_CHECK_S
"""A bound on the wait for an idle store to find its file gone (it checks every `IN_PLACE_CHECK_S`)."""


def _composition(cid: str, name_bytes: int = 0) -> Composition:
    """A composition whose record nests values (a resource line, a selector), as a served one does; its name
    padded to ``name_bytes``, for a record larger than a page."""
    line = ResourceRequest(DeviceKind.GPU, count=1, selectors=(Selector("model", SelectorOp.EQ, "H200"),))
    name = f"name-{cid}".ljust(name_bytes, "x")
    return Composition(id=cid, name=name, host="h1", state=CompositionState.COMPOSED, resources=(line,))


def _ledger(path: Path, compositions: int = 200) -> Path:
    """A closed ledger at ``path`` holding ``compositions`` compositions."""
    store = SqliteStore(path)
    try:
        for n in range(compositions):
            store.put_composition(_composition(f"c{n}"))
        store.sync()
    finally:
        store.close()
    return path


def _root_page(path: Path, name: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        ((page,),) = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,))
    return int(page)


def _damage_page(path: Path, page: int) -> None:
    """Overwrite page ``page`` (from 1) of the file at ``path`` with random bytes, as a failing disk might."""
    with path.open("r+b") as f:
        f.seek(PAGE * (page - 1))
        f.write(random.Random(page).randbytes(PAGE))


def _stamp(path: Path, application_id: int, user_version: int) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA application_id = {application_id}")
        db.execute(f"PRAGMA user_version = {user_version}")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "l" / "ledger.db")
    yield s
    s.close()


class TestADamagedLedger:
    """A ledger with a damaged page is refused at open, untouched, with a message to restore it from a backup
    (exit 2), instead of passing the open and failing every start at its first commit (exit 1, for ever)."""

    @pytest.mark.parametrize("table", ["sqlite_autoindex_compositions_1", "cordons"], ids=["an-index", "a-table"])
    def test_refused_at_open_untouched(self, tmp_path: Path, table: str) -> None:
        path = _ledger(tmp_path / "ledger.db")
        _damage_page(path, _root_page(path, table))
        before = path.read_bytes()
        with pytest.raises(ConfigError, match=r"restore it from a backup \(docs/durability.md\)") as info:
            SqliteStore(path)
        assert info.value.field == "state.path"
        assert path.read_bytes() == before
        assert not path.with_name("ledger.db-wal").exists()

    def test_damage_found_by_a_commit_is_named_as_damage(self, store: SqliteStore) -> None:
        """Not "cannot be written", the words of a full or failing disk, which a restart may get past."""
        for n in range(200):
            store.put_composition(_composition(f"c{n}"))
        store.sync()
        store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file, none in the WAL
        _damage_page(store.path, _root_page(store.path, "sqlite_autoindex_compositions_1"))
        store._db.execute("PRAGMA shrink_memory")  # the connection reads its pages from the file again
        store.put_composition(_composition("after"))
        with pytest.raises(FabricUnavailableError, match=r"is damaged \(.*malformed.*\): restore it from a backup"):
            store.sync()
        assert store.needs_operator
        assert "restore it from a backup" in store.failure

    def test_a_failed_commit_that_is_no_damage_is_not_called_damage(self, store: SqliteStore) -> None:
        store._enqueue(lambda batch: batch.prune(("INSERT INTO no_such_table VALUES (1)", ())))
        with pytest.raises(FabricUnavailableError, match="cannot be written"):
            store.sync()
        assert not store.needs_operator

    @pytest.mark.parametrize("prunes", [False, True], ids=["one-statement", "begin-immediate"])
    def test_a_full_disk_is_named(self, tmp_path: Path, prunes: bool) -> None:
        """SQLite rolls a transaction back itself when the disk is full: under BEGIN IMMEDIATE (a group that
        prunes the event log) the ROLLBACK that followed failed ("no transaction is active"), and every waiter
        was told that instead of the full disk."""
        store = SqliteStore(tmp_path / "ledger.db", event_retention=1 if prunes else 1000)
        try:
            store.append_event(Event(1, EventType.COMPOSITION_CREATED, "c0"))
            store.sync()
            with store._db_lock:  # a disk with one page left; and the writes below go in one group
                ((pages,),) = store._db.execute("PRAGMA page_count")
                store._db.execute(f"PRAGMA max_page_count = {pages + 1}")
                store.put_composition(_composition("big", name_bytes=20_000))
                store.append_event(Event(2, EventType.COMPOSITION_CREATED, "big"))
            with pytest.raises(FabricUnavailableError, match=r"cannot be written: .*database or disk is full"):
                store.sync()
            assert not store.needs_operator  # the machine's trouble, which a restart may get past
        finally:
            store.close()


def _wait_for_failure(store: SqliteStore) -> str:
    deadline = time.monotonic() + FAILED_WITHIN_S
    while not store.failure and time.monotonic() < deadline:
        time.sleep(0.05)
    return store.failure


class TestALedgerRemovedWhileOpen:
    """A ledger whose file, lock file or directory is removed or replaced while a store has it open fails the
    store (every write refused from then on, and a server stops): its changes went to a file no one opens again,
    and a second fabric manager could lock a new lock file and start beside it."""

    def test_a_change_after_the_file_is_removed_is_refused(self, store: SqliteStore) -> None:
        store.put_composition(_composition("before"))
        store.sync()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{store.path}{suffix}").unlink()
        store.put_composition(_composition("after"))
        with pytest.raises(FabricUnavailableError, match=r"ledger file at .* was removed or replaced \(it is gone\)"):
            store.sync()
        with pytest.raises(FabricUnavailableError, match="was removed or replaced"):
            store.put_composition(_composition("later"))
        assert store.needs_operator  # a restart would start on another file: not the supervisor's to retry

    def test_a_ledger_opened_by_a_relative_path_stays_in_place_across_a_chdir(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """It was checked by the path as given, read from the working directory of the moment: a program that
        changed directory (a daemon's chdir to /) had its ledger failed as "gone"."""
        monkeypatch.chdir(tmp_path)
        store = SqliteStore("ledger.db")
        try:
            monkeypatch.chdir("/")
            store.put_composition(_composition("after-chdir"))
            store.sync()
            time.sleep(2 * IN_PLACE_CHECK_S)  # an idle check or two
            assert store.failure == ""
        finally:
            store.close()

    def test_a_file_put_in_its_place_is_found(self, store: SqliteStore, tmp_path: Path) -> None:
        """As a restore of a backup under a running server does: the server must not write over it unseen."""
        store.put_composition(_composition("before"))
        store.sync()
        backup = _ledger(tmp_path / "backup" / "ledger.db", compositions=1)
        os.replace(backup, store.path)
        store.put_composition(_composition("after"))
        with pytest.raises(FabricUnavailableError, match=r"removed or replaced \(another file is there\)"):
            store.sync()

    def test_an_idle_store_finds_its_directory_removed(self, store: SqliteStore) -> None:
        """Without a write to commit: the server stops within a second or two, so a second one started beside
        it (its lock file went with the directory) does not serve beside it for long."""
        shutil.rmtree(store.path.parent)
        assert "was removed or replaced" in _wait_for_failure(store)

    def test_the_write_ahead_log_removed_is_found(self, store: SqliteStore) -> None:
        """As an operator's restore that removes ``ledger.db-wal`` before stopping the server: SQLite goes on
        writing to the file removed, which holds every commit since the last checkpoint, and a crash loses them
        all. Nothing more is acknowledged into it."""
        store.put_composition(_composition("before"))
        store.sync()
        wal = store.path.with_name("ledger.db-wal")
        wal.unlink()
        store.put_composition(_composition("after"))
        with pytest.raises(FabricUnavailableError, match=rf"write-ahead log {wal} was removed or replaced"):
            store.sync()
        assert "killed first, it is lost" in store.failure
        assert store.needs_operator

    def test_what_the_removed_log_held_is_kept_by_a_close(self, tmp_path: Path) -> None:
        """SQLite checkpoints the log it still has open as the store closes: what was acknowledged before the log
        was removed reaches the ledger then, and only a process killed first loses it. The message said it was
        lost whenever the process stopped."""
        store = SqliteStore(tmp_path / "ledger.db")
        store.put_composition(_composition("before"))
        store.sync()
        store.path.with_name("ledger.db-wal").unlink()
        store.put_composition(_composition("after"))
        with pytest.raises(FabricUnavailableError):
            store.sync()
        assert "reaches the ledger only as this process closes it" in store.failure
        store.close()
        reopened = SqliteStore(tmp_path / "ledger.db")
        try:
            assert [c.id for c in reopened.load().compositions] == ["before"]
        finally:
            reopened.close()

    def test_an_idle_store_finds_its_write_ahead_log_replaced(self, store: SqliteStore) -> None:
        wal = store.path.with_name("ledger.db-wal")
        wal.unlink()
        wal.touch()
        assert "write-ahead log" in _wait_for_failure(store)

    def test_the_lock_file_removed_is_found(self, store: SqliteStore) -> None:
        lock = store.path.with_name("ledger.db.lock")
        lock.unlink()
        failure = _wait_for_failure(store)
        assert f"lock file {lock} was removed or replaced" in failure
        assert "beside this one" in failure


class TestTheSchemaVersion:
    """The ledger's file carries its layout's version: one a newer disagg wrote is refused with the upgrade it
    needs, untouched (it was called "not a ledger", to be restored from a backup, losing what the newer one
    wrote); one written before versions were kept opens as before."""

    def test_a_new_ledger_is_stamped(self, tmp_path: Path) -> None:
        path = _ledger(tmp_path / "ledger.db", compositions=0)
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert db.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
            assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)

    @pytest.mark.parametrize(
        "change",
        ["", "CREATE TABLE ledger_meta (k TEXT, v TEXT)", "ALTER TABLE compositions ADD COLUMN version INTEGER"],
        ids=["same-tables", "a-new-table", "a-new-column"],
    )
    def test_a_newer_disagg_s_ledger_is_refused_untouched(self, tmp_path: Path, change: str) -> None:
        path = _ledger(tmp_path / "ledger.db", compositions=2)
        with contextlib.closing(sqlite3.connect(path)) as db:
            if change:
                db.execute(change)
        _stamp(path, APPLICATION_ID, SCHEMA_VERSION + 1)
        before = path.read_bytes()
        with pytest.raises(ConfigError) as info:
            SqliteStore(path)
        assert f"written by a newer disagg (schema {SCHEMA_VERSION + 1}); upgrade disagg" in info.value.message
        assert "backup" not in info.value.message
        assert path.read_bytes() == before
        assert not path.with_name("ledger.db-wal").exists()

    def test_another_program_s_version_is_not_a_newer_ledger(self, tmp_path: Path) -> None:
        path = tmp_path / "ledger.db"
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("CREATE TABLE notes (body TEXT)")
            db.execute("PRAGMA user_version = 7")
        with pytest.raises(ConfigError, match=r"not a ledger \(it has notes\)"):
            SqliteStore(path)

    def test_a_ledger_written_before_versions_were_kept_opens(self, tmp_path: Path) -> None:
        path = _ledger(tmp_path / "ledger.db", compositions=3)
        _stamp(path, 0, 0)
        store = SqliteStore(path)
        try:
            assert len(store.load().compositions) == 3
        finally:
            store.close()

    def test_disagg_ls_exits_2(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path))
        monkeypatch.delenv("DISAGG_CONFIG", raising=False)
        monkeypatch.delenv("DISAGG_SERVER", raising=False)
        monkeypatch.chdir(tmp_path)
        _stamp(_ledger(tmp_path / "ledger.db", compositions=1), APPLICATION_ID, SCHEMA_VERSION + 1)
        capsys.readouterr()
        assert main(["ls"]) == 2
        assert "upgrade disagg" in capsys.readouterr().err


class TestARecordWithAFieldThisVersionDoesNotKnow:
    """A record holding a field this disagg does not know (a newer one wrote it) is refused by name, not loaded
    without it, which lost the field at the record's next write."""

    @pytest.mark.parametrize(
        ("old", "new", "field"),
        [
            ('"host":"h1"', '"host":"h1","placement_group":"pg-7"', "placement_group"),
            ('"op":"=",', '"op":"=","weight":2,', "weight"),
        ],
        ids=["at-the-top", "in-a-selector"],
    )
    def test_refused_by_name(self, tmp_path: Path, old: str, new: str, field: str) -> None:
        path = _ledger(tmp_path / "ledger.db", compositions=1)
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            ((doc,),) = db.execute("SELECT doc FROM compositions")
            assert old in doc, doc
            db.execute("UPDATE compositions SET doc = ?", (doc.replace(old, new),))
        before = path.read_bytes()
        store = SqliteStore(path)
        try:
            with pytest.raises(ConfigError) as info:
                store.load()
        finally:
            store.close()
        assert f"compositions record 'c0' has fields this disagg does not know ({field})" in info.value.message
        assert "upgrade disagg" in info.value.message
        assert info.value.field == "state.path"
        with contextlib.closing(sqlite3.connect(path)) as db:
            ((doc,),) = db.execute("SELECT doc FROM compositions")
        assert field in doc
        assert path.read_bytes() == before


DAMAGED_AT_COMMIT = """
import sqlite3, sys
from pathlib import Path
from disagg.store.sqlite import SqliteStore

commit = SqliteStore._commit
marker = Path(sys.argv.pop(1))

def commit_on_a_damaged_page(self, batch):
    if marker.exists():
        error = sqlite3.DatabaseError("database disk image is malformed")
        error.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
        raise error
    commit(self, batch)

SqliteStore._commit = commit_on_a_damaged_page
from disagg.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
"""``disagg serve`` whose commits meet a damaged page (SQLITE_CORRUPT) once the file named first exists."""


class TestALedgerToMendWhileServing:
    """A ledger the operator must mend before a restart stops `disagg serve` with 2, saying what to do: it exited 1,
    the code of a disk that a restart may get past, and its supervisor restarted it into the refusal at start-up
    (damage), or onto an empty ledger missing every composition (a ledger removed)."""

    @pytest.mark.parametrize(
        ("fault", "said"),
        [("damaged", "is damaged"), ("removed", "was removed or replaced")],
    )
    def test_disagg_serve_exits_2_saying_what_to_mend(self, tmp_path: Path, fault: str, said: str) -> None:
        sock, marker = tmp_path / "fm.sock", tmp_path / "damaged"
        config = tmp_path / "disagg.toml"
        config.write_text(
            f'[state]\nledger = "sqlite"\npath = "{tmp_path / "ledger.db"}"\n\n'
            '[[fabric]]\nname = "pcie0"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n\n'
            f'[[listener]]\naddress = "unix:{sock}"\n'
        )
        child = serve_child(tmp_path, config, script=DAMAGED_AT_COMMIT, script_args=(str(marker),))
        try:
            assert child.stdout is not None
            assert child.stdout.readline().startswith("serving on")
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                stub = fm_grpc.FabricManagerServiceStub(channel)
                stub.Compose(compose_request("before"), timeout=WAIT_S)
                if fault == "damaged":
                    marker.touch()
                else:
                    for suffix in ("", "-wal", "-shm"):
                        Path(f"{tmp_path / 'ledger.db'}{suffix}").unlink()
                with pytest.raises(grpc.RpcError) as info:
                    stub.Compose(compose_request("after"), timeout=WAIT_S)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            code = child.wait(WAIT_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(WAIT_S)
        assert child.stderr is not None
        errors = child.stderr.read()
        assert code == 2, errors
        assert said in errors, errors
        assert "once the ledger can be written" not in errors
