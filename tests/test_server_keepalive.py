"""The server pings its peers: a watcher that stops answering (a paused process, a host gone without a reset)
loses its connection, and its watch slot is free for the next watcher; a live watcher is not cut off."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.client import FabricManagerClient
from disagg.model import EventType
from disagg.server import runtime
from process_helpers import ChildOutput
from server_helpers import WAIT_S, Served, serving, socket_path, wait_until

PING_S = 1.0
"""The server's ping interval and answer timeout in these tests (10 s and 5 s by default)."""
WATCHER = """
import sys
from disagg.client import FabricManagerClient
with FabricManagerClient(sys.argv[1], timeout_s=5) as client, client.watch(0) as events:
    print("watching", flush=True)
    for _ in events:
        pass
"""
"""A watcher in a process of its own, to be paused."""


@pytest.fixture
def pinging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A server that pings every second, with room for one watch."""
    monkeypatch.setattr(runtime, "SERVER_OPTIONS", runtime.server_options(PING_S, PING_S))
    with serving(socket_path(tmp_path), max_watches=1, workers=4) as served:
        yield served


class TestServerPings:
    """A peer that does not answer the server's pings loses its connection and its calls; one that does keeps
    them."""

    def test_a_paused_watcher_frees_its_slot(self, pinging: Served) -> None:
        watcher = subprocess.Popen(
            [sys.executable, "-c", WATCHER, pinging.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert ChildOutput(watcher).wait_for("^watching", WAIT_S), "the watcher did not start"
            wait_until(lambda: len(pinging.server.servicer.watches) == 1, "the watcher's watch")
            watcher.send_signal(signal.SIGSTOP)
            wait_until(lambda: len(pinging.server.servicer.watches) == 0, "the paused watcher's slot to be freed")
            with FabricManagerClient(pinging.address, timeout_s=5) as client, client.watch(0) as events:
                pinging.composer.cordon("pcie0/gpu-a0")
                event = next(events)
            assert event.type is EventType.DEVICE_CORDONED and event.subject == "pcie0/gpu-a0"
        finally:
            watcher.send_signal(signal.SIGCONT)
            watcher.kill()
            watcher.wait(WAIT_S)

    def test_a_live_watcher_is_not_cut_off(self, pinging: Served) -> None:
        """gRPC's clients answer the server's pings and do not police them: a watch idle for several pings goes
        on (without resuming, which would hide a break)."""
        with FabricManagerClient(pinging.address, timeout_s=5) as client, client.watch(0, resume=False) as events:
            wait_until(lambda: len(pinging.server.servicer.watches) == 1, "the watch")
            time.sleep(4 * PING_S)
            pinging.composer.cordon("pcie0/gpu-a0")
            assert next(events).type is EventType.DEVICE_CORDONED
            assert len(pinging.server.servicer.watches) == 1


class TestDefaults:
    """By default the server pings a silent connection within seconds, not gRPC's two hours."""

    def test_the_server_pings(self) -> None:
        options = dict(runtime.SERVER_OPTIONS)
        assert options.get("grpc.keepalive_time_ms", 7_200_000) <= 60_000
        assert options.get("grpc.http2.max_pings_without_data") == 0  # an idle watch sends no data
