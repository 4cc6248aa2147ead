"""Blocking QMP over ``qemu.qmp``: the driver interface is synchronous, ``qemu.qmp`` is asyncio.

One event loop runs in a daemon thread per fabric; each `Monitor` is a ``QMPClient`` living on that loop, and
every call is handed to it with a bounded wait. QMP errors come back as `QMPCommandError` (the caller knows
what they mean); lost connections and timeouts as `FabricUnavailableError`, or `DeadlineExceededError` when
the caller's deadline passed. Such an error after a command that changes QEMU may have been sent carries
``metadata[OUTCOME] = OUTCOME_UNKNOWN``: QEMU may have done it, so the caller must not take it as undone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from disagg.errors import DeadlineExceededError, DisaggError, FabricUnavailableError, outcome_unknown
from qemu.qmp import ExecuteError, QMPClient, QMPError, Runstate
from qemu.qmp.protocol import StateError

T = TypeVar("T")
E = TypeVar("E", bound=DisaggError)
CALL_TIMEOUT_S = 10.0
_MAX_SOCKET_PATH = 100


_READ_ONLY = frozenset({"qom-list", "qom-get", "device-list-properties", "qmp_capabilities"})
"""The commands the driver sends that change nothing in QEMU (besides ``query-*``)."""


def mutates(command: str) -> bool:
    return not command.startswith("query-") and command not in _READ_ONLY


_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("qmp_deadline", default=None)


@contextlib.contextmanager
def until(deadline: float | None) -> Iterator[None]:
    """Bound every QMP call made inside by ``deadline`` (a ``time.monotonic()`` instant, the caller's): a call
    is not sent once it has passed, and one that QEMU has not answered by then raises DeadlineExceededError."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def bounded(timeout: float, before: str) -> tuple[float, bool]:
    """``timeout``, or the time left before the deadline in force (`until`) when that is sooner, and whether the
    deadline is the bound: running out is then DeadlineExceededError, the caller's, not the host's fault. A
    deadline that has passed already is DeadlineExceededError at once: nothing ``before`` names is begun."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout, False
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"the deadline passed before {before}")
    return min(timeout, left), left < timeout


@contextlib.contextmanager
def within(seconds: float) -> Iterator[bool]:
    """`until` ``seconds`` from now, or the deadline in force if that comes first. Yields whether ``seconds``
    is the bound (the deadline in force comes later, or there is none): a DeadlineExceededError inside is then
    this bound's, not the caller's."""
    deadline, soon = _DEADLINE.get(), time.monotonic() + seconds
    own = deadline is None or soon < deadline
    with until(soon if own else deadline):
        yield own


class QMPCommandError(Exception):
    """QEMU answered a command with an error (``error_class``: GenericError, DeviceNotFound, ...)."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"{command}: {error_class}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class Loop:
    """An asyncio loop in a daemon thread, for the QMP clients of one fabric."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"qmp-{name}", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()


def socket_address(path: Path) -> tuple[str, int | None]:
    """A connectable address for ``path``, and a directory fd to close afterwards.

    A unix socket address holds 108 bytes; a deeper path is reached through ``/proc/self/fd`` of its
    directory, opened with O_PATH, which names the same socket in a few bytes."""
    text = str(path)
    if len(text) < _MAX_SOCKET_PATH:
        return text, None
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{path.name}", fd


class Monitor:
    """One QMP connection to one QEMU, with blocking calls."""

    def __init__(self, loop: Loop, name: str, why_lost: Callable[[], str] = lambda: "") -> None:
        self._loop = loop
        self.name = name
        self._client: QMPClient | None = None
        self._why_lost = why_lost
        """What became of the peer once the connection is lost (its QEMU exited, with its last output): what a
        user needs, where qemu.qmp only says that its client is disconnecting."""

    def connect(self, path: Path, timeout: float) -> None:
        """Connect within ``timeout``, or the deadline in force (`until`) when that comes first."""
        timeout, by_deadline = bounded(timeout, f"connecting to QMP of {self.name}")
        address, fd = socket_address(path)
        client = QMPClient(self.name)
        try:
            self._loop.run(asyncio.wait_for(client.connect(address), timeout), timeout + 1.0)
        except (TimeoutError, concurrent.futures.TimeoutError) as exc:
            if by_deadline:
                raise DeadlineExceededError(f"QMP of {self.name} did not answer before the deadline") from None
            raise FabricUnavailableError(f"cannot connect to QMP of {self.name} at {path}: {exc!r}") from None
        except (QMPError, OSError) as exc:
            raise FabricUnavailableError(f"cannot connect to QMP of {self.name} at {path}: {exc!r}") from None
        finally:
            if fd is not None:
                os.close(fd)
        self._client = client

    @property
    def connected(self) -> bool:
        """Connected and still running: a client whose QEMU went away is disconnecting, and refuses every call."""
        return self._client is not None and self._client.runstate == Runstate.RUNNING

    def execute(self, command: str, arguments: dict[str, Any] | None = None, *, timeout: float = CALL_TIMEOUT_S) -> Any:
        client = self._client
        if client is None:
            raise FabricUnavailableError(f"QMP of {self.name} is not connected")
        timeout, by_deadline = bounded(timeout, f"QMP {command} was sent to {self.name}")
        try:
            return self._loop.run(asyncio.wait_for(client.execute(command, arguments), timeout), timeout + 1.0)
        except ExecuteError as exc:
            raise QMPCommandError(command, exc.error_class, str(exc)) from None
        except StateError:  # refused before sending: the connection was lost earlier
            raise FabricUnavailableError(
                f"QMP {command} was not sent to {self.name}: the connection was lost; {self._why_lost()}"
            ) from None
        except (TimeoutError, concurrent.futures.TimeoutError) as exc:
            if by_deadline:
                lost: DisaggError = DeadlineExceededError(
                    f"QEMU of {self.name} did not answer {command} before the deadline"
                )
            else:
                lost = FabricUnavailableError(f"QMP {command} to {self.name} failed: {exc!r}")
            raise self._sent(command, lost) from None
        except (QMPError, OSError, EOFError) as exc:
            lost = FabricUnavailableError(
                f"QMP {command} to {self.name} got no answer: the connection was lost ({exc!r}); {self._why_lost()}"
            )
            raise self._sent(command, lost) from None

    @staticmethod
    def _sent(command: str, exc: E) -> E:
        """``exc`` for a command whose answer was lost: its outcome is unknown when it changes QEMU."""
        return outcome_unknown(exc) if mutates(command) else exc

    def disconnect(self) -> None:
        """Idempotent; after ``quit`` the peer is gone already, so errors are expected and ignored."""
        client, self._client = self._client, None
        if client is None:
            return
        with contextlib.suppress(Exception):
            self._loop.run(asyncio.wait_for(client.disconnect(), 2.0), 3.0)
