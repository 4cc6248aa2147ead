"""A group of ledger writes, folded into as few SQL statements as possible before the committer runs them.

Why: the committer gives up the GIL for every statement it runs (SQLite works without it) and must take it back
afterwards, which on a busy server means waiting for the event loop to yield, up to the interpreter's switch
interval (5 ms). One statement per write made a commit of 30 writes cost tens of milliseconds, and the commits,
not the loop, bounded Compose. Folded, a commit runs a statement or two per table whatever the group's size.

A group of row writes alone (the usual one) goes further, into one statement (`WriteView`): SQLite then runs the
transaction, its commit and the commit's fsync in one call, and the committer takes the GIL back once per group
instead of once per statement (four for a Compose's group), each time waiting for the event loop to let go of it.

Folding keeps the meaning of the writes in order: a put replaces a whole row and a delete removes it, so only
the last write of each row counts, at the place of that write (a table may be read in the order its rows were
written, by ``rowid``, as the request answers are). Prunes (statements that trim a table) run after the rows are
written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final

import attrs

Statement = tuple[str, tuple[Any, ...]]

MAX_PARAMETERS: Final = 999
"""SQLite's limit of bound parameters per statement before 3.32, the lowest a linked SQLite may have."""

ROWS_PER_STATEMENT = 200
"""At most this many rows per INSERT or DELETE, so that a statement stays under `MAX_PARAMETERS` for the widest
table (4 columns)."""


@attrs.frozen(eq=False)
class Table:
    """A ledger table whose rows are written whole: the key is the first column. Each table is one constant, so it
    compares and hashes by identity, in C: a batch keys every write by its table and row."""

    name: str
    key: str
    columns: int
    insert: str = "INSERT OR REPLACE"
    """``INSERT`` for an append-only table, where a second row with the same key is an error."""

    def put_sql(self, rows: int) -> str:
        row = "(" + ", ".join("?" * self.columns) + ")"
        return f"{self.insert} INTO {self.name} VALUES " + ", ".join([row] * rows)

    def delete_sql(self, keys: int) -> str:
        return f"DELETE FROM {self.name} WHERE {self.key} IN (" + ", ".join("?" * keys) + ")"


class Batch:
    """Writes queued since the last commit: the last put or delete of each row, and the prunes."""

    def __init__(self) -> None:
        self._rows: dict[tuple[Table, object], tuple[Any, ...] | None] = {}
        self._prunes: list[Statement] = []

    def __bool__(self) -> bool:
        return bool(self._rows or self._prunes)

    def put(self, table: Table, row: tuple[Any, ...]) -> None:
        if len(row) != table.columns:
            raise ValueError(f"a row of {table.name} has {table.columns} columns, not {len(row)}")
        key = (table, row[0])
        self._rows.pop(key, None)  # written after the rows queued since, as it was: the rowid orders requests
        self._rows[key] = row

    def delete(self, table: Table, key: object) -> None:
        self._rows[(table, key)] = None

    def prune(self, statement: Statement) -> None:
        self._prunes.append(statement)

    def __len__(self) -> int:
        """The rows this batch writes (a put or a delete each), prunes not counted."""
        return len(self._rows)

    @property
    def prunes(self) -> bool:
        return bool(self._prunes)

    def rows(self) -> Iterator[tuple[Table, object, tuple[Any, ...] | None]]:
        """Each row's last write, in the order of those writes: (table, key, the row put or None for a delete)."""
        for (table, key), row in self._rows.items():
            yield table, key, row

    def keys(self, table: Table) -> set[object]:
        """The keys of ``table`` that this batch writes."""
        return {key for (t, key) in self._rows if t == table}

    def statements(self) -> Iterator[Statement]:
        """The SQL that applies the batch: per table, its deletes then its puts, then the prunes."""
        tables: dict[Table, tuple[list[object], list[tuple[Any, ...]]]] = {}
        for (table, key), row in self._rows.items():
            deletes, puts = tables.setdefault(table, ([], []))
            if row is None:
                deletes.append(key)
            else:
                puts.append(row)
        for table, (deletes, puts) in tables.items():
            for keys in _chunks(deletes):
                yield table.delete_sql(len(keys)), tuple(keys)
            for rows in _chunks(puts):
                yield table.put_sql(len(rows)), tuple(value for row in rows for value in row)
        yield from self._prunes


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), ROWS_PER_STATEMENT):
        yield items[start : start + ROWS_PER_STATEMENT]


