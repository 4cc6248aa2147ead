"""The embedded default ledger: SQLite in WAL mode with synchronous=FULL, writes under BEGIN IMMEDIATE.

Commits are grouped. A write is queued and returns at once; one committer thread applies everything queued
in one transaction, so that concurrent requests share one fsync instead of paying one each, and folds the
group into one statement, or a statement or two per table (`disagg.store.batch` says why and when). A group
of one statement is a transaction of its own, which takes the write lock as it starts, as BEGIN IMMEDIATE
does. The writes of an `atomic` block are queued as one, as it ends, so that no commit takes part of them.
`sync` waits until the caller's own writes are on disk (and so everything queued before them): the
composer calls it before a driver call that the ledger must already know of (write-ahead), and before it
answers; `synced` (a coroutine) and `when_synced` (a callback) do the same on an event loop without blocking
it. Each waiter is woken once, by the commit that holds its last write. Reads see the queued writes as well:
`load` waits for everything queued, and `events_after` adds the queued events to what the database holds.

Records are stored as JSON documents of the model values, so the schema follows the model without migrations
of every field. The file says which layout it holds (`SCHEMA_VERSION`), so that a newer layout is refused with
the upgrade it needs rather than read wrong or called damaged.

Opening reads before it writes: a file that is another program's, a newer disagg's, or damaged is refused as it
was found. While open, the committer checks that the ledger's file and its lock file are still the ones it opened
(`_check_in_place`): a ledger removed or replaced under a running server took every later change with it, and a
second server could lock the new lock file and start beside the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import functools
import heapq
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from disagg import codec
from disagg.errors import ConfigError, DisaggError, FabricUnavailableError
from disagg.model import Composition, Event, Reservation
from disagg.statedir import make_directories
from disagg.store import ownership
from disagg.store.base import (
    REQUEST_RETENTION,
    UNDECODABLE,
    LedgerState,
    RequestRecord,
    Store,
    check_event_retention,
    decoded,
    quarantine_key,
    quarantine_of,
    undecodable,
)
from disagg.store.batch import Batch, Table, WriteView

SCHEMA = """
CREATE TABLE IF NOT EXISTS compositions (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reservations (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (revision INTEGER PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, answer TEXT NOT NULL, at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_at ON requests (at);
CREATE TABLE IF NOT EXISTS cordons (device TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS quarantines (allocation TEXT PRIMARY KEY);
"""

LEDGER_COLUMNS: dict[str, tuple[str, ...]] = {
    "compositions": ("id", "doc"),
    "reservations": ("id", "doc"),
    "events": ("revision", "doc"),
    "requests": ("id", "fingerprint", "answer", "at"),
    "cordons": ("device",),
    "quarantines": ("allocation",),
}
"""The columns of each table of `SCHEMA`: a table of one of these names with other columns is not the ledger's."""
LEDGER_TABLES = frozenset(LEDGER_COLUMNS)
SCHEMA_VERSION = 1
"""The ledger's layout (`SCHEMA`, and the fields of its records), kept in the file's ``user_version``: raise it
with a change that an older disagg would read wrong, so that the older one refuses the file rather than reads it
(or drops what it does not know at its next write). A ledger written before versions were kept has 0, and the
layout of 1."""
APPLICATION_ID = int.from_bytes(b"DSAG", "big")
"""The file's ``application_id``, which marks it as a ledger: a ``user_version`` is only a ledger's schema in a
file that carries it (another program's database keeps its own number there)."""
DAMAGE_SHOWN = 3
"""Problems `PRAGMA quick_check` names in the refusal of a damaged ledger: the first say enough to tell it is."""
_TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"


def _not_a_ledger(db: sqlite3.Connection) -> str:
    """Why the database ``db`` holds is not a ledger, read without writing anything; empty when it is one (or
    is empty). Called before the first write, so that another program's file is left as it was."""
    tables = [n for (n,) in db.execute(_TABLES)]
    foreign = sorted(n for n in tables if n not in LEDGER_TABLES)
    if foreign:
        return f"it has {', '.join(foreign)}"
    for name in sorted(tables):
        columns = tuple(row[1] for row in db.execute(f"PRAGMA table_info({name})"))
        if columns != LEDGER_COLUMNS[name]:
            return f"its table {name} has {', '.join(columns)}, not {', '.join(LEDGER_COLUMNS[name])}"
    return ""


def _marks(db: sqlite3.Connection) -> tuple[int, int]:
    """The file's ``application_id`` and ``user_version``, read without writing anything."""
    ((application,),) = db.execute("PRAGMA application_id")
    ((version,),) = db.execute("PRAGMA user_version")
    return int(application), int(version)


def _newer_schema(db: sqlite3.Connection) -> int:
    """The schema version of a ledger a newer disagg wrote (its layout is past `SCHEMA_VERSION`), else 0."""
    application, version = _marks(db)
    return version if application == APPLICATION_ID and version > SCHEMA_VERSION else 0


def _damage(db: sqlite3.Connection) -> str:
    """What `PRAGMA quick_check` finds wrong in the database's pages, or empty. A damaged page passed the open
    (which reads only the schema) and the load (which reads a table's rows, not its index), and failed the first
    commit that touched it, which a restart met again: checked here, before anything is written, it is refused
    once, as damage. It reads every page once (50 ms for a ledger of 100,000 compositions, 85 MB, in the page
    cache), less than the load that follows, and skips only the check of indexes against their tables."""
    found = [str(problem) for (problem,) in db.execute(f"PRAGMA quick_check({DAMAGE_SHOWN})")]
    if found == ["ok"]:
        return ""
    lines = (line for problem in found for line in problem.splitlines())
    return "; ".join(line for line in lines if not line.startswith("***"))  # not "*** in database main ***"


def _is_damage(exc: BaseException) -> bool:
    """``exc`` says the database's pages are damaged (SQLITE_CORRUPT, SQLITE_NOTADB): the operator's to restore,
    where a full or failing disk (an OperationalError) is the machine's, which a restart may get past."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    return isinstance(exc, sqlite3.DatabaseError) and code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _refuse_as_found(db: sqlite3.Connection, path: Path) -> None:
    """Raise `ConfigError` for a database at ``path`` that this disagg must not write: a newer disagg's ledger,
    another program's database, a damaged ledger. Reads only, so that each is left as it was found."""
    newer = _newer_schema(db)
    if newer:
        raise ConfigError(
            f"the ledger at {path} was written by a newer disagg (schema {newer}); upgrade disagg (this one reads "
            f"schema {SCHEMA_VERSION} and older)",
            field="state.path",
        )
    why = _not_a_ledger(db)
    if why:
        raise ConfigError(
            f"{path} is a SQLite database but not a ledger ({why}): give [state] path a ledger's "
            "file, or restore the ledger from a backup",
            field="state.path",
        )
    damage = _damage(db)
    if damage:
        raise ConfigError(
            f"the ledger at {path} cannot be read (it is damaged: {damage}): restore it from a backup "
            "(docs/durability.md)",
            field="state.path",
        )


def _stamp(db: sqlite3.Connection) -> None:
    """Mark a new ledger, or one written before versions were kept (the same layout), with `APPLICATION_ID` and
    `SCHEMA_VERSION`; a ledger marked already is not written."""
    if _marks(db) != (APPLICATION_ID, SCHEMA_VERSION):
        db.executescript(f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {SCHEMA_VERSION};")


def _identity(path: str | Path) -> tuple[int, int]:
    """The device and inode of the file at ``path``: which file it is, whatever its name."""
    found = os.stat(path)
    return (found.st_dev, found.st_ino)


def _wal_identity(wal: str) -> tuple[int, int] | None:
    """`_identity` of the ledger's write-ahead log, which SQLite keeps (and never replaces) while a connection is
    open in WAL mode; None where there is none (a file system on which SQLite refused WAL, or one removed)."""
    try:
        return _identity(wal)
    except (FileNotFoundError, NotADirectoryError):
        return None


class LedgerMovedError(Exception):
    """The ledger's file, its write-ahead log or its lock file at its path is not the one this store opened: it
    was removed (or its directory was) or replaced. Commits would go to a file nobody opens again, and another
    process could lock the new lock file and open the ledger beside this one."""


def _open_error(path: Path, exc: BaseException) -> DisaggError:
    """Why the ledger at ``path`` cannot be opened: a disk that is full or failing is the machine's trouble (the
    server exits 1, for its supervisor to try again), a file that is not a ledger or is damaged the operator's
    to restore, anything else a setting to correct."""
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)) or (
        isinstance(exc, sqlite3.OperationalError) and ("disk I/O error" in text or "disk is full" in text)
    ):
        return FabricUnavailableError(f"cannot open the ledger at {path}: {exc}; is its disk full or failing?")
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return ConfigError(
            f"cannot open the ledger at {path} ({exc}): restore it from a backup (docs/durability.md)",
            field="state.path",
        )
    return ConfigError(f"cannot open the ledger at {path}: {exc}", field="state.path")


MEMORY = ":memory:"
MEMORY_REFUSED = (
    "the ledger's path ':memory:' would keep the ledger in memory, lost when the process ends, while a SQLite "
    'ledger is there to last: set [state] ledger = "memory" for a ledger that does not'
)
"""SQLite's name for a database in memory, and why it is no ledger's path."""


def _make_private(path: Path) -> None:
    """Create the ledger's file for its owner alone if it is missing: SQLite would make it with the umask's mode
    (0o666 under umask 000), and its WAL and shared-memory files take the mode of the database's (SQLite sets
    it on those a crash left, too). One that exists is closed to other users (`_close_to_others`)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        _close_to_others(path)


def _close_to_others(file: Path) -> None:
    """Take other users' access to ``file`` away, if it has any (an older disagg, a copy or a restore left it
    0o644), and say so; its group keeps what its owner gave it, as a ledger shared with a group is so on
    purpose. A file this user does not own is left as it is, with a warning."""
    try:
        found = stat.S_IMODE(file.stat().st_mode)
    except FileNotFoundError:
        return
    if not found & 0o007:
        return
    try:
        os.chmod(file, found & ~0o007)
    except PermissionError:
        log.warning("the ledger's file %s is open to other users (%04o), and not this user's to close", file, found)
        return
    log.warning("the ledger's file %s was open to other users (%04o): now %04o", file, found, found & ~0o007)


EVENT_RETENTION = 100_000
"""Events kept; a watch from an older revision is told the log was compacted (OUT_OF_RANGE)."""
PRUNE_EVERY = 1_000
"""Events past the retention between two prunes of the event log: pruning in steps keeps appending cheap. The
step is counted from the revisions on disk, not from this process's appends, so that a server that restarts
often still prunes."""

COMMITTER_NICE_ENV = "DISAGG_COMMITTER_NICE"
COMMITTER_NICE = 10
"""How many steps of niceness below its process the committer thread runs (Linux schedules each thread on its
own), unless ``$DISAGG_COMMITTER_NICE`` says otherwise (0 to 19; 0 runs it level with the rest). When it and the
threads that serve calls (the event loop, gRPC's poller) want a core at the same moment, they go first: a commit
waits a little longer, and the calls that fill the next commit are not held up behind it (docs/benchmarks.md has
the measurements). It still takes every idle core, and at 10 steps about a tenth of a contended one, so a busy
machine slows its commits rather than stopping them."""


def committer_nice(env: Mapping[str, str] | None = None) -> int:
    """The committer's niceness below its process, as ``$DISAGG_COMMITTER_NICE`` sets it; `ConfigError` for a value
    that is not a whole number from 0 to 19."""
    text = (os.environ if env is None else env).get(COMMITTER_NICE_ENV, "").strip()
    if not text:
        return COMMITTER_NICE
    if not (text.isascii() and text.isdigit()) or int(text) > 19:
        raise ConfigError(
            f"${COMMITTER_NICE_ENV} is {text!r}: it is how many steps of niceness (0 to 19) the ledger's committer "
            "runs below its process",
            field=COMMITTER_NICE_ENV,
        )
    return int(text)


IN_PLACE_CHECK_S = 1.0
"""How often an idle committer checks that the ledger was not removed or replaced (`_check_in_place`)."""

log = logging.getLogger("disagg.store")

COMPOSITIONS = Table("compositions", "id", 2)
RESERVATIONS = Table("reservations", "id", 2)
EVENTS = Table("events", "revision", 2, insert="INSERT")
REQUESTS = Table("requests", "id", 4)
CORDONS = Table("cordons", "device", 1)
QUARANTINES = Table("quarantines", "allocation", 1)
"""A quarantined allocation is one column, its pool and id as a JSON array (`quarantine_key`)."""
WRITES = WriteView((COMPOSITIONS, RESERVATIONS, EVENTS, REQUESTS, CORDONS, QUARANTINES))
"""The ledger's row writes as one statement (`disagg.store.batch`), created in each connection's temporary schema."""


Synced = Callable[[Exception | None], None]
Waiter: TypeAlias = "threading.Lock | tuple[asyncio.AbstractEventLoop, Synced]"
"""A thread's lock, released by the commit it waits for, or a loop and the callback it calls there."""


def _run_below(steps: int) -> None:
    """Lower this thread's priority by ``steps`` of niceness (to 19 at most), where the system schedules threads one
    by one (Linux); elsewhere, or where it is refused, leave it as it is."""
    if not steps:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except (AttributeError, OSError):
        return


def _call_back(callbacks: list[Synced], failure: Exception | None) -> None:
    """On the loop: tell each waiter its writes are durable (or why they cannot be)."""
    for callback in callbacks:
        try:
            callback(failure)
        except Exception:
            log.exception("a ledger waiter failed")


def _call_loops(loops: dict[asyncio.AbstractEventLoop, list[Synced]], failure: Exception | None) -> None:
    """Tell each loop, with one call into it, that its waiters' writes are durable (or why they cannot be)."""
    for loop, callbacks in loops.items():
        with contextlib.suppress(RuntimeError):  # the loop was closed: nobody waits any more
            loop.call_soon_threadsafe(_call_back, callbacks, failure)


_Held: TypeAlias = "tuple[Callable[..., None], Table | None, Any, Event | None]"
"""A write held by `SqliteStore.atomic`: the arguments of `SqliteStore._enqueue`."""


class _Block:
    """A thread's `SqliteStore.atomic` blocks: the writes they hold (None outside one), and how deep they nest."""

    __slots__ = ("depth", "writes")

    def __init__(self) -> None:
        self.writes: list[_Held] | None = None
        self.depth = 0


class _Blocks(threading.local):
    """Each thread's `_Block`, made as the thread first uses it. Its one attribute is read once a use: reading or
    setting an attribute of a `threading.local` looks the thread's own dictionary up (about 500 instructions), and
    with the counters there a durable Compose's three blocks and five writes made 32 such accesses on the loop."""

    def __init__(self) -> None:
        self.block = _Block()


class _Atomic:
    """`SqliteStore.atomic`, one per store and used by every thread (its state is the thread's `_Block`): the
    outermost block holds the thread's writes, and queues them as it ends. The composer enters one at every hold
    of its lock, three per durable Compose, so it is made once rather than at each."""

    __slots__ = ("_blocks", "_store")

    def __init__(self, store: SqliteStore, blocks: _Blocks) -> None:
        self._store = store
        self._blocks = blocks

    def __enter__(self) -> None:
        block = self._blocks.block
        if not block.depth:
            block.writes = []
        block.depth += 1

    def __exit__(self, *exc_info: object) -> None:
        block = self._blocks.block
        block.depth -= 1
        if not block.depth:
            writes, block.writes = block.writes, None
            if writes:
                self._store._enqueue_group(writes)


class _LastQueuedKept:
    """Puts the caller's last queued write back as it was on entry, on exit: `SqliteStore.asynchronous_commit`. A
    class, not a generator under `contextlib.contextmanager`, which costs three times as much per use (a Python
    ``__init__``, two resumptions and a StopIteration): a durable Compose enters one on the event loop."""

    __slots__ = ("_before", "_last_queued")

    def __init__(self, last_queued: contextvars.ContextVar[int]) -> None:
        self._last_queued = last_queued

    def __enter__(self) -> None:
        self._before = self._last_queued.get()

    def __exit__(self, *exc_info: object) -> None:
        self._last_queued.set(self._before)


def _settle(future: asyncio.Future[None], failure: Exception | None) -> None:
    if future.done():
        return
    if failure is None:
        future.set_result(None)
    else:
        future.set_exception(failure)


class SqliteStore(Store):
    def __init__(self, path: str | Path, *, event_retention: int = EVENT_RETENTION) -> None:
        self.path = Path(path)
        self._retention = check_event_retention(event_retention)
        self._nice = committer_nice()
        """Steps of niceness the committer runs below the process (`COMMITTER_NICE`)."""
        if str(path) == MEMORY:
            raise ConfigError(MEMORY_REFUSED, field="state.path")
        if self.path.is_dir():  # SQLite says "unable to open database file", after a lock file was made beside it
            raise ConfigError(
                f"the ledger's path {self.path} is a directory: give the ledger's file, such as "
                f"{self.path / 'ledger.db'}",
                field="state.path",
            )
        if self.path.exists() and not self.path.is_file():  # SQLite says "disk I/O error": a failing disk
            raise ConfigError(
                f"the ledger's path {self.path} is not a regular file (a device, a pipe or a socket): give the "
                "ledger's file",
                field="state.path",
            )
        try:
            make_directories(self.path.parent)
            _make_private(Path(os.path.realpath(self.path)))  # the file a symlink names: its owner's alone too
        except OSError as exc:
            raise _open_error(self.path, exc) from exc
        try:
            self._owner = ownership.hold(self.path)
        except OSError as exc:
            raise _open_error(self.path, exc) from exc
        db: sqlite3.Connection | None = None
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            _refuse_as_found(db, self.path)
            # The file as opened, named as its lock is (symlinks resolved), not relative to a working directory
            # the process may change.
            self._real = Path(os.path.realpath(self.path))
            self._file = _identity(self._real)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
            _stamp(db)
            db.executescript(WRITES.script())
            (oldest, newest) = db.execute("SELECT MIN(revision), COALESCE(MAX(revision), 0) FROM events").fetchone()
            (requests,) = db.execute("SELECT COUNT(*) FROM requests").fetchone()
            self._wal_path = f"{self._real}-wal"
            """The write-ahead log's path, made once: a `Path` operation costs more than the `stat` (per commit)."""
            self._wal = _wal_identity(self._wal_path)
        except (OSError, sqlite3.Error, ConfigError) as exc:  # nothing of it stays open, and the ledger is let go
            if db is not None:
                db.close()
            ownership.let_go(self._owner)
            if isinstance(exc, ConfigError):
                raise
            raise _open_error(self.path, exc) from exc
        self._db = db
        self._newest_event = int(newest)
        self._oldest_event = self._newest_event + 1 if oldest is None else int(oldest)
        """The oldest revision the log may hold on disk: the next prune is due once `_prune_step` revisions from it
        are past the retention."""
        self._prune_step = min(PRUNE_EVERY, self._retention)
        """Revisions past the retention between two prunes of the log: `PRUNE_EVERY`, or the retention if smaller
        (taken once, not at each of the two appends of a durable Compose)."""
        self._request_rows = int(requests)
        """At least the rows of the requests table (a put that replaces a row counts as one more): its prune
        is due when they reach twice the retention."""
        self._db_lock = threading.Lock()
        self._lock = threading.Lock()
        """Guards the queue, the waiters, the counters and the prune bounds."""
        self._cond = threading.Condition(self._lock)
        """The committer, and only it, waits on it for work; it is notified only while it waits."""
        self._idle = False
        """The committer waits for work: the next write notifies it (writes while it commits need not)."""
        self._waiting: list[tuple[int, int, Waiter]] = []
        """A heap of `sync` callers by the sequence number they wait for: each is woken once, when that number
        is on disk. Waking every waiter on every commit cost more CPU than the rest of a Compose."""
        self._waiters = 0
        """Waiters ever queued: orders the heap's waiters for one sequence number."""
        self._batch = Batch()
        self._queued_events: list[Event] = []
        self._queued = 0
        """Sequence number of the last write queued."""
        self._last_queued: contextvars.ContextVar[int] = contextvars.ContextVar(f"disagg_ledger_{id(self)}", default=0)
        """The sequence number of the last write the thread or asyncio task queued in this ledger: what its `sync`
        waits for. Writes other callers queue later are theirs to wait for; waiting for them too would cost a
        request one more commit. One variable per ledger: a write to another ledger is no write to this one."""
        self._durable = 0
        """Sequence number of the last write on disk."""
        self._failure: BaseException | None = None
        self._closing = False
        self._db_closed = False
        """Under `_db_lock`: the connection is closed (`close`)."""
        self._blocks = _Blocks()
        self._atomic_block = _Atomic(self, self._blocks)
        self._committer = threading.Thread(target=self._commit_loop, name="disagg-ledger", daemon=True)
        self._committer.start()

    # ----------------------------------------------------------------- the committer

    def _enqueue(
        self, write: Callable[..., None], table: Table | None = None, value: Any = None, event: Event | None = None
    ) -> None:
        """Queue ``write(batch, table, value)``, a write of a table's row or key such as `Batch.put`, or without a
        table ``write(batch)``, a write of its own (applied to the batch the next commit takes) as this caller's
        latest write; with the ``event`` it appends, refuse a revision not above the newest (here, not in the
        committer: one bad statement must not fail a whole group of commits), and prune the log when due."""
        held = self._blocks.block.writes
        if held is not None:  # inside `atomic`: queued with the rest of the group as it ends
            if self._failure is not None or self._closing:
                self._refuse_if_failed()
            held.append((write, table, value, event))
        else:
            self._enqueue_group([(write, table, value, event)])

    def _refuse_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failed()
        if self._closing:
            raise FabricUnavailableError(f"the ledger at {self.path} is closed")

    def _enqueue_group(self, writes: list[_Held]) -> None:
        """Queue ``writes`` (one, or those an `atomic` block held) as one write, this caller's latest: a commit
        takes all of them or none. Their events are checked before any of it is queued, so that one refused
        leaves nothing of the group queued."""
        with self._lock:
            if self._failure is not None or self._closing:
                self._refuse_if_failed()
            newest = self._newest_event
            for _, _, _, event in writes:
                if event is not None:
                    if event.revision <= newest:
                        raise sqlite3.IntegrityError(f"event revision {event.revision} is not above {newest}")
                    newest = event.revision
            self._newest_event = newest
            batch = self._batch
            for write, table, value, event in writes:
                if table is None:
                    write(batch)
                else:
                    write(batch, table, value)
                if event is not None:  # its row is put; the prune that keeps the log to its retention, when due
                    self._queued_events.append(event)
                    cutoff = event.revision - self._retention  # events at or below it are past the retention
                    if cutoff - self._oldest_event + 1 >= self._prune_step:
                        batch.prune(("DELETE FROM events WHERE revision <= ?", (cutoff,)))
                        self._oldest_event = cutoff + 1
            self._queued += 1
            self._last_queued.set(self._queued)
            if self._idle:  # once: the writes queued before the committer wakes need not notify it again
                self._idle = False
                self._cond.notify()

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """See `Store.atomic`: the writes are held in this thread and queued as one as the block ends, so that the
        committer, which takes whatever is queued when it starts a commit, never takes part of them."""
        return self._atomic_block

    def _commit_loop(self) -> None:
        """Commit each group queued, having checked that the ledger is still in place (`_check_in_place`); while
        there is nothing to commit, check that every `IN_PLACE_CHECK_S`, so that a server that writes nothing is
        stopped too (its next change would be lost, and a second server may start beside it meanwhile)."""
        _run_below(self._nice)
        while True:
            with self._lock:
                if not self._batch and not self._closing:
                    self._idle = True
                    self._cond.wait(IN_PLACE_CHECK_S)
                    self._idle = False
                if not self._batch and self._closing:
                    return
                batch, self._batch = self._batch, Batch()
                upto = self._queued
            try:
                self._check_in_place()
                if batch:
                    self._commit(batch)
            except BaseException as exc:
                with self._lock:
                    self._failure = exc
                    woken = self._wake(None)
                _call_loops(woken, self._failed())
                return
            if batch:
                self._committed(batch, upto)

    def _committed(self, batch: Batch, upto: int) -> None:
        """``batch``, the writes queued up to ``upto``, is durable: call back whoever waited for them. A method of
        its own, so that the waiters' callbacks (and the changes they resume) are not kept alive by the committer's
        locals while it waits for the next group."""
        committed = batch.keys(EVENTS)
        with self._lock:
            self._durable = upto
            self._queued_events = [e for e in self._queued_events if e.revision not in committed]
            woken = self._wake(upto)
        _call_loops(woken, None)

    def _commit(self, batch: Batch) -> None:
        """``batch`` in one transaction: all of it or, when a statement fails, none. Row writes alone (the usual
        group) are one statement (`WRITES`) in a transaction of its own, which takes the write lock as it starts,
        as BEGIN IMMEDIATE does: SQLite runs it and its commit with the GIL let go once, not once a statement."""
        statement = WRITES.statement(batch)
        with self._db_lock:
            if statement is not None:
                self._db.execute(*statement)
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in batch.statements():
                    self._db.execute(sql, params)
            except BaseException:
                # SQLite rolls the transaction back itself on a full disk, an I/O error or a lack of memory; a
                # ROLLBACK then fails, and its error would hide the one that says what happened. The store fails
                # on that one and commits nothing more, so a ROLLBACK that fails too changes nothing.
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _check_in_place(self) -> None:
        """Raise `LedgerMovedError` unless the ledger's path still names the file opened, its write-ahead log's the
        log SQLite writes to (a log removed under it takes every commit since the last checkpoint with it), and its
        lock file's the one this process locked. The check's four `stat` calls cost under 5 us, about 1% of the
        cheapest commit measured (0.39 ms with its fsync), so every commit checks rather than one a second: no
        change is acknowledged into a file removed before its commit began (one removed during a commit is found
        at the next check). Another error of the stat (EIO) fails the store as a commit's would."""
        try:
            found = "another file is there" if _identity(self._real) != self._file else ""
        except (FileNotFoundError, NotADirectoryError):
            found = "it is gone"
        if found:
            raise LedgerMovedError(
                f"the ledger file at {self.path} was removed or replaced ({found}) while this fabric manager used "
                "it: put the ledger back, or restore it from a backup, before restarting (a start on a new file "
                "finds none of its compositions)"
            )
        if self._wal is not None and _wal_identity(self._wal_path) != self._wal:
            raise LedgerMovedError(
                f"the ledger's write-ahead log {self.path}-wal was removed or replaced while this fabric "
                "manager used it: what it committed since the ledger's last checkpoint is only in the file "
                "removed, and reaches the ledger only as this process closes it (killed first, it is lost). Stop "
                "it before removing the ledger's files; at the restart, reconciliation reports the bindings the "
                "ledger no longer records"
            )
        if not ownership.in_place(self._owner):
            raise LedgerMovedError(
                f"the ledger's lock file {self._owner} was removed or replaced while this fabric manager used it: "
                "another one could open the ledger beside this one; stop any other on this ledger before restarting"
            )

    def _wake(self, upto: int | None) -> dict[asyncio.AbstractEventLoop, list[Synced]]:
        """Wake the threads waiting for sequence numbers up to ``upto`` (None: all, the ledger failed), and
        return the loops' waiters, each loop's together, for `_call_loops`; call holding ``_lock``. The loops
        are called after it is released: a call into a loop writes to its socket, which lets the loop's thread
        run, and that thread would then wait for ``_lock`` to queue its next write."""
        waiting = self._waiting
        loops: dict[asyncio.AbstractEventLoop, list[Synced]] = {}
        while waiting and (upto is None or waiting[0][0] <= upto):
            waiter = heapq.heappop(waiting)[2]
            if isinstance(waiter, tuple):
                loops.setdefault(waiter[0], []).append(waiter[1])
            else:
                waiter.release()
        return loops

    def _queue_waiter(self, target: int, waiter: Waiter) -> bool:
        """Queue ``waiter`` for the commit of sequence number ``target``; False when that is on disk already.
        Raises when the ledger failed. Call holding ``_lock``."""
        if self._durable >= target:
            return False
        if self._failure is not None:
            raise self._failed()
        self._waiters += 1
        heapq.heappush(self._waiting, (target, self._waiters, waiter))
        return True

    @property
    def writes_block(self) -> bool:
        """See `Store.writes_block`: a write is queued for the committer, which a change waits for (`when_synced`)
        without blocking."""
        return False

    @property
    def failure(self) -> str:
        """See `Store.failure`: a commit that failed fails every write after it. Read without the lock (it is
        set once, and every RPC asks)."""
        return "" if self._failure is None else self._failed().message

    @property
    def needs_operator(self) -> bool:
        """See `Store.needs_operator`: a commit found the ledger's pages damaged, or the ledger's file or its lock
        file removed or replaced."""
        return isinstance(self._failure, LedgerMovedError) or self._damaged

    @property
    def _damaged(self) -> bool:
        return self._failure is not None and _is_damage(self._failure)

    def _failed(self) -> FabricUnavailableError:
        """The error of every write once a commit failed: damage is the operator's to restore, a ledger removed or
        replaced theirs to put back, anything else (a full or failing disk) the machine's, which a restart may
        get past."""
        if isinstance(self._failure, LedgerMovedError):
            return FabricUnavailableError(str(self._failure))
        if self._damaged:
            return FabricUnavailableError(
                f"the ledger at {self.path} is damaged ({self._failure}): restore it from a backup (docs/durability.md)"
            )
        return FabricUnavailableError(f"the ledger at {self.path} cannot be written: {self._failure!r}")

    def sync(self) -> None:
        """Wait until every write this thread or task queued is on disk, and so every write queued before it
        (groups commit in queue order); raises `FabricUnavailableError` if it cannot be."""
        self._wait_for(self._mine())

    def asynchronous_commit(self) -> contextlib.AbstractContextManager[None]:
        """See `Store.asynchronous_commit`: the caller's last queued write is put back as it was before."""
        return _LastQueuedKept(self._last_queued)

    def await_event(self, revision: int) -> None:
        """See `Store.await_event`. Events are queued in revision order and committed in queue order: while
        the oldest event not yet on disk is at or below ``revision``, wait for everything queued now."""
        with self._lock:
            pending = bool(self._queued_events) and self._queued_events[0].revision <= revision
            everything = self._queued
        if pending:
            self._wait_for(everything)

    def _mine(self) -> int:
        """The sequence number of the last write this caller queued in this ledger (0: none)."""
        return self._last_queued.get()

    async def synced(self) -> None:
        """`sync` on an event loop: the task awaits the commit; the committer wakes the loop once per commit."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.when_synced(lambda failure: _settle(future, failure)):
            await future

    def when_synced(self, callback: Synced, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """See `Store.when_synced`: the committer calls the loop once per commit, for all its waiters there."""
        target = self._last_queued.get()  # `_mine`, a frame fewer: twice a Compose
        if self._durable >= target:  # on disk already (`_durable` only grows): no lock taken, no waiter made
            return False
        waiter = (loop or asyncio.get_running_loop(), callback)
        with self._lock:
            return self._queue_waiter(target, waiter)

    def when_committed(self, callback: Synced, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """See `Store.when_committed`: a waiter for the last write queued, whoever queued it."""
        waiter = (loop or asyncio.get_running_loop(), callback)
        with self._lock:
            return self._queue_waiter(self._queued, waiter)

    def _wait_for(self, target: int) -> None:
        """Wait until the writes up to sequence number ``target`` are on disk."""
        woken = threading.Lock()
        woken.acquire()
        with self._lock:
            if not self._queue_waiter(target, woken):
                return
        woken.acquire()
        with self._lock:
            if self._durable < target:
                raise self._failed()

    # ----------------------------------------------------------------- reads

    def load(self) -> LedgerState:
        with self._lock:
            everything = self._queued
        self._wait_for(everything)
        try:
            return self._read_all()
        except sqlite3.DatabaseError as exc:  # damaged, or a database that is not a ledger
            raise ConfigError(
                f"the ledger at {self.path} cannot be read ({exc}): restore it from a backup", field="state.path"
            ) from exc

    def _refuse_if_closed(self) -> None:
        """Refuse a read of a closed ledger as what it is, not as the damage SQLite's error would read as (a watch
        that reads as its server stops). Holding `_db_lock`."""
        if self._db_closed:
            raise FabricUnavailableError(f"the ledger at {self.path} is closed")

    def _read_all(self) -> LedgerState:
        """Every record; one that does not decode is `undecodable`, naming its table and key."""
        with self._db_lock:
            self._refuse_if_closed()
            comps = tuple(
                decoded(d, Composition, self.path, f"compositions record {i!r}")
                for i, d in self._db.execute("SELECT id, doc FROM compositions")
            )
            res = tuple(
                decoded(d, Reservation, self.path, f"reservations record {i!r}")
                for i, d in self._db.execute("SELECT id, doc FROM reservations")
            )
            (last,) = self._db.execute("SELECT COALESCE(MAX(revision), 0) FROM events").fetchone()
            requests = tuple(
                RequestRecord(i, f, a, t)
                for i, f, a, t in self._db.execute(
                    "SELECT id, fingerprint, answer, at FROM "
                    "(SELECT rowid, * FROM requests ORDER BY rowid DESC LIMIT ?) ORDER BY rowid",
                    (REQUEST_RETENTION,),
                )
            )
            cordons = tuple(d for (d,) in self._db.execute("SELECT device FROM cordons ORDER BY device"))
            keys = [k for (k,) in self._db.execute("SELECT allocation FROM quarantines ORDER BY allocation")]
        return LedgerState(comps, res, int(last), requests, cordons, tuple(self._quarantine_of(k) for k in keys))

    def _quarantine_of(self, key: str) -> tuple[str, str]:
        try:
            return quarantine_of(key)
        except UNDECODABLE as exc:
            raise undecodable(self.path, f"quarantines record {key!r}", exc) from exc

    def events_after(self, revision: int, limit: int = 1000) -> Sequence[Event]:
        """The events after ``revision`` within the retention (the newest revision minus it), as the other
        ledgers serve them: rows a prune has yet to delete are not served, so that a watch is refused at the
        same revision whichever ledger holds the log."""
        with self._lock:
            revision = max(revision, self._newest_event - self._retention)
            queued = [e for e in self._queued_events if e.revision > revision]
        with self._db_lock:
            self._refuse_if_closed()
            rows = self._db.execute(
                "SELECT doc FROM events WHERE revision > ? ORDER BY revision LIMIT ?", (revision, limit)
            ).fetchall()
        found = {e.revision: e for e in (codec.loads(d, Event) for (d,) in rows)}
        for event in queued:
            found.setdefault(event.revision, event)
        return [found[r] for r in sorted(found)[:limit]]

    # ----------------------------------------------------------------- writes (queued)

    # A write is queued as a function of the batch, its table and its row or key, not as a closure, and called
    # with them as they are, not unpacked from a tuple of arguments (which Python 3.11 calls through C): a durable
    # Compose queues four, on the event loop.

    def put_composition(self, composition: Composition) -> None:
        self._enqueue(Batch.put, COMPOSITIONS, (composition.id, codec.record(composition)))

    def delete_composition(self, composition_id: str) -> None:
        self._enqueue(Batch.delete, COMPOSITIONS, composition_id)

    def put_reservation(self, reservation: Reservation) -> None:
        self._enqueue(Batch.put, RESERVATIONS, (reservation.id, codec.record(reservation)))

    def delete_reservation(self, reservation_id: str) -> None:
        self._enqueue(Batch.delete, RESERVATIONS, reservation_id)

    def put_cordon(self, device: str) -> None:
        self._enqueue(Batch.put, CORDONS, (device,))

    def delete_cordon(self, device: str) -> None:
        self._enqueue(Batch.delete, CORDONS, device)

    def put_quarantine(self, pool: str, allocation_id: str) -> None:
        self._enqueue(Batch.put, QUARANTINES, (quarantine_key(pool, allocation_id),))

    def delete_quarantine(self, pool: str, allocation_id: str) -> None:
        self._enqueue(Batch.delete, QUARANTINES, quarantine_key(pool, allocation_id))

    def put_request(self, record: RequestRecord) -> None:
        self._enqueue(self._put_request, REQUESTS, (record.id, record.fingerprint, record.answer, record.at))

    def _put_request(self, batch: Batch, table: Table, row: tuple[str, str, str, float]) -> None:
        """Queue a request's row, and the prune that forgets the oldest once the table may hold twice the
        retention: now and then, not on every put, and counted from the rows found at open, so that a server
        that restarts often still prunes. The oldest are those written first (a row's ``rowid``: a put replaces
        the row under a larger one), not those of the earliest ``at``, which a step of the wall clock reorders."""
        batch.put(table, row)
        self._request_rows += 1
        if self._request_rows >= 2 * REQUEST_RETENTION:
            batch.prune(
                (
                    "DELETE FROM requests WHERE rowid NOT IN (SELECT rowid FROM requests ORDER BY rowid DESC LIMIT ?)",
                    (REQUEST_RETENTION,),
                )
            )
            self._request_rows = REQUEST_RETENTION

    def delete_request(self, request_id: str) -> None:
        self._enqueue(Batch.delete, REQUESTS, request_id)

    def append_event(self, event: Event) -> None:
        self._enqueue(Batch.put, EVENTS, (event.revision, codec.record(event)), event)  # its prune: `_enqueue_group`

    def hold(self) -> Callable[[], None]:
        """Keep this process's claim on the ledger past `close`, until the function returned is called (or the
        process ends, however it ends). A server that stops while a driver call still runs holds it: a fabric
        manager that opened the ledger meanwhile would undo the change that call is making, and the call would
        then land on the hardware behind its back. Call it before `close`."""
        key = ownership.share(self._owner)  # the lock this store holds, not one named anew from a working directory
        return functools.partial(ownership.let_go, key)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._committer.join()
        with self._db_lock:
            self._db.close()
            self._db_closed = True
        ownership.let_go(self._owner)  # with the last store of this process, another fabric manager may open it
