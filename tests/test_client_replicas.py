"""A client given several replicas sends only to the one that reports SERVING, and follows the lead when it
moves; a list of replicas that gRPC cannot resolve is refused with a clear error."""

from __future__ import annotations

import time

import pytest
from composer_helpers import rack
from disagg.client import FabricManagerClient
from disagg.client.replicas import SERVICE_CONFIG, replica_target
from disagg.composer import FabricComposer
from disagg.errors import InvalidRequestError
from disagg.requestlang import parse_request
from disagg.server import FabricManagerServer
from disagg.server.servicer import STANDBY
from disagg.store import MemoryStore
from grpc_health.v1 import health_pb2


class TestReplicaTarget:
    """One address is used as it is; a list of IP:PORT becomes a health-checked round robin."""

    def test_one_address(self) -> None:
        assert replica_target("unix:/run/disagg.sock") == ("unix:/run/disagg.sock", ())
        assert replica_target("127.0.0.1:50051") == ("127.0.0.1:50051", ())

    def test_a_list(self) -> None:
        assert replica_target("127.0.0.1:1, 127.0.0.2:2") == (
            "ipv4:127.0.0.1:1,127.0.0.2:2",
            (("grpc.service_config", SERVICE_CONFIG),),
        )
        assert replica_target("[::1]:1,[::1]:2")[0] == "ipv6:[::1]:1,[::1]:2"

    @pytest.mark.parametrize(
        ("address", "says"),
        [
            ("fm-a:50051,fm-b:50051", "literal addresses"),
            ("127.0.0.1:1,127.0.0.1", "literal addresses"),
            ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
        ],
    )
    def test_mistakes(self, address: str, says: str) -> None:
        with pytest.raises(InvalidRequestError, match=says):
            FabricManagerClient(address)


class TestFollowTheLead:
    """Calls go to the serving replica only, and to the other once it serves and the first does not."""

    def test_calls_follow_serving(self) -> None:
        servers = [FabricManagerServer(FabricComposer(rack(), store=MemoryStore()), ["127.0.0.1:0"]) for _ in "ab"]
        for server in servers:
            server.start()
        a, b = servers
        try:
            a.servicer.mark_unready(STANDBY)
            for service in ("", "disagg.fabric.v1.FabricManagerService"):
                a.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            b.composer.compose(parse_request("on-b", ["gpu x1"]))
            a.composer.compose(parse_request("on-a", ["gpu x1"]))
            with FabricManagerClient(",".join(s.addresses[0] for s in servers), timeout_s=5) as client:
                assert {c.name for _ in range(6) for c in client.compositions()} == {"on-b"}
                for service in ("", "disagg.fabric.v1.FabricManagerService"):
                    b.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
                    a.health.set(service, health_pb2.HealthCheckResponse.SERVING)
                a.servicer.mark_ready()
                b.servicer.mark_unready(STANDBY)
                deadline = time.monotonic() + 5
                names: set[str] = set()
                while time.monotonic() < deadline and names != {"on-a"}:
                    names = {c.name for c in client.compositions()}
                    time.sleep(0.05)
                assert names == {"on-a"}
        finally:
            for server in servers:
                server.stop(0)