class WriteView:
    """Every row write of a batch as one INSERT into a temporary view, whose INSTEAD OF triggers apply each row to
    its table: a put as the table's own insert, a delete by key. SQLite runs the rows in the statement's order, and
    as one statement in autocommit mode, all of them or none: a row that fails (a second event with a revision
    already written) undoes the rest. A view row is an operation code (the table's place in ``tables``, doubled;
    plus one for a delete), the key and the other columns, NULL past a narrower table's width; padding rows (a
    NULL code) match no trigger, so that a few statement sizes serve every group and stay in the connection's
    statement cache."""

    NAME: Final = "ledger_writes"

    def __init__(self, tables: Sequence[Table]) -> None:
        self._tables = tuple(tables)
        self._codes = {table: 2 * n for n, table in enumerate(self._tables)}
        self._width = max(table.columns for table in self._tables)
        self.max_rows = MAX_PARAMETERS // (self._width + 1)
        """The most rows one statement carries; a larger batch is written by `Batch.statements`."""
        self._sql: dict[int, str] = {}

    def script(self) -> str:
        """The view and its triggers, in the connection's temporary schema (never in the ledger's file)."""
        columns = ", ".join(["op", "k"] + [f"v{n}" for n in range(1, self._width)])
        nulls = ", ".join(["NULL"] * (self._width + 1))
        lines = [f"CREATE TEMP VIEW IF NOT EXISTS {self.NAME} ({columns}) AS SELECT {nulls} WHERE 0;"]
        for table, code in self._codes.items():
            values = ", ".join(["NEW.k"] + [f"NEW.v{n}" for n in range(1, table.columns)])
            lines.append(
                f"CREATE TEMP TRIGGER IF NOT EXISTS {self.NAME}_put_{table.name} INSTEAD OF INSERT ON {self.NAME} "
                f"WHEN NEW.op = {code} BEGIN {table.insert} INTO {table.name} VALUES ({values}); END;"
            )
            lines.append(
                f"CREATE TEMP TRIGGER IF NOT EXISTS {self.NAME}_delete_{table.name} INSTEAD OF INSERT ON {self.NAME} "
                f"WHEN NEW.op = {code + 1} BEGIN DELETE FROM {table.name} WHERE {table.key} = NEW.k; END;"
            )
        return "\n".join(lines)

    def statement(self, batch: Batch) -> Statement | None:
        """``batch`` as one statement, or None when it holds prunes or more rows than one statement carries."""
        rows = len(batch)
        if batch.prunes or not 0 < rows <= self.max_rows:
            return None
        size = min(1 << (rows - 1).bit_length(), self.max_rows)
        params: list[Any] = []
        width = self._width
        for table, key, row in batch.rows():
            if row is None:
                params.append(self._codes[table] + 1)
                params.append(key)
                params.extend((None,) * (width - 1))
            else:
                params.append(self._codes[table])
                params.extend(row)
                params.extend((None,) * (width - len(row)))
        params.extend((None,) * ((size - rows) * (width + 1)))
        return self._sized(size), tuple(params)

    def _sized(self, size: int) -> str:
        sql = self._sql.get(size)
        if sql is None:
            row = "(" + ", ".join("?" * (self._width + 1)) + ")"
            sql = self._sql[size] = f"INSERT INTO {self.NAME} VALUES " + ", ".join([row] * size)
        return sql
