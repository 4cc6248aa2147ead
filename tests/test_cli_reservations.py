"""`disagg reservations`, `apply` and `release`: a plan held by `compose --reserve` is listed, composed or given
back from the command line, locally and with --server alike; `compose --reserve` made one that no command could
see, apply or release, and its devices and name stayed held until it expired (up to a day)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from disagg import codec
from disagg.cli.backend import RemoteBackend
from disagg.cli.main import main
from disagg.composer.composer import FabricComposer
from server_helpers import Served, serving


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def reserve(capsys: pytest.CaptureFixture[str], where: list[str], name: str = "train", ttl: str = "600") -> str:
    code, out, err = cli(capsys, *where, "compose", name, "gpu x2 same-switch", "--reserve", ttl, "--json")
    assert code == 0, err
    reservation_id: str = json.loads(out)["reservation"]["id"]
    return reservation_id


def listed(capsys: pytest.CaptureFixture[str], where: list[str]) -> list[dict[str, Any]]:
    code, out, err = cli(capsys, *where, "reservations", "--json")
    assert code == 0, err
    found: list[dict[str, Any]] = json.loads(out)
    return found


def holders(capsys: pytest.CaptureFixture[str], where: list[str]) -> set[str]:
    code, out, err = cli(capsys, *where, "devices", "--json")
    assert code == 0, err
    return {d["held_by"] for d in json.loads(out) if d["held_by"]}


class TestListed:
    """`reservations` lists what `compose --reserve` holds, and `ls` says that reservations exist."""

    def test_reservations(self, capsys: pytest.CaptureFixture[str], where: list[str], served: Served | None) -> None:
        rid = reserve(capsys, where)
        (found,) = listed(capsys, where)
        assert found["id"] == rid and found["request"]["name"] == "train"
        assert len(found["plan"]["devices"]) == 2
        if served is not None:  # the composer's own reservation, field for field
            assert [found] == codec.to_public_data(served.composer.reservations())
        code, out, err = cli(capsys, *where, "reservations")
        assert code == 0, err
        (row,) = [line.split() for line in out.splitlines() if rid in line]
        assert row[:4] == [rid, "train", found["plan"]["host"], "2"]

    def test_ls_shows_them_and_its_json_is_unchanged(
        self, capsys: pytest.CaptureFixture[str], where: list[str]
    ) -> None:
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "ls")
        assert code == 0, err
        assert rid in out and "train" in out and "disagg apply" in out
        code, out, err = cli(capsys, *where, "ls", "--json")
        assert (code, json.loads(out)) == (0, [])

    def test_ls_without_reservations_says_nothing_of_them(
        self, capsys: pytest.CaptureFixture[str], where: list[str]
    ) -> None:
        code, out, _ = cli(capsys, *where, "ls")
        assert (code, out) == (0, "  (none)\n")

    def test_none(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        assert listed(capsys, where) == []
        code, out, _ = cli(capsys, *where, "reservations")
        assert (code, out) == (0, "  (none)\n")


class TestApply:
    """`apply` composes a reservation's plan under its name; the reservation is gone and its devices held by the
    composition."""

    def test_apply(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        assert holders(capsys, where) == {rid}
        code, out, err = cli(capsys, *where, "apply", rid)
        assert code == 0, err
        assert out.startswith("composed train (")
        code, out, _ = cli(capsys, *where, "ls", "--json")
        ((comp_id, name, state),) = [(c["id"], c["name"], c["state"]) for c in json.loads(out)]
        assert (name, state) == ("train", "COMPOSED")
        assert holders(capsys, where) == {comp_id}
        assert listed(capsys, where) == []

    def test_json_is_the_composition(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "apply", rid, "--json")
        assert code == 0, err
        comp = json.loads(out)
        assert comp["name"] == "train" and comp["state"] == "COMPOSED" and len(comp["devices"]) == 2

    def test_a_request_id_applies_once(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        first = cli(capsys, *where, "apply", rid, "--request-id", "apply-1", "--json")
        again = cli(capsys, *where, "apply", rid, "--request-id", "apply-1", "--json")
        assert first[0] == again[0] == 0, (first[2], again[2])
        assert json.loads(first[1])["id"] == json.loads(again[1])["id"]


class TestRelease:
    """`release` gives a reservation's devices and name back at once."""

    def test_release(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "release", rid)
        assert (code, out) == (0, f"released {rid}\n"), err
        assert listed(capsys, where) == [] and holders(capsys, where) == set()
        code, _, err = cli(capsys, *where, "compose", "train", "gpu x2 same-switch")
        assert code == 0, err

    def test_json_lists_what_it_released(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        first, second = reserve(capsys, where, "a"), reserve(capsys, where, "b")
        code, out, err = cli(capsys, *where, "release", second, first, "--json")
        assert code == 0, err
        assert json.loads(out) == {"released": [second, first]}
        assert listed(capsys, where) == []

    def test_an_id_given_twice_is_released_once(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        """It was reported released twice, the second time releasing nothing."""
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "release", rid, rid, "--json")
        assert (code, json.loads(out)) == (0, {"released": [rid]}), err


class TestUnknown:
    """An unknown, expired, applied or released reservation is not found (exit 4), and nothing changes."""

    @pytest.mark.parametrize("key", ["r-000000000000", "train", "a b"])
    def test_apply(self, capsys: pytest.CaptureFixture[str], where: list[str], key: str) -> None:
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "apply", key)
        assert (code, out) == (4, "")
        assert err.startswith("disagg: error: ") and "expired, was released or never existed" in err
        assert [r["id"] for r in listed(capsys, where)] == [rid]

    def test_release_refuses_the_whole_command(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "release", rid, "r-nope")
        assert (code, out) == (4, "")
        assert "reservation 'r-nope' not found" in err and "nothing was released" in err
        assert [r["id"] for r in listed(capsys, where)] == [rid]

    def test_release_ignore_missing(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, "release", "r-nope", rid, "--ignore-missing")
        assert (code, out) == (0, f"released {rid}\n"), err
        assert listed(capsys, where) == []

    def test_expired(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where, ttl="0.2")
        deadline = time.monotonic() + 30
        while listed(capsys, where):
            assert time.monotonic() < deadline, "the reservation never expired"
            time.sleep(0.05)
        assert cli(capsys, *where, "apply", rid)[0] == 4
        assert cli(capsys, *where, "release", rid)[0] == 4

    def test_applied(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        rid = reserve(capsys, where)
        assert cli(capsys, *where, "apply", rid)[0] == 0
        code, _, err = cli(capsys, *where, "release", rid)
        assert code == 4 and "not found" in err

    def test_decompose_names_the_reservation(self, capsys: pytest.CaptureFixture[str], where: list[str]) -> None:
        """`decompose NAME` of a name a reservation holds said only that no composition had it."""
        rid = reserve(capsys, where)
        for key, what in (("train", f"'train' is reserved as {rid}"), (rid, f"'{rid}' is a reservation")):
            code, out, err = cli(capsys, *where, "decompose", key)
            assert (code, out) == (4, "")
            assert what in err and f"disagg apply {rid} composes it, disagg release {rid} gives it back" in err
        assert [r["id"] for r in listed(capsys, where)] == [rid]

    @pytest.mark.parametrize("command", ["apply", "release"])
    def test_apply_and_release_name_the_reservation_a_name_holds(
        self, capsys: pytest.CaptureFixture[str], where: list[str], command: str
    ) -> None:
        """`apply NAME` and `release NAME` of a live reservation's name said only that it expired, was released or
        never existed; they take its id, and the error names it as `decompose NAME` does."""
        rid = reserve(capsys, where)
        code, out, err = cli(capsys, *where, command, "train")
        assert (code, out) == (4, "")
        assert (
            f"'train' is reserved as {rid}: disagg apply {rid} composes it, disagg release {rid} gives it back" in err
        )
        assert [r["id"] for r in listed(capsys, where)] == [rid]


class TestInterrupted:
    """Ctrl-C during an apply says what becomes of it, as for compose."""

    def test_a_remote_apply_names_the_request_id(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        def interrupted(self: object, *args: object, **kw: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(RemoteBackend, "apply_reservation", interrupted)
        with serving(tmp_path / "fm.sock") as running:
            code, out, err = cli(capsys, "--server", running.address, "apply", "r-1", "--request-id", "a1")
        assert (code, out) == (130, "")
        assert err.startswith("disagg: interrupted: apply r-1: the fabric manager may still make the change")
        assert "--request-id a1 to get its outcome" in err

    def test_a_release_says_what_is_given_back(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: list[str], served: object
    ) -> None:
        """`release A B` interrupted after A was given back: the hint says which were, and how to finish."""
        first, second = reserve(capsys, where, "a"), reserve(capsys, where, "b")
        owner: Any = RemoteBackend if served is not None else FabricComposer
        release = owner.release_reservation

        def interrupted(self: object, reservation_id: str) -> None:
            if reservation_id == second:
                raise KeyboardInterrupt
            release(self, reservation_id)

        monkeypatch.setattr(owner, "release_reservation", interrupted)
        code, out, err = cli(capsys, *where, "release", first, second)
        assert (code, out) == (130, f"released {first}\n")
        assert err.startswith(f"disagg: interrupted: release {first} {second}: those printed as released are given")
        assert "the same command with --ignore-missing to release the rest" in err
        code, out, err = cli(capsys, *where, "release", second, "--json")
        assert (code, out) == (130, "")  # nothing printed: it says so
        assert err.startswith(f"disagg: interrupted: release {second}: some may be given back already")
        monkeypatch.setattr(owner, "release_reservation", release)
        assert [r["id"] for r in listed(capsys, where)] == [second]
        code, out, err = cli(capsys, *where, "release", first, second, "--ignore-missing")
        assert (code, out, err) == (0, f"released {second}\n", "")
        assert listed(capsys, where) == []
