"""The server's event loop: uvloop's by default (a dependency), asyncio's when ``$DISAGG_EVENT_LOOP`` asks, and a
clear refusal for anything else, before any fabric is built."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import uvloop
from disagg.cli.main import main
from disagg.errors import ConfigError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.server.loop import EVENT_LOOP_ENV, event_loop_factory
from server_helpers import compose_request, serving, socket_path


def _loop_of(served_server: object) -> asyncio.AbstractEventLoop:
    loop: asyncio.AbstractEventLoop = served_server._loop.loop  # type: ignore[attr-defined]
    return loop


class TestEventLoop:
    def test_uvloop_by_default(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
        with serving(socket_path(tmp_path)) as served:
            assert isinstance(_loop_of(served.server), uvloop.Loop)
            reply = served.stub.Compose(compose_request("on-uvloop"), timeout=10)
            assert reply.composition.state == fm.COMPOSITION_STATE_COMPOSED

    def test_asyncio_when_asked(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
        with serving(socket_path(tmp_path)) as served:
            loop = _loop_of(served.server)
            assert not isinstance(loop, uvloop.Loop)
            assert type(loop).__module__.startswith("asyncio")
            reply = served.stub.Compose(compose_request("on-asyncio"), timeout=10)
            assert reply.composition.state == fm.COMPOSITION_STATE_COMPOSED

    @pytest.mark.parametrize("value", ["uv", "UVLOOP", "trio", " asyncio"])
    def test_another_value_is_refused(self, value: str) -> None:
        with pytest.raises(ConfigError, match=EVENT_LOOP_ENV) as refused:
            event_loop_factory({EVENT_LOOP_ENV: value})
        assert refused.value.field == EVENT_LOOP_ENV
        assert "uvloop or asyncio" in refused.value.message

    def test_uvloop_asked_for_and_missing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: importing it raises ImportError
        with pytest.raises(ConfigError, match="pip install uvloop"):
            event_loop_factory({EVENT_LOOP_ENV: "uvloop"})
        assert event_loop_factory({}) is asyncio.new_event_loop  # not asked for: asyncio's serves

    def test_serve_refuses_before_building_fabrics(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv(EVENT_LOOP_ENV, "tokio")
        monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
        assert main(["serve", "--listen", f"unix:{tmp_path / 'fm.sock'}"]) == 2
        assert f"${EVENT_LOOP_ENV} is 'tokio'" in capsys.readouterr().err
        assert not (tmp_path / "state").exists()  # no ledger opened, no fabric built
