"""What the composition commands drive: the local composer, or a remote fabric manager through the client.

Both offer the methods the commands call under the same names (`FabricManagerClient` mirrors
`FabricComposer`), so each command is written once. `--server ADDRESS` (else ``$DISAGG_SERVER``) picks the
remote one; an explicit ``--config`` wins over ``$DISAGG_SERVER``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, Self

from disagg.client import FabricManagerClient
from disagg.client.replicas import replica_target
from disagg.composer import KindUsage, PoolUsage
from disagg.errors import InvalidRequestError, NotFoundError
from disagg.interfaces import ComposeResult
from disagg.model import (
    ComposeMode,
    Composition,
    CompositionRequest,
    Device,
    DeviceKind,
    Health,
    Reservation,
    ResourceRequest,
    Topology,
)
from disagg.wire.fabric import check_id

SERVER_ENV = "DISAGG_SERVER"
REMOTE_COMMANDS = frozenset(
    {
        "compose",
        "recompose",
        "ls",
        "decompose",
        "reservations",
        "apply",
        "release",
        "devices",
        "topology",
        "cordon",
        "uncordon",
    }
)
"""The commands that can drive a remote fabric manager; the others always run locally."""


class Backend(Protocol):
    """The part of `FabricComposer` the commands use; a context manager that starts and closes it."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...

    def topologies(self) -> Sequence[Topology]: ...

    def usage(self) -> tuple[list[KindUsage], list[PoolUsage]]: ...

    def devices(self) -> Sequence[Device]: ...

    def owner_of(self, device_id: str) -> str | None: ...

    def is_cordoned(self, device_id: str) -> bool: ...

    def cordon(self, device_id: str) -> Device: ...

    def uncordon(self, device_id: str) -> Device: ...

    def compose(
        self,
        request: CompositionRequest,
        mode: ComposeMode = ...,
        *,
        reservation_ttl_s: float = ...,
        request_id: str | None = ...,
    ) -> ComposeResult: ...

    def recompose(
        self,
        composition_id: str,
        *,
        add: Sequence[ResourceRequest] = ...,
        remove: Sequence[str] = ...,
        expected_etag: str | None = ...,
        request_id: str | None = ...,
    ) -> Composition: ...

    def find(self, key: str) -> Composition: ...

    def decompose(self, composition_id: str) -> None: ...

    def compositions(self) -> Sequence[Composition]: ...

    def reservations(self) -> Sequence[Reservation]: ...

    def apply_reservation(self, reservation_id: str, *, request_id: str | None = ...) -> Composition: ...

    def release_reservation(self, reservation_id: str) -> None: ...


class RemoteBackend(FabricManagerClient):
    """The client, plus what the commands expect of a composer: `find`, and `owner_of` and `is_cordoned`
    answered from the last `devices` listing (one call for a whole table instead of one per device)."""

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s=timeout_s)
        self._holders: dict[str, str | None] = {}
        self._cordoned: dict[str, bool] = {}

    def devices(
        self,
        *,
        kind: DeviceKind | None = None,
        fabric: str | None = None,
        health: Health | None = None,
        free_only: bool = False,
    ) -> list[Device]:
        statuses = self.device_statuses(kind=kind, fabric=fabric, health=health, free_only=free_only)
        self._holders.update((s.device.id, s.held_by) for s in statuses)
        self._cordoned.update((s.device.id, s.cordoned) for s in statuses)
        return [s.device for s in statuses]

    def owner_of(self, device_id: str) -> str | None:
        if device_id in self._holders:
            return self._holders[device_id]
        return super().owner_of(device_id)

    def is_cordoned(self, device_id: str) -> bool:
        if device_id in self._cordoned:
            return self._cordoned[device_id]
        return super().is_cordoned(device_id)

    def cordon(self, device_id: str) -> Device:
        """The client's, and `is_cordoned` then answers from what it did, not from the listing before it."""
        device = super().cordon(device_id)
        self._cordoned[device_id] = True
        return device

    def uncordon(self, device_id: str) -> Device:
        """The client's, and `is_cordoned` then answers from what it did, not from the listing before it."""
        device = super().uncordon(device_id)
        self._cordoned[device_id] = False
        return device

    def find(self, key: str) -> Composition:
        """As the composer's: a key that cannot be an id names no composition (the server refuses it as invalid
        input, which changed the CLI's exit code, and broke ``decompose --ignore-missing``, against a server)."""
        try:
            return self.get(key)
        except InvalidRequestError:
            raise NotFoundError("composition", key) from None

    def recompose(self, composition_id: str, **given: Any) -> Composition:
        """As the composer's: a key that cannot be an id names no composition (the server refused ``recompose 'old
        job'`` as invalid input, exit 2, naming its field ``id``, where the local composer finds none, exit 4)."""
        try:
            check_id(composition_id, "composition_id")
        except InvalidRequestError:
            raise NotFoundError("composition", composition_id) from None
        return super().recompose(composition_id, **given)

    def apply_reservation(self, reservation_id: str, *, request_id: str | None = None) -> Composition:
        """As the composer's: an id that cannot be one names no reservation (the server refuses it as invalid
        input, exit 2, where the local composer finds no such reservation, exit 4)."""
        try:
            check_id(reservation_id, "reservation_id")
        except InvalidRequestError:
            raise NotFoundError(
                "reservation", reservation_id, f"reservation {reservation_id!r} expired, was released or never existed"
            ) from None
        return super().apply_reservation(reservation_id, request_id=request_id)


_URL = re.compile(r"(?:https?|grpcs?)://", flags=re.IGNORECASE)
"""A web or gRPC URL: gRPC takes neither scheme, and would report a failed name lookup, as if the server were down."""


def server_address(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str | None:
    """The fabric manager to drive: ``--server``, else ``$DISAGG_SERVER`` unless ``--config`` was given;
    None to compose locally."""
    env = os.environ if environ is None else environ
    explicit: str | None = getattr(args, "server", None)
    if explicit is not None:
        if not explicit.strip():
            raise InvalidRequestError("--server needs an address such as unix:/run/disagg.sock", field="server")
        if getattr(args, "config", None) is not None:
            raise InvalidRequestError("give --server or --config, not both", field="server")
        return _checked(explicit, "--server")
    if getattr(args, "config", None) is not None:  # "" too: `load_config` refuses it, never $DISAGG_SERVER
        return None
    address = env.get(SERVER_ENV) or None
    return None if address is None else _checked(address, f"${SERVER_ENV}")


def _checked(address: str, where: str) -> str:
    """Refuse an address that cannot name a server as bad input (exit 2), not as a server that is down (exit 1)."""
    if address.rstrip("/") == "unix:":
        raise InvalidRequestError(f"{where} {address!r}: give the socket's path, unix:/path/to/socket", field="server")
    if _URL.match(address):
        raise InvalidRequestError(
            f"{where} {address!r}: give HOST:PORT or unix:/path/to/socket, not a URL", field="server"
        )
    try:
        replica_target(address)  # what the client will refuse, said of the option or variable that gave it
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where} {exc.message}", field="server") from None
    return address
