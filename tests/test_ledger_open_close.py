"""A SQLite ledger's file and claim: made for its owner alone, through a symlink too; its claim held past a close
by the lock it took, whatever the working directory is since; read after its close, refused as closed."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from disagg.errors import FabricUnavailableError
from disagg.store import SqliteStore


def test_a_ledger_made_through_a_symlink_is_its_owner_s_alone(tmp_path: Path) -> None:
    """The file was made private by its path, which a symlink (a ledger kept on another disk) already took:
    SQLite then made the file it names with the umask's mode, readable by everyone."""
    (tmp_path / "ledger.db").symlink_to(tmp_path / "kept" / "real.db")
    (tmp_path / "kept").mkdir()
    before = os.umask(0o022)
    try:
        SqliteStore(tmp_path / "ledger.db").close()
    finally:
        os.umask(before)
    assert os.stat(tmp_path / "kept" / "real.db").st_mode & 0o777 == 0o600


def test_a_claim_held_past_the_close_is_the_lock_it_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened by a relative path, and the working directory changed since: `hold` named the lock file anew from
    the working directory, took another, and the ledger's own lock was let go at the close."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    store = SqliteStore("ledger.db")
    monkeypatch.chdir(tmp_path / "two")
    release = store.hold()
    store.close()
    try:
        with open(tmp_path / "one" / "ledger.db.lock", "rb") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not (tmp_path / "two" / "ledger.db.lock").exists()
    finally:
        release()
    with open(tmp_path / "one" / "ledger.db.lock", "rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go once released


@pytest.mark.parametrize("read", ["load", "events_after"])
def test_a_read_after_the_close_says_it_is_closed(tmp_path: Path, read: str) -> None:
    """It said the file was damaged and was to be restored from a backup (`load`), or raised SQLite's own error
    (`events_after`, a watch that reads as its server stops)."""
    store = SqliteStore(tmp_path / "ledger.db")
    store.close()
    with pytest.raises(FabricUnavailableError, match="is closed"):
        store.load() if read == "load" else store.events_after(0)
