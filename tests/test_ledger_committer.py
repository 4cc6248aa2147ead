"""The SQLite ledger's committer runs below the threads that serve calls (``$DISAGG_COMMITTER_NICE``).

Linux schedules each thread on its own, so the committer lowers its own priority when it starts: by 10 steps of
niceness unless the variable says otherwise, never past 19, and not at all for 0. A value that is not a whole
number from 0 to 19 is refused before the ledger is opened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.config import build_composer, parse_config
from disagg.errors import ConfigError
from disagg.model import Composition, CompositionState
from disagg.store import SqliteStore
from disagg.store.sqlite import COMMITTER_NICE, COMMITTER_NICE_ENV


def _committer_nice(store: SqliteStore) -> int:
    """The committer thread's niceness, once it has committed a write (so it has started)."""
    store.put_composition(Composition(id="c1", name="n1", host="h1", state=CompositionState.COMPOSED, resources=()))
    store.sync()
    native_id = store._committer.native_id
    assert native_id is not None
    return os.getpriority(os.PRIO_PROCESS, native_id)


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv(COMMITTER_NICE_ENV, raising=False)
    yield tmp_path / "ledger.db"


def test_the_committer_runs_ten_steps_below_its_process(ledger: Path) -> None:
    store = SqliteStore(ledger)
    try:
        assert _committer_nice(store) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + COMMITTER_NICE)
        assert COMMITTER_NICE == 10
    finally:
        store.close()


@pytest.mark.parametrize("steps", ["0", "3", " 19 "])
def test_the_variable_sets_how_far_below(ledger: Path, monkeypatch: pytest.MonkeyPatch, steps: str) -> None:
    monkeypatch.setenv(COMMITTER_NICE_ENV, steps)
    store = SqliteStore(ledger)
    try:
        assert _committer_nice(store) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + int(steps))
    finally:
        store.close()


@pytest.mark.parametrize("value", ["-1", "20", "1.5", "low", "+5", "\u00b2", "\u2460"])
def test_another_value_is_refused_before_the_ledger_is_opened(
    ledger: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(COMMITTER_NICE_ENV, value)
    with pytest.raises(ConfigError, match=rf"\${COMMITTER_NICE_ENV} is .*0 to 19") as refused:
        SqliteStore(ledger)
    assert refused.value.field == COMMITTER_NICE_ENV
    assert not ledger.exists(), "the ledger was created for a store that was refused"


def test_a_configured_ledger_names_the_variable_not_the_ledgers_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal reaches `disagg serve` through the configuration, which names its own settings: the variable is
    not one of them, so the error is the variable's alone."""
    monkeypatch.setenv(COMMITTER_NICE_ENV, "low")
    doc = {
        "state": {"ledger": "sqlite", "path": str(tmp_path / "ledger.db")},
        "fabric": [{"name": "pcie0", "driver": "sim", "options": {"topology": "demo-pcie"}}],
    }
    with pytest.raises(ConfigError) as refused:
        build_composer(parse_config(doc, "disagg.toml", {}))
    assert refused.value.field == COMMITTER_NICE_ENV
    assert refused.value.message.startswith(f"${COMMITTER_NICE_ENV} is 'low'")
    assert "[state] path" not in refused.value.message
    assert not (tmp_path / "ledger.db").exists()


def test_a_process_already_near_19_puts_its_committer_at_19(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from disagg.model import Composition, CompositionState
        from disagg.store import SqliteStore
        os.nice(15 - os.getpriority(os.PRIO_PROCESS, 0))
        store = SqliteStore({str(tmp_path / "ledger.db")!r})
        store.put_composition(Composition(id="c", name="n", host="h", state=CompositionState.COMPOSED, resources=()))
        store.sync()
        print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, store._committer.native_id))
        store.close()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != COMMITTER_NICE_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["15", "19"]
