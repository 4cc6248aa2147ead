"""The composer's lock, whose every outermost hold is one ledger transaction.

A change of the composer writes under its lock: a composition's record and the event that tells of it, a
reservation given up with the composition it became. Written one by one, a crash, a failed write or a lead lost
between two of them (etcd's are one transaction each, SQLite's committer takes whatever is queued) leaves the
ledger with the record and not its event, and a watcher that resumes from a revision never learns of the change:
a composition stays DECOMPOSING in its view for ever. Held by this lock, the writes of one hold are one
transaction (`Store.atomic`), and the events of the hold are told to the composer's listeners only once the ledger
took them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from types import TracebackType

from disagg.store import Store


class LedgerLock:
    """A re-entrant lock over ``store``: the writes of each outermost hold are one `Store.atomic` block. As that
    ends, ``settled(taken)`` is called, still holding the lock: whether the ledger took the hold's writes."""

    __slots__ = ("_atomic", "_lock", "_owner", "_settled", "_store", "depth")

    def __init__(self, store: Store, settled: Callable[[bool], None]) -> None:
        self._lock = threading.RLock()
        self._store = store
        self._settled = settled
        self.depth = 0
        """How many holds the thread that holds the lock has made; 0 while nobody holds it. Written only by the
        thread that holds the lock: read by code that holds it or would (the composer changes nothing without it),
        it tells whether that code runs inside a hold."""
        self._atomic: contextlib.AbstractContextManager[None] | None = None
        self._owner: int | None = None
        """The thread that holds the lock (`held_here`), None while nobody does."""

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock: its writes so far are queued only as its outermost hold
        ends, so a wait for them to be durable (`Store.sync`) belongs after that, never inside it."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> None:
        self._lock.acquire()
        self.depth += 1
        if self.depth == 1:
            self._owner = threading.get_ident()
            try:
                atomic = self._store.atomic()
                atomic.__enter__()
            except BaseException:
                self.depth -= 1
                self._owner = None
                self._lock.release()
                raise
            self._atomic = atomic

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        try:
            if self.depth == 1:
                atomic, self._atomic = self._atomic, None
                assert atomic is not None
                try:
                    atomic.__exit__(kind, error, trace)
                except BaseException:
                    self._settled(False)
                    raise
                self._settled(True)
        finally:
            self.depth -= 1
            if not self.depth:
                self._owner = None
            self._lock.release()
