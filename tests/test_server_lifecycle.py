"""The server's life: UNAVAILABLE and health NOT_SERVING during start-up, health and reflection, listeners, the
reservation timer, and a graceful shutdown that lets calls in flight finish while new ones are refused."""

from __future__ import annotations

import os
import re
import socket
import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import rack
from disagg.composer import FabricComposer
from disagg.errors import ConfigError, FabricUnavailableError, answered_not_serving
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.model import CompositionState, EventType, Topology
from disagg.server import SERVICE_NAME, FabricManagerServer, parse_listener
from disagg.store import MemoryStore, SqliteStore
from disagg.wire.errors import from_rpc_error
from disagg_sim import SimFabric, load_topology
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from server_helpers import (
    WAIT_S,
    GatedBind,
    GatedDiscovery,
    Served,
    compose_request,
    fails,
    gpu,
    guarded_channel,
    serving,
    slow_rack,
    socket_path,
    stream_fails,
    wait_until,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

EVERY_UNARY_CALL = [
    ("GetTopology", fm.GetTopologyRequest()),
    ("ListDevices", fm.ListDevicesRequest()),
    ("GetDevice", fm.GetDeviceRequest(id="pcie0/gpu-a0")),
    ("ListPools", fm.ListPoolsRequest()),
    ("Compose", compose_request("early")),
    ("GetComposition", fm.GetCompositionRequest(id="early")),
    ("ListCompositions", fm.ListCompositionsRequest()),
    ("UpdateComposition", fm.UpdateCompositionRequest(id="early", add=[gpu()])),
    ("Decompose", fm.DecomposeRequest(id="early")),
    ("CordonDevice", fm.CordonDeviceRequest(id="pcie0/gpu-a0")),
    ("UncordonDevice", fm.UncordonDeviceRequest(id="pcie0/gpu-a0")),
    ("ListDrivers", fm.ListDriversRequest()),
    ("ListReservations", fm.ListReservationsRequest()),
    ("ReleaseReservation", fm.ReleaseReservationRequest(id="r-1")),
]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server over the demo rack on a unix socket in the test's directory."""
    with serving(socket_path(tmp_path)) as running:
        yield running


def health_of(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S, wait_for_ready=True)
    return int(reply.status)


class TestStartup:
    """Until the composer has started, health is NOT_SERVING and every fabric-manager RPC answers UNAVAILABLE."""

    def test_every_unary_rpc_is_checked_and_documented(self) -> None:
        methods = fm.DESCRIPTOR.services_by_name["FabricManagerService"].methods
        assert {m.name for m in methods if not m.server_streaming} == {name for name, _ in EVERY_UNARY_CALL}
        protocol = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
        assert [m.name for m in methods if f"`{m.name}`" not in protocol] == []

    def test_unavailable_until_started(self, tmp_path: Path, front_end: str) -> None:
        gated = GatedDiscovery(load_topology("pcie0", "demo-pcie"))
        gated.gate = threading.Event()
        address = f"unix:{socket_path(tmp_path)}"
        server = FabricManagerServer(
            FabricComposer({"pcie0": gated}, store=MemoryStore()), [address], front_end=front_end
        )
        starter = threading.Thread(target=server.start)
        starter.start()
        channel = guarded_channel(address)
        try:
            assert health_of(channel) == NOT_SERVING and health_of(channel, SERVICE_NAME) == NOT_SERVING
            stub = fm_grpc.FabricManagerServiceStub(channel)
            for method, request in EVERY_UNARY_CALL:
                failed = fails(getattr(stub, method), request)
                assert failed.code is grpc.StatusCode.UNAVAILABLE, method
                assert failed.reason == "FABRIC_UNAVAILABLE" and "starting" in failed.message
            failed = stream_fails(stub.WatchEvents, fm.WatchEventsRequest())
            assert failed.code is grpc.StatusCode.UNAVAILABLE
            gated.gate.set()
            starter.join(WAIT_S)
            assert health_of(channel) == SERVING and health_of(channel, SERVICE_NAME) == SERVING
            assert stub.ListDevices(fm.ListDevicesRequest()).devices
        finally:
            gated.gate.set()
            starter.join(WAIT_S)
            channel.close()
            server.stop(0)

    def test_failed_start_closes_everything(self, tmp_path: Path, front_end: str) -> None:
        class Unreachable(SimFabric):
            def discover(self) -> Topology:
                raise FabricUnavailableError("switch management port does not answer")

        sock = socket_path(tmp_path)
        server = FabricManagerServer(
            FabricComposer({"pcie0": Unreachable(load_topology("pcie0", "demo-pcie"))}),
            [f"unix:{sock}"],
            front_end=front_end,
        )
        with pytest.raises(FabricUnavailableError, match="does not answer"):
            server.start()
        server.stop()
        assert not sock.exists()
        with serving(sock) as served:  # the address is free again
            assert served.stub.ListPools(fm.ListPoolsRequest()).pools


@pytest.mark.usefixtures("front_end")
class TestHealth:
    """grpc.health.v1 answers SERVING for the server and the fabric-manager service once started."""

    def test_serving(self, served: Served) -> None:
        assert health_of(served.channel) == SERVING
        assert health_of(served.channel, SERVICE_NAME) == SERVING
        assert SERVICE_NAME == "disagg.fabric.v1.FabricManagerService"

    def test_unknown_service(self, served: Served) -> None:
        stub = health_pb2_grpc.HealthStub(served.channel)
        with pytest.raises(grpc.RpcError) as info:  # the standard health protocol, without rich details
            stub.Check(health_pb2.HealthCheckRequest(service="nope.Service"))
        assert info.value.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.usefixtures("front_end")
class TestReflection:
    """Server reflection lists the fabric-manager and health services and serves their descriptors."""

    def test_services(self, served: Served) -> None:
        database = ProtoReflectionDescriptorDatabase(served.channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        found = database.FindFileContainingSymbol(SERVICE_NAME)
        assert found.name == "disagg/fabric/v1/fabric_manager.proto"


@pytest.mark.usefixtures("front_end")
class TestShutdown:
    """Stopping sets health NOT_SERVING first, refuses new calls with UNAVAILABLE, lets calls in flight finish."""

    def test_graceful(self, tmp_path: Path, front_end: str) -> None:
        with serving(socket_path(tmp_path), slow_rack(1.0), front_end=front_end) as served:
            health = health_pb2_grpc.HealthStub(served.channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S
            )
            assert next(health).status == SERVING
            outcome: dict[str, Any] = {}

            def compose() -> None:
                try:
                    outcome["reply"] = served.stub.Compose(compose_request("slow"), timeout=WAIT_S)
                except grpc.RpcError as err:
                    outcome["error"] = err.code()

            composing = threading.Thread(target=compose)
            composing.start()
            wait_until(lambda: bool(served.composer.compositions()), "the compose to begin")
            stopper = threading.Thread(target=served.server.stop, args=(WAIT_S,))
            stopper.start()
            try:
                assert next(health).status == NOT_SERVING
                with pytest.raises(StopIteration):
                    next(health)  # the health watch ends rather than hold up the shutdown

                def refused() -> bool:
                    try:
                        served.stub.GetTopology(fm.GetTopologyRequest(), timeout=1.0)
                    except grpc.RpcError as err:
                        return err.code() is grpc.StatusCode.UNAVAILABLE
                    return False

                wait_until(refused, "new calls to be refused")
                assert composing.is_alive(), "the compose in flight should still be running"
            finally:
                composing.join(WAIT_S)
                stopper.join(WAIT_S)
            assert "error" not in outcome and outcome["reply"].composition.state == fm.COMPOSITION_STATE_COMPOSED
            assert not stopper.is_alive()

    def test_compose_whose_caller_left_finishes_before_the_server_stops(self, tmp_path: Path) -> None:
        """The client cancels a Compose mid-bind: the change goes on to the end (the composer never stops a
        change midway), and stopping the server waits for it within the grace period."""
        gated = GatedBind(load_topology("pcie0", "demo-pcie"))
        gated.entered, gated.gate = threading.Event(), threading.Event()
        with serving(socket_path(tmp_path), {"pcie0": gated}) as served, grpc.insecure_channel(served.address) as raw:
            # A plain channel: the guarded one waits for the answer to check its code, so it cannot cancel.
            call = fm_grpc.FabricManagerServiceStub(raw).Compose.future(compose_request("left"), timeout=WAIT_S)
            assert gated.entered.wait(WAIT_S)
            assert call.cancel()
            opening = threading.Timer(0.3, gated.gate.set)
            opening.start()
            served.server.stop(WAIT_S)
            opening.join()
            (comp,) = served.composer.compositions()
            assert comp.state is CompositionState.COMPOSED
            assert set(served.bindings()) == {d.device for d in comp.devices}


class TestEmbedding:
    """The servicer embedded in another grpcio server as docs/protocol.md shows it serves, and its shutdown ends
    the event watches with UNAVAILABLE."""

    def test_as_documented(self, tmp_path: Path) -> None:
        """Done as the docs said before (the composer started, no `mark_ready`), every call answered UNAVAILABLE
        "starting" for ever, and nothing said to end the watches before the server stops."""
        doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
        blocks = re.findall(r"```python\n(.*?)```", doc.partition("To embed it")[2], flags=re.S)
        assert len(blocks) == 2, "docs/protocol.md shows how to start and stop an embedded servicer"
        address = f"unix:{socket_path(tmp_path)}"
        start, stop = (
            compile(b.replace("unix:/run/disagg/fm.sock", address), "docs/protocol.md", "exec") for b in blocks
        )
        names: dict[str, Any] = {"composer": FabricComposer(rack(), store=MemoryStore())}
        exec(start, names)
        channel = guarded_channel(address)
        try:
            stub = fm_grpc.FabricManagerServiceStub(channel)
            assert [f.name for f in stub.ListDrivers(fm.ListDriversRequest(), timeout=WAIT_S).fabrics]
            watch = stub.WatchEvents(fm.WatchEventsRequest(after_revision=names["composer"].revision))
            wait_until(lambda: len(names["servicer"].watches) == 1, "the watch")
            exec(stop, names)
            with pytest.raises(grpc.RpcError) as info:
                next(watch)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
        finally:
            channel.close()
            names["server"].stop(0)
            names["composer"].close()


class TestReservationTimer:
    """A timer expires reservations whose time to live has passed, without any call to the server."""

    def test_reservation_expires(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), tick_s=0.05) as served:
            reply = served.stub.Compose(compose_request("r", mode=fm.COMPOSE_MODE_RESERVE, reservation_ttl_s=0.2))

            def expired() -> bool:
                return any(e.type is EventType.RESERVATION_EXPIRED for e in served.composer.events())

            wait_until(expired, "the reservation to expire")
            request = fm.ComposeRequest(reservation_id=reply.reservation.id, mode=fm.COMPOSE_MODE_APPLY)
            failed = fails(served.stub.Compose, request)
            assert failed.code is grpc.StatusCode.NOT_FOUND


def started_under_umask(sock: Path, umask: int, front_end: str = "inline") -> FabricManagerServer:
    """A server on the demo rack listening on ``sock``, started while the process's umask is ``umask``."""
    old = os.umask(umask)
    try:
        server = FabricManagerServer(FabricComposer(rack()), [f"unix:{sock}"], front_end=front_end)
        server.start()
    finally:
        os.umask(old)
    return server


class TestListeners:
    """Listener addresses: loopback TCP or unix sockets by default; stale sockets are replaced, live ones not."""

    @pytest.mark.parametrize(
        ("address", "target"),
        [
            ("127.0.0.1:50051", "127.0.0.1:50051"),
            ("localhost:0", "localhost:0"),
            ("[::1]:7000", "[::1]:7000"),
            ("unix:/run/disagg/fm.sock", "unix:/run/disagg/fm.sock"),
        ],
    )
    def test_accepted(self, address: str, target: str) -> None:
        assert parse_listener(address).target == target

    @pytest.mark.parametrize(
        "address",
        ["0.0.0.0:50051", "[::]:50051", "10.1.2.3:1", "example.org:50051"],
    )
    def test_remote_needs_allow_remote(self, address: str) -> None:
        with pytest.raises(ConfigError, match="--allow-remote") as info:
            parse_listener(address)
        assert info.value.field == "listen"
        assert parse_listener(address, allow_remote=True).port > 0

    @pytest.mark.parametrize(
        "address", ["50051", "127.0.0.1", "127.0.0.1:x", "127.0.0.1:70000", "::1:5", "unix:relative.sock", ":5"]
    )
    def test_malformed(self, address: str) -> None:
        with pytest.raises(ConfigError):
            parse_listener(address)

    @pytest.mark.parametrize("port", ["²", "١٢٣", "\uff15\uff10\uff10\uff15\uff11"])  # the last: fullwidth 50051
    def test_a_port_in_other_digits(self, port: str) -> None:
        """`str.isdigit` took them: ``²`` then failed ``int`` with a bare ValueError, and ``١٢٣`` was read as port
        123 while gRPC was given the characters as written."""
        with pytest.raises(ConfigError, match="expected host:port") as info:
            parse_listener(f"127.0.0.1:{port}")
        assert info.value.field == "listen"

    @pytest.mark.parametrize("address", ["http://127.0.0.1:50051", "grpc://localhost:50051", "dns:///[::1]:5"])
    def test_a_url(self, address: str) -> None:
        """Its scheme's colon was taken for an IPv6 address's: "write an IPv6 address in brackets"."""
        with pytest.raises(ConfigError, match="give host:port or unix:/path/to/socket, not a URL") as info:
            parse_listener(address)
        assert info.value.field == "listen"

    def test_unix_path_too_long(self) -> None:
        with pytest.raises(ConfigError, match="at most 107 bytes"):
            parse_listener("unix:/" + "d" * 120)

    @pytest.mark.usefixtures("front_end")
    def test_parent_created_and_stale_socket_replaced(self, tmp_path: Path) -> None:
        sock = tmp_path / "run" / "disagg" / "fm.sock"
        sock.parent.mkdir(parents=True)
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(sock))
        stale.close()  # the file stays: a server that died
        with serving(sock) as served:
            assert served.stub.ListPools(fm.ListPoolsRequest()).kinds
        with serving(tmp_path / "new" / "dir" / "fm.sock") as served:
            assert served.stub.ListPools(fm.ListPoolsRequest()).kinds

    @pytest.mark.parametrize(("umask", "socket_mode"), [(0o000, 0o660), (0o022, 0o640), (0o077, 0o600)])
    def test_other_users_cannot_connect(self, tmp_path: Path, umask: int, socket_mode: int, front_end: str) -> None:
        """The socket and the directories made for it followed the umask alone: under umask 000 both were 0o777,
        and any local user could compose and decompose through the unauthenticated channel."""
        sock = tmp_path / "made" / "fm.sock"
        server = started_under_umask(sock, umask, front_end)
        try:
            assert stat.S_IMODE(sock.stat().st_mode) == socket_mode
            assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o750 & ~umask
        finally:
            server.stop(0)

    @pytest.mark.usefixtures("front_end")
    @pytest.mark.inline_only("it patches grpc.aio's Server in this process, where a process front end binds none")
    def test_no_moment_open_to_other_users(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """grpcio binds and listens as the port is added, before the server starts; the permissions were taken
        off after that, and a connection another user made in between was served once the server started."""
        sock = tmp_path / "fm.sock"
        seen: list[int] = []
        add = grpc.aio._server.Server.add_insecure_port

        def add_and_look(self: grpc.aio.Server, address: str) -> int:
            port = add(self, address)
            seen.append(stat.S_IMODE(sock.stat().st_mode))  # the moment a connection could come
            return port

        monkeypatch.setattr(grpc.aio._server.Server, "add_insecure_port", add_and_look)
        server = started_under_umask(sock, 0)
        try:
            assert len(seen) == 1 and seen[0] & 0o077 == 0, oct(seen[0])
            assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        finally:
            server.stop(0)

    def test_live_socket_is_refused(self, tmp_path: Path, front_end: str) -> None:
        sock = socket_path(tmp_path)
        with serving(sock), pytest.raises(ConfigError, match="another server is already listening"):
            FabricManagerServer(FabricComposer(rack()), [f"unix:{sock}"], front_end=front_end).start()

    def test_other_file_is_refused(self, tmp_path: Path, front_end: str) -> None:
        path = socket_path(tmp_path)
        path.write_text("not a socket")
        with pytest.raises(ConfigError, match="not a socket"):
            FabricManagerServer(FabricComposer(rack()), [f"unix:{path}"], front_end=front_end).start()
        assert path.read_text() == "not a socket"

    def test_port_in_use_is_refused(self, front_end: str) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(ConfigError, match="cannot listen"):
                FabricManagerServer(FabricComposer(rack()), [f"127.0.0.1:{port}"], front_end=front_end).start()

    def test_tcp_port_zero_reports_the_chosen_port(self, front_end: str) -> None:
        server = FabricManagerServer(FabricComposer(rack(), store=MemoryStore()), ["127.0.0.1:0"], front_end=front_end)
        try:
            (address,) = server.start()
            host, port = address.rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            channel = guarded_channel(address)
            try:
                assert health_of(channel) == SERVING
            finally:
                channel.close()
        finally:
            server.stop(0)

    def test_no_listener(self) -> None:
        with pytest.raises(ConfigError, match="no address to listen on"):
            FabricManagerServer(FabricComposer(rack()), [])

    def test_a_listener_given_twice(self, tmp_path: Path) -> None:
        """Refused before anything is bound: the second bind failed after the first had made its socket file,
        which was then left behind."""
        path = tmp_path / "fm.sock"
        with pytest.raises(ConfigError, match="given twice"):
            FabricManagerServer(FabricComposer(rack()), [f"unix:{path}", f"unix:{path}"])
        assert not path.exists()
        FabricManagerServer(FabricComposer(rack()), ["127.0.0.1:0", "127.0.0.1:0"])  # two ports the system picks


class _FullDisk:
    """Stands in for a SQLite connection whose disk filled up: every statement of a commit fails."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.startswith(("INSERT", "REPLACE", "DELETE", "UPDATE")):
            raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *args)

    def close(self) -> None:
        self._db.close()


def compose(channel: grpc.Channel) -> fm.ComposeResponse:
    request = fm.ComposeRequest(
        name="late", resources=[fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)], mode=fm.COMPOSE_MODE_APPLY
    )
    response: fm.ComposeResponse = fm_grpc.FabricManagerServiceStub(channel).Compose(request, timeout=10)
    return response


class TestLedgerFailure:
    def test_a_ledger_that_cannot_be_written_stops_the_server(self, tmp_path: Path, front_end: str) -> None:
        """Once a commit fails the ledger refuses every write, and what callers were told may no longer be what
        the disk holds: the server stops serving and says why (for its supervisor to restart it, which recovers
        from the disk and the hardware) instead of serving on with compositions stuck half-made."""
        store = SqliteStore(tmp_path / "ledger.db")
        failed: list[str] = []
        stopped = threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=store),
            ["127.0.0.1:0"],
            tick_s=0.5,
            on_failed=lambda why: (failed.append(why), stopped.set()),
            front_end=front_end,
        )
        server.start()
        try:
            channel = grpc.insecure_channel(server.addresses[0])
            store._db = _FullDisk(store._db)  # type: ignore[assignment]
            with pytest.raises(grpc.RpcError) as info:
                compose(channel)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE and "disk is full" in (info.value.details() or "")
            # The call that met the failure says, as every later one, that this server does not serve: a client
            # of several replicas retries it until its deadline, for another to answer.
            assert answered_not_serving(from_rpc_error(info.value)), "the call that met the failure lacks the mark"
            with pytest.raises(grpc.RpcError) as retried:  # at once, before the server's next tick
                compose(channel)
            assert retried.value.code() is grpc.StatusCode.UNAVAILABLE, "a retry was told the name is taken"
            assert answered_not_serving(from_rpc_error(retried.value))
            assert stopped.wait(5), "the server went on serving"
            assert "disk is full" in failed[0]
            assert health_of(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                fm_grpc.FabricManagerServiceStub(channel).ListCompositions(fm.ListCompositionsRequest(), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "must be restarted" in (refused.value.details() or "")
            channel.close()
        finally:
            server.stop(0)
