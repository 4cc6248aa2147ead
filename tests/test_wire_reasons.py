"""Every reason a status may carry is rebuilt as its own class, with its own ``retryable``, by a process that
imported only the client: not as whatever class of that kind the process happened to import."""

from __future__ import annotations

import base64
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import disagg
import disagg_cxl_switch
import disagg_qemu_cxl
import disagg_sim
import grpc
import pytest
from disagg.errors import DisaggError
from disagg.wire.errors import build, from_rpc_error, to_status

PACKAGES = (disagg, disagg_sim, disagg_cxl_switch, disagg_qemu_cxl)

CLIENT = """
import base64, json, sys
import grpc
import disagg.client
from disagg.wire.errors import from_rpc_error

class Failed(grpc.RpcError):
    def __init__(self, code, details, trailers):
        self._code, self._details, self._trailers = code, details, trailers
    def code(self):
        return self._code
    def details(self):
        return self._details
    def trailing_metadata(self):
        return self._trailers

out = []
for code, details, trailers in json.load(sys.stdin):
    trailers = tuple((k, base64.b64decode(v)) for k, v in trailers)
    error = from_rpc_error(Failed(grpc.StatusCode[code], details, trailers))
    out.append([type(error).__module__, type(error).__qualname__, error.retryable])
json.dump({"rebuilt": out, "modules": sorted(sys.modules)}, sys.stdout)
"""


class Failed(grpc.RpcError):  # type: ignore[misc]
    """A call that ended with a status, as a client sees it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: Any) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers


def _all_modules() -> Iterator[str]:
    for package in PACKAGES:
        yield package.__name__
        for found in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            yield found.name


def _subclasses(cls: type[DisaggError]) -> Iterator[type[DisaggError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def defined_errors() -> list[type[DisaggError]]:
    """Every `DisaggError` class the SDK and the plugins define, each of their modules imported."""
    for name in _all_modules():
        importlib.import_module(name)
    prefixes = tuple(p.__name__ for p in PACKAGES)
    found = {c for c in _subclasses(DisaggError) if c.__module__.split(".")[0] in prefixes}
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def declaring(cls: type[DisaggError]) -> type[DisaggError]:
    """The class that gives ``cls`` its reason: itself, or the nearest base that declares one."""
    return next(c for c in cls.__mro__ if "reason" in vars(c))


def _wire(error: DisaggError) -> list[object]:
    status = to_status(error)
    trailers = [[k, base64.b64encode(v).decode()] for k, v in status.trailing_metadata]
    return [status.code.name, status.details, trailers]


def rebuilt_by_client(errors: list[DisaggError]) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """How a fresh interpreter that imported only `disagg.client` rebuilds the status of each of ``errors``, and
    the modules it had imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT],
        input=json.dumps([_wire(e) for e in errors]),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    answer = json.loads(proc.stdout)
    return [tuple(r) for r in answer["rebuilt"]], answer["modules"]


class TestReasons:
    """A status's reason names one class, which any process rebuilds whatever it imported."""

    def test_each_reason_is_declared_once(self) -> None:
        declared = [c for c in defined_errors() if "reason" in vars(c)]
        reasons = [c.reason for c in declared]
        assert len(reasons) == len(set(reasons)), sorted(reasons)

    def test_a_client_rebuilds_each_reason_as_its_own_class(self) -> None:
        """The etcd ledger's `LeadershipLostError` and `LedgerNotFencedError` came back as the retryable
        `FabricUnavailableError`: a client never imports etcd's module, and its retry policy retried a ledger
        that refuses for good until the deadline."""
        classes = defined_errors()
        rebuilt, modules = rebuilt_by_client([build(c, f"a {c.__name__}") for c in classes])
        expected = [(declaring(c).__module__, declaring(c).__qualname__, declaring(c).retryable) for c in classes]
        assert dict(zip(classes, rebuilt, strict=True)) == dict(zip(classes, expected, strict=True))
        assert "disagg.store.etcd" not in modules and "etcd3gw" not in modules

    def test_a_process_that_imported_everything_rebuilds_each_reason_as_its_own_class(self) -> None:
        """cxl-switch's `CommandFailedError` inherits the reason ``DISAGG_ERROR``: a fabric manager that loaded
        that plugin rebuilt a remote driver's plain `DisaggError` as it, without the opcode it carries."""
        classes = defined_errors()
        statuses = [to_status(build(c, "m")) for c in classes]
        rebuilt = [type(from_rpc_error(Failed(s.code, s.details, s.trailing_metadata))) for s in statuses]
        assert dict(zip(classes, rebuilt, strict=True)) == {c: declaring(c) for c in classes}

    @pytest.mark.parametrize("reason", ["LEADERSHIP_LOST", "LEDGER_NOT_FENCED"])
    def test_the_ledger_s_refusals_are_among_them(self, reason: str) -> None:
        assert reason in {c.reason for c in defined_errors()}
