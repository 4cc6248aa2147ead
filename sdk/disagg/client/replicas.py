"""Addresses of several fabric-manager replicas, one of which leads: a channel that sends only to the one that
reports SERVING.

The replicas that do not lead answer health NOT_SERVING. gRPC's own client-side health checking (the
``healthCheckConfig`` of the service config) watches every replica's health and balances, round robin, over
those that serve, so the client follows the lead from one replica to the next without a call of its own.
Clients in other languages get the same from the same service config.
"""

from __future__ import annotations

import ipaddress
import json

from disagg.errors import InvalidRequestError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.wire.sockets import MAX_PORT, port_from_text, unix_path_refusal

SERVICE = fm.DESCRIPTOR.services_by_name["FabricManagerService"].full_name
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": SERVICE},
        "methodConfig": [{"name": [{"service": SERVICE}], "waitForReady": True}],
    }
)
"""Round robin over the replicas that report SERVING. A call made while none does (a standby is taking over
from a dead leader: its lease has to run out first) waits for one up to its deadline instead of failing at
once, so that a client rides through a takeover."""


KEEPALIVE_S = 2.0
"""How often the client pings a connection while a call is open on it, by default (``keepalive_s``). Each ping is
answered within `PING_TIMEOUT_S` or the connection is dropped: a replica that stops answering without closing its
connections (a paused or hung process, a host gone without a reset) is dropped within about 4 s. Its health watch,
a call open on the connection all along, would otherwise still say SERVING, and calls sent to it would wait out
their deadlines while another replica leads; with one address, a watch would wait forever. The fabric manager's
server accepts pings this often (`disagg.server.runtime`); a server or proxy of gRPC's default policy takes one in
5 minutes, and answers more with GOAWAY (too_many_pings) once a call has been open for 6 s."""
PING_TIMEOUT_S = 2.0


def keepalive(seconds: float | None) -> tuple[tuple[str, int], ...]:
    """The channel options of pings every ``seconds`` while a call is open, never on an idle connection (which a
    server of gRPC's default policy answers with GOAWAY at the third ping); None sends none."""
    if seconds is None:
        return ()
    ping_ms, answer_ms = round(seconds * 1000), round(PING_TIMEOUT_S * 1000)
    return (
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", answer_ms),
        ("grpc.http2.ping_timeout_ms", answer_ms),  # what gRPC's core enforces now, rather than the keepalive timeout
        ("grpc.http2.min_time_between_pings_ms", ping_ms),  # or pings without data go 5 minutes apart
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    )


KEEPALIVE = keepalive(KEEPALIVE_S)
"""The default pings' channel options."""


SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix-abstract:", "vsock:", "xds:", "google-c2p:")
"""gRPC's name schemes other than ``unix:`` taken as they are (``dns:///host:port``, ``unix-abstract:name``):
gRPC judges what follows them. Another ``SCHEME://`` (``http://``, ``grpc://``) is refused: gRPC looked the whole
URL up as a host name, which read as a server that is down."""


def replica_target(address: str) -> tuple[str, tuple[tuple[str, str | int], ...]]:
    """The channel target and options for ``address``: one address as it is; ``IP:PORT,IP:PORT,...`` as a
    health-checked round-robin over the replicas (the client adds its pings, `keepalive`, to either). Raises
    `InvalidRequestError` for a list that names hosts rather than IP addresses (gRPC resolves a list of literal
    addresses only)."""
    if "," not in address:
        if address.startswith("unix:"):
            _check_unix(address)
        elif "://" in address and not address.lower().startswith(SCHEMES):  # gRPC takes a scheme in any case
            raise InvalidRequestError(
                f"{address!r}: give HOST:PORT or unix:/path/to/socket, not a URL", field="address"
            )
        elif ":" in address and "://" not in address and not address.startswith(SCHEMES):
            host, _, port = address.rpartition(":")  # HOST:PORT: gRPC would take a missing or bad port as 443
            if port_from_text(port) is None:
                raise InvalidRequestError(f"{address!r}: a port is 0 to {MAX_PORT}", field="address")
            _check_host(address, host)
        elif ":" not in address:
            raise InvalidRequestError(f"{address!r}: give HOST:PORT or unix:/path/to/socket", field="address")
        return address, ()
    hosts: list[str] = []
    family = ""
    for part in address.split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if not sep or port_from_text(port) is None or ip is None:
            raise InvalidRequestError(
                f"{part!r} in {address!r}: a list of replicas is IP:PORT,IP:PORT,... (literal addresses)",
                field="address",
            )
        this = "ipv4" if ip.version == 4 else "ipv6"
        if family and this != family:
            raise InvalidRequestError(f"{address!r} mixes IPv4 and IPv6 replicas", field="address")
        family = this
        hosts.append(f"{host}:{port}" if ip.version == 4 else f"[{host}]:{port}")
    return f"{family}:{','.join(hosts)}", (("grpc.service_config", SERVICE_CONFIG),)


def _check_unix(address: str) -> None:
    """``unix:PATH`` names a socket; ``unix://HOST/PATH`` names none (gRPC takes no authority there and fails
    when the channel is made, which would read as a server that is down), nor does an empty path."""
    path = address[len("unix:") :]
    if not path or (path.startswith("//") and not path.startswith("///")):
        raise InvalidRequestError(
            f"{address!r}: give unix:/absolute/path, unix:///absolute/path or unix:relative/path", field="address"
        )
    refused = unix_path_refusal(path)
    if refused:  # a fabric manager refuses to listen there, and the channel would reach another path
        raise InvalidRequestError(f"{address!r}: {refused}", field="address")


def _check_host(address: str, host: str) -> None:
    """The host of ``HOST:PORT``: present, and an IPv6 address in whole brackets. gRPC would otherwise fail to
    resolve it, which would read as a server that is down rather than an address mistyped."""
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if not bare or "[" in bare or "]" in bare or (":" in bare and not bracketed):
        raise InvalidRequestError(
            f"{address!r}: give HOST:PORT, with an IPv6 host in brackets ([::1]:50051)", field="address"
        )
