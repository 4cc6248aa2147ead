"""A group of ledger writes folds into a few statements with the meaning of the writes in their order: the last
write of each row wins, a put replaces the whole row, prunes run after the rows are written."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from composer_helpers import compositions_on_disk
from disagg.model import Composition, CompositionState
from disagg.store import SqliteStore
from disagg.store.batch import ROWS_PER_STATEMENT, Batch, Table, WriteView

DOCS = Table("docs", "id", 2)
LOG = Table("log", "n", 2, insert="INSERT")
MARKS = Table("marks", "id", 3)
VIEW = WriteView((DOCS, LOG, MARKS))


def _connect() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.execute("CREATE TABLE docs (id TEXT PRIMARY KEY, doc TEXT NOT NULL)")
    conn.execute("CREATE TABLE log (n INTEGER PRIMARY KEY, doc TEXT NOT NULL)")
    conn.execute("CREATE TABLE marks (id TEXT PRIMARY KEY, a TEXT, b REAL NOT NULL)")
    conn.executescript(VIEW.script())
    return conn


@pytest.fixture
def db() -> Iterator[sqlite3.Connection]:
    conn = _connect()
    yield conn
    conn.close()


def _apply(db: sqlite3.Connection, batch: Batch) -> None:
    db.execute("BEGIN IMMEDIATE")
    for sql, params in batch.statements():
        db.execute(sql, params)
    db.execute("COMMIT")


def _write(db: sqlite3.Connection, batch: Batch) -> None:
    statement = VIEW.statement(batch)
    assert statement is not None
    db.execute(*statement)


def _tables(db: sqlite3.Connection) -> list[list[tuple[object, ...]]]:
    """Every table's rows in the order they were written (rowid)."""
    return [db.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in ("docs", "log", "marks")]


def _docs(db: sqlite3.Connection) -> dict[str, str]:
    return dict(db.execute("SELECT id, doc FROM docs").fetchall())


