"""A group of ledger writes, folded into as few SQL statements as possible before the committer runs them.

Why: the committer gives up the GIL for every statement it runs (SQLite works without it) and must take it back
afterwards, which on a busy server means waiting for the event loop to yield, up to the interpreter's switch
interval (5 ms). One statement per write made a commit of 30 writes cost tens of milliseconds, and the commits,
not the loop, bounded Compose. Folded, a commit runs a statement or two per table whatever the group's size.

Folding keeps the meaning of the writes in order: a put replaces a whole row and a delete removes it, so only
the last write of each row counts, at the place of that write (a table may be read in the order its rows were
written, by ``rowid``, as the request answers are). Prunes (statements that trim a table) run after the rows are
written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs

Statement = tuple[str, tuple[Any, ...]]

ROWS_PER_STATEMENT = 200
"""At most this many rows per INSERT or DELETE, so that a statement stays under SQLite's limit of bound
parameters (999 before 3.32) for the widest table (4 columns)."""


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
