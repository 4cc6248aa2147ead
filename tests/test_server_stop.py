"""Stopping the fabric manager's server within its grace, whatever it is doing: starting the composer (alone or
after winning the lead), reconciling, finishing a change; and what a failed start leaves behind."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import rack
from disagg.composer import FabricComposer
from disagg.errors import ConfigError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.interfaces import CallContext
from disagg.lockfile import try_lock
from disagg.model import Binding, EventType, Topology
from disagg.server import FabricManagerServer
from disagg.server.runtime import ServerStoppedError
from disagg.store import MemoryStore, SqliteStore
from disagg_sim import SimFabric, load_topology
from server_helpers import (
    SERVE_CONFIG,
    WAIT_S,
    GatedBind,
    compose_request,
    serve_child,
    serving,
    socket_path,
    wait_until,
)

PROMPT_S = 2.5
"""The longest a stop with a short grace may take while the composer is busy: the least it waits for it
(`disagg.server.runtime.UNWIND_S`, 1 s) and a margin. Waiting for the busy fabric instead takes `WAIT_S`."""


pytestmark = pytest.mark.usefixtures("front_end")


class HeldFabric(SimFabric):
    """A sim fabric that holds its discovery, or its reads of bindings once ``armed``, until ``gate`` is set
    (bounded by `WAIT_S`); ``entered`` says one is held, ``closed`` that it was closed, ``calls`` counts its
    discoveries and reads of bindings (reconciliation reads them)."""

    def __init__(self, *, hold_discovery: bool = False, name: str = "pcie0", topology: str = "demo-pcie") -> None:
        super().__init__(load_topology(name, topology))
        self.hold_discovery = hold_discovery
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.closed = threading.Event()
        self.calls: Counter[str] = Counter()

    def _hold(self) -> None:
        self.entered.set()
        self.gate.wait(WAIT_S)

    def discover(self) -> Topology:
        self.calls["discover"] += 1
        if self.hold_discovery:
            self._hold()
        return super().discover()

    def bindings(self) -> Sequence[Binding]:
        self.calls["bindings"] += 1
        if self.armed.is_set():
            self._hold()
        return super().bindings()

    def close(self) -> None:
        self.closed.set()
        super().close()


class WonLead:
    """A leadership won at once, as an election on etcd would grant it to the only replica."""

    key = ""
    create_revision = 0

    def __init__(self) -> None:
        self.lost = threading.Event()

    def campaign(self, stopping: threading.Event) -> int:
        return 7

    def leading(self) -> bool:
        return not self.lost.is_set()

    def deposed(self, why: str) -> None:
        self.lost.set()

    def resign(self) -> None:
        self.lost.set()


def timed_stop(server: FabricManagerServer, grace: float) -> float:
    started = time.monotonic()
    server.stop(grace)
    return time.monotonic() - started


def stop_while_held(server: FabricManagerServer, held: HeldFabric) -> tuple[float, dict[str, Any]]:
    """Start ``server`` in a thread, stop it (grace 0) while ``held``'s discovery is held, then let that go:
    how long the stop took, and what the start answered ("addresses" or "error")."""
    outcome: dict[str, Any] = {}

    def start() -> None:
        try:
            outcome["addresses"] = server.start()
        except BaseException as exc:
            outcome["error"] = exc

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        assert held.entered.wait(WAIT_S)
        took = timed_stop(server, 0)
        assert not held.closed.is_set(), "closed under the discovery"
    finally:
        held.gate.set()
        starter.join(WAIT_S)
    assert not starter.is_alive()
    return took, outcome


class TestStopWhileStarting:
    """A stop does not wait on a discovery beyond its grace; the thread that started the composer closes it once
    its start returns, and `start` then raises rather than report addresses of a server that was stopped."""

    def test_start_raises_and_the_composer_closes_after_discovery(self, tmp_path: Path, front_end: str) -> None:
        fabric = HeldFabric(hold_discovery=True)
        sock = socket_path(tmp_path)
        server = FabricManagerServer(
            FabricComposer({"pcie0": fabric}, store=MemoryStore()), [f"unix:{sock}"], front_end=front_end
        )
        took, outcome = stop_while_held(server, fabric)
        assert took < PROMPT_S, f"stop(0) waited {took:.1f} s for the discovery"
        assert "addresses" not in outcome, "start reported a server that had been stopped as serving"
        # The stop cancels the composer's start (`FabricComposer.cancel_start`), which raises as it stops.
        assert isinstance(outcome["error"], RuntimeError) and "stopped while it started" in str(outcome["error"])
        assert fabric.closed.is_set()
        assert not sock.exists()

    def test_the_fabrics_after_a_held_discovery_are_not_discovered(self, tmp_path: Path, front_end: str) -> None:
        """The start ends at the next fabric once a stop gave up on it: no discovery of the fabrics after the held
        one, no recovery or reconciliation (no read of bindings) once the held one answers."""
        held = HeldFabric(hold_discovery=True)
        after = HeldFabric(name="cxl0", topology="demo-cxl")
        server = FabricManagerServer(
            FabricComposer({"pcie0": held, "cxl0": after}, store=MemoryStore()),
            [f"unix:{socket_path(tmp_path)}"],
            front_end=front_end,
        )
        _, outcome = stop_while_held(server, held)
        assert after.calls["discover"] == 0, "a fabric after the held one was discovered after the stop"
        assert held.calls["bindings"] == after.calls["bindings"] == 0, "the stopped start went on to reconcile"
        assert isinstance(outcome.get("error"), ServerStoppedError), outcome
        assert held.closed.is_set() and after.closed.is_set()

    def test_a_replica_stopped_while_it_starts_after_winning_the_lead(self, tmp_path: Path, front_end: str) -> None:
        fabric = HeldFabric(hold_discovery=True)
        sock = socket_path(tmp_path)
        composer = FabricComposer({"pcie0": fabric}, store=MemoryStore())
        served: list[list[str]] = []
        server = FabricManagerServer(
            composer,
            [f"unix:{sock}"],
            leadership=WonLead(),
            on_serving=served.append,
            front_end=front_end,
        )
        try:
            assert server.start() == [f"unix:{sock}"]  # a standby; it wins the lead and starts the composer
            assert fabric.entered.wait(WAIT_S)
            took = timed_stop(server, 0.5)
            assert took < 0.5 + PROMPT_S, f"stop(0.5) waited {took:.1f} s for the discovery"
            assert not sock.exists()
        finally:
            fabric.gate.set()
        assert fabric.closed.wait(WAIT_S), "the composer was not closed once its start returned"
        assert served == [], "a stopped replica served"


class TestStopWhileReconciling:
    """A reconcile that waits on the hardware does not hold a stop past its grace; the timer closes the composer
    once the reconcile returns."""

    def test_stop_leaves_the_close_to_the_timer(self, tmp_path: Path) -> None:
        fabric = HeldFabric()
        with serving(socket_path(tmp_path), {"pcie0": fabric}, grace=0, tick_s=0.02, reconcile_s=0.05) as served:
            fabric.armed.set()
            try:
                assert fabric.entered.wait(WAIT_S)
                took = timed_stop(served.server, 0)
                assert took < PROMPT_S, f"stop(0) waited {took:.1f} s for the reconcile"
                assert not fabric.closed.is_set(), "closed under the reconcile"
            finally:
                fabric.gate.set()
            assert fabric.closed.wait(WAIT_S), "the composer was not closed once the reconcile returned"

    def test_what_the_reconcile_finds_later_is_not_written(self, tmp_path: Path, front_end: str) -> None:
        """The reconcile held on the hardware quarantines, once it returns, a binding the ledger lacks: it wrote
        that to the ledger after stop() had returned, beside a composer restarted on the same ledger in the
        same process, whose next write then failed on the event revision the old one had taken."""
        ledger = tmp_path / "ledger.db"
        fabric = HeldFabric()
        composer = FabricComposer({"pcie0": fabric}, store=SqliteStore(ledger))
        server = FabricManagerServer(
            composer, [f"unix:{socket_path(tmp_path)}"], tick_s=0.02, reconcile_s=0.05, front_end=front_end
        )
        server.start()
        fabric.bind("pcie0/gpu-a0", "h1", CallContext(epoch=1))  # the reconcile finds it unrecorded
        fabric.armed.set()
        try:
            assert fabric.entered.wait(WAIT_S)
            server.stop(0)
            again = FabricComposer(rack(), store=SqliteStore(ledger))
            again.start()
        finally:
            fabric.gate.set()
        try:
            assert fabric.closed.wait(WAIT_S)
            again.cordon("pcie0/gpu-a1")  # fails if the old reconcile took a revision meanwhile
            assert [e.type for e in again.events()] == [EventType.DEVICE_CORDONED]
        finally:
            again.close()


class TestGrace:
    """The grace bounds the whole shutdown: the calls in flight and the changes still running share it."""

    def test_a_change_in_flight_gets_the_grace_once(self, tmp_path: Path) -> None:
        gated = GatedBind(load_topology("pcie0", "demo-pcie"))
        gated.entered, gated.gate = threading.Event(), threading.Event()
        with (
            serving(socket_path(tmp_path), {"pcie0": gated}, grace=0) as served,
            grpc.insecure_channel(served.address) as raw,
        ):
            call = fm_grpc.FabricManagerServiceStub(raw).Compose.future(compose_request("stuck"), timeout=WAIT_S)
            try:
                assert gated.entered.wait(WAIT_S)
                took = timed_stop(served.server, 1.0)
            finally:
                gated.gate.set()
                call.cancel()
            assert 1.0 <= took < 1.6, f"stop(1.0) took {took:.2f} s"


class HealHeld(GatedBind):
    """A sim fabric whose binds, once ``armed``, say they have begun (`entered`) and wait for `gate` (bounded)."""

    def __init__(self) -> None:
        super().__init__(load_topology("pcie0", "demo-pcie"))
        self.entered, self.gate, self.armed, self.closed = (threading.Event() for _ in range(4))

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if self.armed.is_set():
            return super().bind(device, host, ctx)
        return SimFabric.bind(self, device, host, ctx)

    def close(self) -> None:
        self.closed.set()
        super().close()


class TestStopWhileHealing:
    """A heal in flight (the composer's auto-heal, in a thread of its own) does not hold a stop past its grace: the
    stop closed the composer, which waited for the heal without end; now the composer is closed once it ends."""

    def test_a_heal_in_flight(self, tmp_path: Path) -> None:
        fabric = HealHeld()
        ledger = tmp_path / "ledger.db"
        with serving(socket_path(tmp_path), {"pcie0": fabric}, store=SqliteStore(ledger), grace=0) as served:
            reply = served.stub.Compose(compose_request("healed"), timeout=WAIT_S)
            fabric.armed.set()
            fabric.fail_device(reply.composition.devices[0].device, "failed for the test")
            try:
                assert fabric.entered.wait(WAIT_S), "no heal began"
                took = timed_stop(served.server, 0.5)
                assert took < 0.5 + PROMPT_S, f"stop(0.5) waited {took:.1f} s for the heal"
                assert not fabric.closed.is_set(), "closed under the heal"
                assert [what for what in served.server.in_flight() if "heal" in what] != [], "the heal is not named"
                assert try_lock(ledger.with_name("ledger.db.lock")) is None, "the ledger was let go under the heal"
            finally:
                fabric.gate.set()
            assert fabric.closed.wait(WAIT_S), "the composer was not closed once the heal ended"


class TestLedgerClaimPastStop:
    """A driver call still running after the grace keeps this process's claim on its SQLite ledger until it
    returns: the claim was let go as the stop closed the composer, so that a second fabric manager started at
    once, undid the interrupted compose, and then the old call's bind landed on the hardware unrecorded."""

    def test_held_until_the_call_returns(self, tmp_path: Path, front_end: str) -> None:
        ledger = tmp_path / "ledger.db"
        gated = GatedBind(load_topology("pcie0", "demo-pcie"))
        gated.entered, gated.gate = threading.Event(), threading.Event()
        server = FabricManagerServer(
            FabricComposer({"pcie0": gated}, store=SqliteStore(ledger)),
            [f"unix:{socket_path(tmp_path)}"],
            front_end=front_end,
        )
        server.start()
        try:
            with grpc.insecure_channel(server.addresses[0]) as raw:
                call = fm_grpc.FabricManagerServiceStub(raw).Compose.future(compose_request("late"), timeout=WAIT_S)
                assert gated.entered.wait(WAIT_S)
                server.stop(0.2)
                call.cancel()
            assert try_lock(ledger.with_name("ledger.db.lock")) is None, "the ledger was let go under a driver call"
            running = server.in_flight()
            assert [name.split(" (")[0] for name in running] == ["driver call FabricComposer._bind_new"], running
        finally:
            gated.gate.set()

        def claimable() -> bool:
            claim = try_lock(ledger.with_name("ledger.db.lock"))
            if claim is None:
                return False
            claim.close()
            return True

        wait_until(claimable, "the ledger to be let go once the call returned")
        assert server.in_flight() == []

    def test_let_go_at_once_when_nothing_runs(self, tmp_path: Path) -> None:
        ledger = tmp_path / "ledger.db"
        with serving(socket_path(tmp_path), store=SqliteStore(ledger)) as served:
            served.stub.Compose(compose_request("quick"), timeout=WAIT_S)
        claim = try_lock(ledger.with_name("ledger.db.lock"))
        assert claim is not None, "a stop with nothing running kept the ledger"
        claim.close()


class TestFailedStart:
    """A start that fails to listen leaves no socket file behind and says why in words."""

    def test_unix_socket_removed_and_port_in_use_named(self, tmp_path: Path, front_end: str) -> None:
        path = tmp_path / "fm.sock"
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            server = FabricManagerServer(
                FabricComposer(rack(), store=MemoryStore()), [f"unix:{path}", f"127.0.0.1:{port}"], front_end=front_end
            )
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: .*already in use"):
                server.start()
        assert not path.exists(), "the unix socket was left behind"
        with serving(path) as served:  # the path is free again
            assert served.server.addresses == [f"unix:{path}"]


CHILD = """
import sys, time
from disagg_sim import SimFabric

discover = SimFabric.discover

def slow_discover(self):
    print("discovering", file=sys.stderr, flush=True)
    time.sleep(10)
    return discover(self)

def slow_close(self):
    print("closing", file=sys.stderr, flush=True)
    time.sleep(1.5)
    print("closed", file=sys.stderr, flush=True)

SimFabric.discover = slow_discover
SimFabric.close = slow_close
from disagg.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


class TestServeSignals:
    """``disagg serve`` stopped by signals while it starts exits 0, however many signals come."""

    def test_a_second_sigterm_during_the_clean_up(self, tmp_path: Path, front_end: str) -> None:
        sock = socket_path(tmp_path)
        config = tmp_path / "disagg.toml"
        config.write_text(SERVE_CONFIG.format(delay=0, socket=sock))
        child = serve_child(tmp_path, config, "--front-end", front_end, script=CHILD, stdout=subprocess.DEVNULL)
        lines: list[str] = []

        def read() -> None:
            assert child.stderr is not None
            lines.extend(line.rstrip("\n") for line in child.stderr)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            wait_until(lambda: "discovering" in lines, "the discovery to begin", timeout=30)
            child.send_signal(signal.SIGTERM)
            wait_until(lambda: "closing" in lines, "the fabric to close")
            child.send_signal(signal.SIGTERM)
            code = child.wait(WAIT_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(WAIT_S)
            reader.join(WAIT_S)
        assert code == 0, "\n".join(lines[-30:])
        assert "closed" in lines and not any("Traceback" in line for line in lines)
        assert not sock.exists()


def composing(stub: fm_grpc.FabricManagerServiceStub, name: str) -> bool:
    try:
        reply = stub.GetComposition(fm.GetCompositionRequest(id=name), timeout=WAIT_S)
    except grpc.RpcError:
        return False
    return reply.composition.state == fm.COMPOSITION_STATE_COMPOSING


PAST_GRACE = """
import sys, time
from disagg_sim import SimFabric

close = SimFabric.close

def close_behind_the_call(self):
    print(f"closing {self.name}", file=sys.stderr, flush=True)
    if self.name == "pcie0":  # as a switch's client, whose close waits for the request it serialises
        time.sleep(60)
    close(self)
    print(f"closed {self.name}", file=sys.stderr, flush=True)

SimFabric.close = close_behind_the_call
from disagg.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
"""``disagg serve`` whose pcie0 closes only after a minute, as a fabric whose close waits behind a driver call."""

SLOW_BIND = SERVE_CONFIG.replace("[state]", "[composer]\ncall_timeout_s = 60\n\n[state]")


class TestServePastItsGrace:
    """``disagg serve`` that ends with a driver call past its grace closes the fabrics that call does not hold,
    within a bound, before its process ends: the stop closed every fabric in turn under the call, and one whose
    close waited behind the call held the exit without end (the fabrics after it were never closed); a stop past
    the grace with a reconcile or a heal running closed none (a switch emulator to stop was left running)."""

    def test_the_other_fabrics_close_and_the_exit_is_bounded(self, tmp_path: Path, front_end: str) -> None:
        sock = socket_path(tmp_path)
        config = tmp_path / "disagg.toml"
        config.write_text(SLOW_BIND.format(delay=20, socket=sock))
        child = serve_child(tmp_path, config, "--grace", "0.5", "--front-end", front_end, script=PAST_GRACE)
        lines: list[str] = []
        assert child.stdout is not None and child.stderr is not None
        errors = child.stderr
        reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in errors), daemon=True)
        reader.start()
        try:
            assert child.stdout.readline().startswith("serving on"), lines
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                stub = fm_grpc.FabricManagerServiceStub(channel)
                call = stub.Compose.future(compose_request("late"), timeout=60)
                wait_until(lambda: composing(stub, "late"), "the compose to be in flight")
                child.send_signal(signal.SIGTERM)
                try:
                    code = child.wait(WAIT_S)
                finally:
                    call.cancel()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(WAIT_S)
            reader.join(WAIT_S)
        assert code == 0, "\n".join(lines[-30:])
        assert "closed cxl0" in lines, "\n".join(lines[-30:])
        assert "closed pcie0" not in lines
        assert any("fabrics pcie0 did not close" in line for line in lines)