class TestFolding:
    def test_the_last_write_of_a_row_wins(self, db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO docs VALUES ('kept', 'old'), ('gone', 'old'), ('back', 'old')")
        batch = Batch()
        batch.put(DOCS, ("kept", "v1"))
        batch.put(DOCS, ("kept", "v2"))
        batch.delete(DOCS, "gone")
        batch.delete(DOCS, "back")
        batch.put(DOCS, ("back", "again"))
        batch.put(DOCS, ("new", "v1"))
        batch.delete(DOCS, "new")
        _apply(db, batch)
        assert _docs(db) == {"kept": "v2", "back": "again"}

    def test_a_group_is_a_statement_or_two_per_table_whatever_its_size(self) -> None:
        batch = Batch()
        for n in range(50):
            batch.put(DOCS, (f"d{n}", "x"))
            batch.put(LOG, (n, "e"))
        batch.delete(DOCS, "d0")
        assert len(list(batch.statements())) == 3

    def test_rows_beyond_one_statement_are_split(self, db: sqlite3.Connection) -> None:
        batch = Batch()
        rows = ROWS_PER_STATEMENT * 2 + 7
        for n in range(rows):
            batch.put(LOG, (n, f"e{n}"))
        statements = list(batch.statements())
        assert len(statements) == 3
        assert max(len(params) for _, params in statements) == ROWS_PER_STATEMENT * LOG.columns
        _apply(db, batch)
        assert db.execute("SELECT COUNT(*), MIN(n), MAX(n) FROM log").fetchone() == (rows, 0, rows - 1)

    def test_prunes_run_after_the_rows(self, db: sqlite3.Connection) -> None:
        batch = Batch()
        batch.prune(("DELETE FROM log WHERE n <= ?", (1,)))
        for n in range(4):
            batch.put(LOG, (n, "e"))
        _apply(db, batch)
        assert [n for (n,) in db.execute("SELECT n FROM log ORDER BY n")] == [2, 3]

    def test_an_append_only_table_refuses_a_second_row_with_its_key(self, db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO log VALUES (1, 'first')")
        batch = Batch()
        batch.put(LOG, (1, "again"))
        with pytest.raises(sqlite3.IntegrityError):
            _apply(db, batch)
        db.execute("ROLLBACK")
        assert db.execute("SELECT doc FROM log").fetchall() == [("first",)]

    def test_a_row_of_the_wrong_width_is_refused_when_queued(self) -> None:
        with pytest.raises(ValueError, match="2 columns, not 3"):
            Batch().put(DOCS, ("a", "b", "c"))

    def test_an_empty_batch_is_false_and_writes_nothing(self) -> None:
        batch = Batch()
        assert not batch
        assert list(batch.statements()) == []
        batch.prune(("DELETE FROM log", ()))
        assert batch


def _mixed() -> Batch:
    batch = Batch()
    batch.put(DOCS, ("kept", "v1"))
    batch.put(MARKS, ("m1", "x", 1.5))
    batch.put(LOG, (7, "e7"))
    batch.delete(DOCS, "gone")
    batch.put(DOCS, ("new", "v1"))
    batch.put(DOCS, ("kept", "v2"))  # written after "new" now: its rowid follows
    batch.put(MARKS, ("m2", None, 2.0))
    batch.delete(MARKS, "old")
    batch.put(LOG, (8, "e8"))
    return batch


class TestOneStatement:
    """A batch of row writes as one INSERT into a temporary view whose triggers write each row to its table."""

    def _seeded(self, db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO docs VALUES ('gone', 'old'), ('kept', 'old')")
        db.execute("INSERT INTO marks VALUES ('old', 'o', 0.5)")

    def test_it_writes_what_the_statements_per_table_write_in_the_same_order(self, db: sqlite3.Connection) -> None:
        other = _connect()
        try:
            for conn in (db, other):
                self._seeded(conn)
            _write(db, _mixed())
            _apply(other, _mixed())
            assert _tables(db) == _tables(other)
            assert _tables(db) == [
                [("new", "v1"), ("kept", "v2")],
                [(7, "e7"), (8, "e8")],
                [("m1", "x", 1.5), ("m2", None, 2.0)],
            ]
        finally:
            other.close()

    def test_a_row_that_fails_leaves_none_of_the_batch(self, db: sqlite3.Connection) -> None:
        self._seeded(db)
        db.execute("INSERT INTO log VALUES (8, 'first')")
        before = _tables(db)
        with pytest.raises(sqlite3.IntegrityError):
            _write(db, _mixed())  # its second event has revision 8, written already
        assert not db.in_transaction
        assert _tables(db) == before

    def test_a_batch_with_prunes_or_beyond_one_statement_or_empty_has_none(self) -> None:
        assert VIEW.statement(Batch()) is None
        pruned = _mixed()
        pruned.prune(("DELETE FROM log WHERE n <= ?", (1,)))
        assert VIEW.statement(pruned) is None
        large = Batch()
        for n in range(VIEW.max_rows + 1):
            large.put(LOG, (n, "e"))
        assert VIEW.statement(large) is None
        large = Batch()
        for n in range(VIEW.max_rows):
            large.put(LOG, (n, "e"))
        statement = VIEW.statement(large)
        assert statement is not None
        assert len(statement[1]) <= 999

    def test_a_few_statement_sizes_serve_every_batch(self, db: sqlite3.Connection) -> None:
        sizes = set()
        for rows in range(1, VIEW.max_rows + 1):
            batch = Batch()
            for n in range(rows):
                batch.put(DOCS, (f"d{n}", "x"))
            statement = VIEW.statement(batch)
            assert statement is not None
            sizes.add(statement[0])
        assert len(sizes) <= 10  # within the connection's statement cache (128)
        _write(db, batch)  # the largest, padded to its size: the padding writes nothing
        assert db.execute("SELECT COUNT(*) FROM docs").fetchone() == (VIEW.max_rows,)
        assert db.execute("SELECT COUNT(*) FROM log").fetchone() == (0,)


def _composition(cid: str, state: CompositionState = CompositionState.COMPOSED) -> Composition:
    return Composition(id=cid, name=cid, host="h0", state=state, resources=(), devices=())


class TestInTheLedger:
    def test_a_composition_written_and_removed_in_one_group_is_gone(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "ledger.db")
        try:
            with store._db_lock:
                store.put_cordon("first")
                time.sleep(0.05)  # the committer takes the cordon and waits for the lock: the rest is one group
                store.put_composition(_composition("c1", CompositionState.COMPOSING))
                store.put_composition(_composition("c1"))
                store.put_composition(_composition("c2", CompositionState.COMPOSING))
                store.delete_composition("c2")
                store.put_composition(_composition("c3"))
                store.delete_composition("c3")
                store.put_composition(_composition("c3", CompositionState.DEGRADED))
            store.sync()
        finally:
            store.close()
        states = {c.id: c.state for c in compositions_on_disk(tmp_path / "ledger.db")}
        assert states == {"c1": CompositionState.COMPOSED, "c3": CompositionState.DEGRADED}

    def test_the_view_is_not_in_the_ledgers_file(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "ledger.db")
        try:
            store.put_composition(_composition("c1"))
            store.sync()
        finally:
            store.close()
        conn = sqlite3.connect(tmp_path / "ledger.db")
        try:
            names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        finally:
            conn.close()
        assert WriteView.NAME not in names
        assert not any(name.startswith(WriteView.NAME) for name in names)
        assert [c.id for c in compositions_on_disk(tmp_path / "ledger.db")] == ["c1"]
