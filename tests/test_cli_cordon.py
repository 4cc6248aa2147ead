"""`disagg cordon` and `uncordon`: a device is kept out of placement, or offered again (a quarantine lifted), from
the command line, locally and with --server alike; the composer, the service and the client had both, and the
command line answered "invalid choice", while a quarantine's event told the operator to uncordon the device."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import cli_against, disagg_serve
from disagg.cli.backend import RemoteBackend
from disagg.cli.main import main
from disagg.composer import FabricComposer
from disagg.config import build_composer, load_config
from disagg.interfaces import CallContext
from disagg.model import Binding, DeviceKind, EventType
from server_helpers import Served, serving

GPU = "pcie0/gpu-a0"
OTHER = "pcie0/gpu-a1"


@contextlib.contextmanager
def hardware(served: Served | None) -> Iterator[FabricComposer]:
    """The composer over the fabrics the commands drive: the server's, or one on the CLI's own ledger and sim
    state files, closed at the end (the next command opens them again)."""
    if served is not None:
        yield served.composer
        return
    with build_composer(load_config()) as composer:
        yield composer


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def devices(capsys: pytest.CaptureFixture[str], where: list[str]) -> dict[str, dict[str, Any]]:
    code, out, err = cli(capsys, *where, "devices", "--json")
    assert code == 0, err
    return {d["id"]: d for d in json.loads(out)}


def cordoned(capsys: pytest.CaptureFixture[str], where: list[str]) -> set[str]:
    return {i for i, d in devices(capsys, where).items() if d["cordoned"]}


class TestCordon:
    """`cordon` keeps devices out of placement and `uncordon` offers them again; both are idempotent."""

    def test_cordon_then_uncordon(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        code, out, err = cli(capsys, *where, "cordon", GPU, OTHER)
        assert (code, out) == (0, f"cordoned {GPU}\ncordoned {OTHER}\n"), err
        assert cordoned(capsys, where) == {GPU, OTHER}
        code, out, err = cli(capsys, *where, "devices", "--kind", "gpu")
        assert [line.split()[-1] for line in out.splitlines() if line.split()[:1] == [GPU]] == ["yes"]
        code, out, err = cli(capsys, *where, "uncordon", OTHER)
        assert (code, out) == (0, f"uncordoned {OTHER}\n"), err
        assert cordoned(capsys, where) == {GPU}

    def test_idempotent(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        assert cli(capsys, *where, "cordon", GPU)[0] == 0
        code, out, err = cli(capsys, *where, "cordon", GPU, GPU)
        assert (code, out) == (0, f"cordoned {GPU}\n"), err  # once: the second would change nothing
        assert cordoned(capsys, where) == {GPU}
        assert cli(capsys, *where, "uncordon", GPU)[0] == 0
        code, out, err = cli(capsys, *where, "uncordon", GPU)
        assert (code, out) == (0, f"uncordoned {GPU}\n"), err
        assert cordoned(capsys, where) == set()

    def test_a_cordoned_device_is_not_placed(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        gpus = [i for i, d in devices(capsys, where).items() if d["kind"] == DeviceKind.GPU.value]
        assert cli(capsys, *where, "cordon", *gpus)[0] == 0
        code, _, err = cli(capsys, *where, "compose", "job", "gpu x1")
        assert code == 3, err
        assert cli(capsys, *where, "uncordon", GPU)[0] == 0
        code, out, err = cli(capsys, *where, "compose", "job", "gpu x1", "--json")
        assert code == 0, err
        assert [d["device"] for d in json.loads(out)["composition"]["devices"]] == [GPU]

    def test_json(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        code, out, err = cli(capsys, *where, "cordon", OTHER, GPU, "--json")
        assert (code, json.loads(out)) == (0, {"cordoned": [OTHER, GPU]}), err
        code, out, err = cli(capsys, *where, "uncordon", GPU, "--json")
        assert (code, json.loads(out)) == (0, {"uncordoned": [GPU]}), err
        assert cordoned(capsys, where) == {OTHER}


class TestUnknown:
    """A mistyped id refuses the whole command (exit 4, as `decompose` of an unknown name), and nothing changes."""

    @pytest.mark.parametrize("ghost", ["pcie0/gpu-z9", "gpu-a0", "a b"])
    def test_cordon(self, capsys: pytest.CaptureFixture[str], where: list[str], ghost: str) -> None:
        code, out, err = cli(capsys, *where, "cordon", GPU, ghost, OTHER)
        assert (code, out) == (4, "")
        assert err.startswith("disagg: error: ") and f"device {ghost!r} not found; nothing was cordoned" in err
        assert cordoned(capsys, where) == set()

    def test_uncordon(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        assert cli(capsys, *where, "cordon", GPU, OTHER)[0] == 0
        code, out, err = cli(capsys, *where, "uncordon", GPU, "ghost", OTHER, "--json")
        assert (code, out) == (4, "")
        assert "device 'ghost' not found; nothing was uncordoned" in err
        assert cordoned(capsys, where) == {GPU, OTHER}


class TestQuarantine:
    """`uncordon` lifts the quarantine reconciliation put on a binding the ledger lacks, as its event says to."""

    def test_uncordon_lifts_a_quarantine(
        self, capsys: pytest.CaptureFixture[str], where: list[str], served: Served | None
    ) -> None:
        with hardware(served) as composer:
            pcie = composer.fabrics["pcie0"]
            pcie.bind(GPU, "h1", CallContext(epoch=composer.epoch))  # behind the fabric manager's back
            assert composer.reconcile() >= 1
            assert composer.is_cordoned(GPU)
            quarantined = [e for e in composer.events() if e.type is EventType.BINDING_QUARANTINED]
            assert [e.subject for e in quarantined] == [GPU]
            assert "then uncordon it" in quarantined[0].message
            pcie.unbind(Binding(GPU, "h1"), CallContext(epoch=composer.epoch))  # the operator's own tools
        assert cordoned(capsys, where) == {GPU}
        others = [i for i, d in devices(capsys, where).items() if d["kind"] == "gpu" and i != GPU]
        assert cli(capsys, *where, "cordon", *others)[0] == 0
        assert cli(capsys, *where, "compose", "job", "gpu x1")[0] == 3  # the quarantined GPU is not offered
        code, out, err = cli(capsys, *where, "uncordon", GPU)
        assert (code, out) == (0, f"uncordoned {GPU}\n"), err
        assert cordoned(capsys, where) == set(others)
        code, out, err = cli(capsys, *where, "compose", "job", "gpu x1", "--json")
        assert code == 0, err
        assert [d["device"] for d in json.loads(out)["composition"]["devices"]] == [GPU]


class TestRemoteBackend:
    """What the commands drive with --server answers `is_cordoned` from its own cordons, not the listing before."""

    def test_is_cordoned_after_a_change(self, tmp_path: Path) -> None:
        with serving(tmp_path / "fm.sock") as running, RemoteBackend(running.address) as backend:
            assert not {d.id: backend.is_cordoned(d.id) for d in backend.devices()}[GPU]
            backend.cordon(GPU)
            assert backend.is_cordoned(GPU) and running.composer.is_cordoned(GPU)
            backend.uncordon(GPU)
            assert not backend.is_cordoned(GPU) and not running.composer.is_cordoned(GPU)


class TestInterrupted:
    """Ctrl-C during a cordon says which devices are changed and how to finish, as for release."""

    @pytest.mark.parametrize("command", ["cordon", "uncordon"])
    def test_it_says_what_is_done(
        self,
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        where: list[str],
        served: Served | None,
        command: str,
    ) -> None:
        owner: Any = RemoteBackend if served is not None else FabricComposer
        change = getattr(owner, command)

        def interrupted(self: object, device_id: str) -> object:
            if device_id == OTHER:
                raise KeyboardInterrupt
            return change(self, device_id)

        monkeypatch.setattr(owner, command, interrupted)
        code, out, err = cli(capsys, *where, command, GPU, OTHER)
        assert (code, out) == (130, f"{command}ed {GPU}\n")
        assert err.startswith(f"disagg: interrupted: {command} {GPU} {OTHER}: those printed as {command}ed are")
        assert f"run the same command again to {command} the rest" in err


class TestAgainstDisaggServe:
    """The installed command, as a user runs it, against `disagg serve` in another process."""

    def test_cordon_uncordon(self, tmp_path: Path) -> None:
        with disagg_serve(tmp_path) as address:
            run = cli_against(tmp_path, address)

            def listed() -> set[str]:
                shown = run("devices", "--json")
                assert shown.returncode == 0, shown.stderr
                return {d["id"] for d in json.loads(shown.stdout) if d["cordoned"]}

            done = run("cordon", GPU, OTHER)
            assert (done.returncode, done.stdout) == (0, f"cordoned {GPU}\ncordoned {OTHER}\n"), done.stderr
            assert listed() == {GPU, OTHER}
            missing = run("uncordon", GPU, "ghost")
            assert missing.returncode == 4 and "device 'ghost' not found; nothing was uncordoned" in missing.stderr
            assert listed() == {GPU, OTHER}
            done = run("uncordon", GPU, "--json")
            assert (done.returncode, json.loads(done.stdout)) == (0, {"uncordoned": [GPU]}), done.stderr
            assert listed() == {OTHER}
        assert not (tmp_path / "cli").exists()
