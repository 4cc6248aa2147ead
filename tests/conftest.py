"""Shared test settings: Hypothesis runs without deadlines so that a slow CI machine does not flake; the
``alibaba_trace`` fixture finds the GPU trace in the shared data directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import server_helpers
from disagg.testing.selection import deselect_undeclared
from disagg_sim.fabric import SIM_CAPABILITIES
from hypothesis import HealthCheck, settings
from server_helpers import FRONT_ENDS, Served, serving

settings.register_profile(
    "disagg",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("disagg")


NO_MLD = {"CARVE-MLD-LOGICAL-DEVICES": "the sim's fabrics here have no MLD pool (test_conformance_broken.py has)"}
"""The clause whose hardware the sim fabrics under test lack; certified on MLD pools elsewhere."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that uses the ``front_end`` fixture runs once a front end (ids ``[inline]``, ``[process]``); one
    marked ``inline_only("why")`` only inline: it looks into the grpc.aio server of the composer's process."""
    if "front_end" not in metafunc.fixturenames:
        return
    inline_only = metafunc.definition.get_closest_marker("inline_only")
    if inline_only is not None and not inline_only.args:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: inline_only needs the reason the test is inline only")
    metafunc.parametrize("front_end", FRONT_ENDS[:1] if inline_only else FRONT_ENDS, indirect=True)


@pytest.fixture
def front_end(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The front end `server_helpers.serving` gives its server for this test; a module opts in with
    ``pytestmark = pytest.mark.usefixtures("front_end")``."""
    monkeypatch.setattr(server_helpers, "FRONT_END", request.param)
    return str(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The sim served out of process declares every feature: leave out the clause about undeclared ones, which
    `disagg certify` reports as not tested, and which would only be a skip here."""
    deselect_undeclared(
        config,
        items,
        SIM_CAPABILITIES.features,
        Path(__file__).parent / "test_conformance_sim_remote.py",
        lacking=NO_MLD,
    )


@pytest.fixture
def alibaba_trace() -> Path:
    """The trace directory in the shared data directory. Without its files the test is skipped, saying what to
    fetch, except on CI (``CI=true``), where it fails: there the data must be present."""
    from disagg.replay.trace import missing_trace_reason, trace_dir

    directory = trace_dir()
    reason = missing_trace_reason(directory)
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return directory


@pytest.fixture(params=["local", "server"])
def served(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served | None]:
    """For a command-line test run twice: None for the local composer on its own ledger (and sim state files),
    else a fabric manager in this process (`where` gives the arguments that pick it). A module may define its own."""
    monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    monkeypatch.delenv("DISAGG_SERVER", raising=False)
    monkeypatch.chdir(tmp_path)
    if request.param == "local":
        yield None
        return
    with serving(tmp_path / "fm.sock") as running:
        yield running


@pytest.fixture
def where(served: Served | None) -> list[str]:
    """The command-line arguments that pick `served`'s backend."""
    return [] if served is None else ["--server", served.address]
