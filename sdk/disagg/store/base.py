"""The ledger interface: what the composer must find again after a restart."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
from cattrs.errors import BaseValidationError, ForbiddenExtraKeysError

from disagg import codec
from disagg.errors import ConfigError
from disagg.model import Composition, Event, Reservation
from disagg.model._quick import quick_init

REQUEST_RETENTION = 10_000
"""Request ids remembered, newest first: a retry is expected within minutes, not after ten thousand others."""

UNDECODABLE: tuple[type[Exception], ...] = (ValueError, TypeError, LookupError, AttributeError, BaseValidationError)
"""What decoding a damaged or hand-edited ledger record raises: JSON that does not parse (ValueError), or JSON
of another shape than the record's class (cattrs' validation errors, or a lookup in a value of another type)."""

T = TypeVar("T")


def undecodable(ledger: object, what: str, exc: BaseException, field: str = "state.path") -> ConfigError:
    """The refusal of a ledger (at ``ledger``, when the caller knows where; ``field``: the setting that names
    it) holding a record that does not decode: the operator's to restore, as a damaged file is, never a
    traceback at start-up."""
    where = f" at {ledger}" if ledger else ""
    return ConfigError(
        f"the ledger{where} cannot be read ({what} does not decode: {exc}): restore it from a backup "
        "(docs/durability.md)",
        field=field,
    )


def unknown_fields(exc: BaseException) -> list[str]:
    """The fields a record holds that its class (or a value inside it) does not know, from cattrs' error."""
    if isinstance(exc, ForbiddenExtraKeysError):
        return sorted(exc.extra_fields)
    if isinstance(exc, BaseExceptionGroup):
        return sorted({name for inner in exc.exceptions for name in unknown_fields(inner)})
    return []


def decoded(text: str | bytes, cls: type[T], ledger: object, what: str, field: str = "state.path") -> T:
    """``text`` as a record of ``cls``, or `undecodable` naming ``what`` record of the ledger at ``ledger``; one
    with fields this version does not know is refused as a newer disagg's (`codec.load_record`)."""
    try:
        return codec.load_record(text, cls)
    except UNDECODABLE as exc:
        unknown = unknown_fields(exc)
        if unknown:
            where = f" at {ledger}" if ledger else ""
            raise ConfigError(
                f"the ledger{where} cannot be read: {what} has fields this disagg does not know "
                f"({', '.join(unknown)}), as a newer disagg writes them; upgrade disagg",
                field=field,
            ) from exc
        raise undecodable(ledger, what, exc, field) from exc


def check_event_retention(value: int) -> int:
    """``value`` as a ledger's event retention: a log that keeps no event could serve no watch, and a ledger
    would only find out at its first append."""
    if value < 1:
        raise ConfigError(f"event_retention must be at least 1, not {value}")
    return value


@quick_init
@attrs.frozen
class RequestRecord:
    """The first answer to a request id: a retry with the same ``fingerprint`` gets ``answer`` back.

    ``answer`` is a JSON document (see `disagg.composer.requests`); ``at`` the wall-clock time it was given.
    """

    id: str
    fingerprint: str
    answer: str
    at: float


def quarantine_key(pool: str, allocation_id: str) -> str:
    """A quarantined allocation as one key: its pool and id as a JSON array, since either may hold any
    character a separator could be."""
    return json.dumps([pool, allocation_id], separators=(",", ":"))


def quarantine_of(key: str) -> tuple[str, str]:
    """The (pool, allocation id) of a `quarantine_key`."""
    pool, allocation_id = json.loads(key)
    return str(pool), str(allocation_id)


@attrs.frozen
class LedgerState:
    """Everything a composer reloads at start-up."""

    compositions: tuple[Composition, ...] = ()
    reservations: tuple[Reservation, ...] = ()
    last_revision: int = 0
    requests: tuple[RequestRecord, ...] = ()
    """The newest `REQUEST_RETENTION`, oldest first."""
    cordons: tuple[str, ...] = ()
    """Devices kept out of placement, by an operator or by reconciliation (a quarantine)."""
    quarantined: tuple[tuple[str, str], ...] = ()
    """(pool, allocation id) of memory that reconciliation found carved with no record and reported."""


_NOTHING_HELD: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
"""The default `Store.atomic` and `Store.asynchronous_commit`, which do nothing: one for every block, since a
`nullcontext` keeps no state (made for each, it cost the in-memory ledger a Python ``__init__`` at every hold of the
composer's lock, three a Compose)."""


