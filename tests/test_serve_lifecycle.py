"""What a fabric manager leaves on the machine and where it listens: unix socket paths that gRPC binds and
clients reach as written, and lock files, ledgers and state directories closed to other local users."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg import statedir
from disagg.errors import ConfigError
from disagg.lockfile import try_lock
from disagg.server import parse_listener
from disagg.store import SqliteStore
from disagg.wire.sockets import prepare_unix_socket


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o000, 0o022], ids=["umask-000", "umask-022"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process's umask for the test, put back after it."""
    old = os.umask(request.param)
    try:
        yield int(request.param)
    finally:
        os.umask(old)


class TestUnixSocketPaths:
    """A unix listener's path holds none of ``% ? # ,``: gRPC percent-decodes the path it binds, and a client
    reads a query, a fragment or a list of addresses in it, so the socket served was not the one named."""

    @pytest.mark.parametrize("name", ["a%20b.sock", "q?x=1.sock", "h#f.sock", "c,d.sock"])
    def test_refused_by_the_server(self, tmp_path: Path, name: str) -> None:
        """``%20`` bound ``a b.sock`` (another server's, removed first); the others served a socket that no
        client could reach, after printing ``serving on``."""
        with pytest.raises(ConfigError, match="in a unix socket's path as URI syntax") as info:
            parse_listener(f"unix:{tmp_path}/{name}")
        assert info.value.field == "listen"

    def test_refused_before_anything_is_made(self, tmp_path: Path) -> None:
        """The claim every unix listener takes (the driver server's too) refuses such a path before it makes a
        lock file or removes a stale socket: gRPC would then unlink the decoded path and bind it."""
        with pytest.raises(ConfigError, match="choose a path without any of % \\? # ,"):
            prepare_unix_socket(tmp_path / "made" / "a%20b.sock")
        assert list(tmp_path.iterdir()) == []

    def test_other_characters_are_taken_as_written(self, tmp_path: Path) -> None:
        listener = parse_listener(f"unix:{tmp_path}/a b[1]é.sock")
        assert listener.unix_path == tmp_path / "a b[1]é.sock"


class TestPrivateFiles:
    """Lock files are their owner's alone, and the directories made for a ledger or a driver's state are closed to
    other users: an ``flock`` needs only a descriptor open for reading, so any local user who could read a lock
    file (0o644, or 0o666 under umask 000) could hold it and keep the fabric manager from opening its own ledger.
    The group may pass through (0o750), to a socket made beside the ledger."""

    def test_ledger(self, tmp_path: Path, umask: int) -> None:
        ledger = tmp_path / "made" / "deeper" / "ledger.db"
        store = SqliteStore(ledger)
        try:
            assert mode(ledger.with_name("ledger.db.lock")) == 0o600
            assert mode(ledger) == 0o600
            assert mode(ledger.parent) == mode(ledger.parent.parent) == 0o750
        finally:
            store.close()

    def test_a_ledger_left_open_to_others_is_closed_to_them(self, tmp_path: Path) -> None:
        """With the write-ahead log and shared memory a crash left, which SQLite gives the ledger's mode. The
        group keeps its access, given on purpose."""
        ledger = tmp_path / "ledger.db"
        SqliteStore(ledger).close()
        ledger.chmod(0o664)
        for left in ("ledger.db-wal", "ledger.db-shm"):
            (tmp_path / left).write_bytes(b"")
            (tmp_path / left).chmod(0o644)
        store = SqliteStore(ledger)
        try:
            assert [mode(tmp_path / name) for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm")] == [
                0o660,
                0o660,
                0o660,
            ]
        finally:
            store.close()

    def test_an_open_lock_file_is_closed_to_others(self, tmp_path: Path) -> None:
        """One made by an older version, or by hand, is closed to others as it is next locked."""
        lock = tmp_path / "ledger.db.lock"
        lock.write_text("")
        lock.chmod(0o644)
        claim = try_lock(lock)
        assert claim is not None
        claim.close()
        assert mode(lock) == 0o600

    def test_driver_state_directory(self, tmp_path: Path, umask: int) -> None:
        state = tmp_path / "made" / "state"
        claim = statedir.claim("pcie0", "sim", state)
        try:
            assert mode(state) == mode(state.parent) == 0o750
            assert mode(state / "driver.lock") == 0o600
        finally:
            claim.close()