class Store(abc.ABC):
    """Durable records of compositions, reservations and the event log. Implementations are thread-safe."""

    @abc.abstractmethod
    def load(self) -> LedgerState: ...

    @abc.abstractmethod
    def put_composition(self, composition: Composition) -> None: ...

    @abc.abstractmethod
    def delete_composition(self, composition_id: str) -> None: ...

    @abc.abstractmethod
    def put_reservation(self, reservation: Reservation) -> None: ...

    @abc.abstractmethod
    def delete_reservation(self, reservation_id: str) -> None: ...

    @abc.abstractmethod
    def put_cordon(self, device: str) -> None: ...

    @abc.abstractmethod
    def delete_cordon(self, device: str) -> None: ...

    @abc.abstractmethod
    def put_quarantine(self, pool: str, allocation_id: str) -> None: ...

    @abc.abstractmethod
    def delete_quarantine(self, pool: str, allocation_id: str) -> None: ...

    @abc.abstractmethod
    def put_request(self, record: RequestRecord) -> None: ...

    @abc.abstractmethod
    def delete_request(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def append_event(self, event: Event) -> None: ...

    @abc.abstractmethod
    def events_after(self, revision: int, limit: int = 1000) -> Sequence[Event]: ...

    def sync(self) -> None:
        """Wait until every write this caller (a thread, or an asyncio task) made so far is durable. A store
        whose writes are durable when they return (the default) has nothing to wait for; one that groups
        commits waits for its committer."""
        return None

    async def synced(self) -> None:
        """`sync` for a caller on an event loop, waiting without blocking the loop. The default calls `sync`,
        which is right for a store with nothing to wait for; a store that waits overrides it, `sync` and
        `when_synced`."""
        self.sync()

    def when_synced(
        self, callback: Callable[[Exception | None], None], loop: asyncio.AbstractEventLoop | None = None
    ) -> bool:
        """`synced` as a callback, for a caller on the running event loop that waits without a task of its own
        (`disagg.composer.steps.LoopRun`): returns False when every write of this caller is durable already,
        else True, and calls ``callback`` on the loop once they are (with None) or cannot be (with the error).
        Raises at once when the store can no longer make writes durable. ``loop``: the running loop, when the
        caller has it (on Python 3.11 asking for it costs a system call)."""
        self.sync()
        return False

    def when_committed(
        self, callback: Callable[[Exception | None], None], loop: asyncio.AbstractEventLoop | None = None
    ) -> bool:
        """For a caller on the running event loop: returns False when no write of anyone's waits for a commit,
        else True, and calls ``callback`` on the loop once every write queued so far is durable (with None) or
        cannot be (with the error). A server starts the changes that arrive meanwhile together then
        (`disagg.server.aio`): their first writes would wait for the next commit anyway, and run back to back
        the composer's code and data stay in the processor's caches. The default, whose writes are durable when
        they return, has nothing in flight. ``loop`` as for `when_synced`."""
        return False

    def await_event(self, revision: int) -> None:
        """Wait until the event of ``revision``, and every one before it, is durable. An event watch sends
        only such events: one that a crash could still take back would leave its watcher, after the restart,
        with a revision that the log lacks or that a new event reuses. The default has nothing to wait for;
        raises `FabricUnavailableError` when the events cannot be made durable."""
        return None

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """The writes this thread makes inside are made durable together, in one transaction, as it leaves: all of
        them or, should that fail, none. A composition's record and the event that tells of its change are one
        such group: written apart, a crash or a lost lead between the two leaves the record without its event,
        and a watcher never learns of the change. Leaving on an error writes what was written before it, as
        writes made outside would have been. A write refused at once (the store failed, or was closed) is
        refused where it is made; one that fails in the transaction raises as the block is left. Nested, the
        inner block joins the outer one. The default, whose every write is durable alone when it returns and a
        crash cannot split, writes each as it is made."""
        return _NOTHING_HELD

    def asynchronous_commit(self) -> contextlib.AbstractContextManager[None]:
        """Writes made inside are committed with the next group as usual, but this caller's `sync` (and
        `synced`, `when_synced`) does not wait for them: it waits for what the caller wrote before, and for
        what it writes after (commits keep queue order, so those cover these too). For writes that recovery
        rebuilds from the hardware if a crash loses them, such as a new composition's COMPOSED record once
        every binding of its durable plan is made. A store whose writes are durable when they return (the
        default) has nothing to leave out."""
        return _NOTHING_HELD

    @property
    def writes_block(self) -> bool:
        """Whether a write may wait: on the network, another process or a disk (etcd's round trips, retried for
        its patience). True unless the store knows better. A store whose writes return at once (in memory, or
        queued for a committer thread) answers False, and the fabric manager's server then runs the changes that
        write on its event loop; otherwise each change runs in a thread of its own, so that a write that waits does
        not stop every other call the loop serves, health checks included."""
        return True

    @property
    def record_limit(self) -> int | None:
        """The most bytes one record may take (its JSON document), or None for no limit. A ledger that has one
        (etcd's, one transaction) fails as a whole on a record past it, so the composer refuses a change whose
        records would be, before it claims anything."""
        return None

    @property
    def failure(self) -> str:
        """Why this store can no longer make any write durable (its every write is refused from then on), or
        empty. A store that fails only the call that met the error (the default) is never failed as a whole;
        one that fails stop, as a grouped committer must once a commit failed (what its group's callers were
        told may differ from what is on disk), says so here, and its server stops so that a restart recovers
        from the disk and the hardware."""
        return ""

    @property
    def needs_operator(self) -> bool:
        """The `failure` is the operator's to mend before a restart, not a fault of the machine that a restart may
        get past: damage to the ledger's data (a restart is refused the same way), or a ledger file removed or
        replaced under the process (a restart would start on another file, missing every composition). A server
        that stops on it is to exit as for any other bad state (2), so that its supervisor stops restarting it."""
        return False

    def close(self) -> None:
        """Release files and connections; the default holds none."""
        return None
