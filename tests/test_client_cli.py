"""`disagg --server`: the composition commands drive a remote fabric manager with the same output and exit codes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_helpers import cli_against, disagg_serve
from disagg import codec
from disagg.cli import main as cli_main
from disagg.cli.backend import RemoteBackend, server_address
from disagg.cli.main import build_parser, main
from disagg.errors import OUTCOME, OUTCOME_UNKNOWN, DeadlineExceededError
from server_helpers import Served, serving


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A fabric manager in this process; the CLI's own state directory is elsewhere, to show it is not used."""
    monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "cli-state"))
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    monkeypatch.delenv("DISAGG_SERVER", raising=False)
    monkeypatch.chdir(tmp_path)
    with serving(tmp_path / "fm.sock") as running:
        yield running


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


class TestRoundTrip:
    """compose, ls, recompose, devices, topology and decompose change and show the server's state, not a local one."""

    def test_round_trip(self, capsys: pytest.CaptureFixture[str], served: Served, tmp_path: Path) -> None:
        s = ["--server", served.address]
        code, out, err = cli(capsys, *s, "compose", "job", "host h2", "gpu x2 model=H200", "cxl-memory 256GiB")
        assert code == 0, err
        assert "composed job" in out and "pcie0/gpu" in out
        assert [c.name for c in served.composer.compositions()] == ["job"]
        code, out, _ = cli(capsys, "ls", "--json", *s)
        assert [(c["name"], c["host"], c["state"]) for c in json.loads(out)] == [("job", "h2", "COMPOSED")]
        code, out, _ = cli(capsys, *s, "ls")
        assert code == 0 and "job" in out and "COMPOSED" in out and "256 GiB" in out
        code, out, err = cli(capsys, *s, "recompose", "job", "--add", "nvme", "--json")
        assert code == 0, err
        assert len(json.loads(out)["devices"]) == 3
        job = served.composer.find("job")
        code, out, _ = cli(capsys, *s, "devices", "--kind", "gpu")
        held = [line for line in out.splitlines() if job.id in line]
        assert code == 0 and len(held) == 2
        served.composer.cordon("pcie0/nic0")
        code, out, _ = cli(capsys, *s, "devices", "--json")
        listed = {d["id"]: d for d in json.loads(out)}
        assert len(listed) == len(served.composer.devices())
        assert {i for i, d in listed.items() if d["held_by"] == job.id} == set(job.device_ids)
        assert [i for i, d in listed.items() if d["cordoned"]] == ["pcie0/nic0"]
        code, out, _ = cli(capsys, *s, "devices", "--kind", "nic")
        assert [line.split()[-1] for line in out.splitlines() if line.split()[:1] == ["pcie0/nic0"]] == ["yes"]
        code, out, _ = cli(capsys, *s, "topology")
        assert "fabric pcie0" in out and "job" in out
        code, out, _ = cli(capsys, *s, "topology", "--json")
        assert {f["fabric"] for f in json.loads(out)["fabrics"]} == {"pcie0", "cxl0"}
        code, out, err = cli(capsys, *s, "decompose", "job")
        assert code == 0 and "decomposed job" in out, err
        assert served.composer.compositions() == []
        assert not (tmp_path / "cli-state").exists()

    def test_server_from_the_environment(
        self, capsys: pytest.CaptureFixture[str], served: Served, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("DISAGG_SERVER", served.address)
        code, out, err = cli(capsys, "compose", "env", "gpu x1", "--json")
        assert code == 0, err
        assert json.loads(out)["composition"]["name"] == "env"
        assert [c.name for c in served.composer.compositions()] == ["env"]

    def test_preview_and_reserve(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        s = ["--server", served.address]
        code, out, _ = cli(capsys, *s, "compose", "p", "gpu x1", "--preview")
        assert code == 0 and "would compose on host" in out
        code, out, _ = cli(capsys, *s, "compose", "r", "gpu x1", "--reserve", "30", "--json")
        reservation = json.loads(out)["reservation"]
        assert code == 0 and reservation["request"]["name"] == "r"
        assert [r.id for r in served.composer.reservations()] == [reservation["id"]]

    def test_same_json_as_local(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        """A composition printed by the remote path is the composer's own, field for field."""
        code, out, _ = cli(capsys, "--server", served.address, "compose", "same", "gpu x1", "--json")
        remote = json.loads(out)["composition"]
        assert code == 0 and remote == codec.to_public_data(served.composer.find("same"))


class TestExitCodes:
    """Remote failures keep the local exit codes and messages; nothing changes on the server."""

    @pytest.mark.parametrize(
        ("args", "code", "message"),
        [
            (("compose", "x", "gpux8"), 2, "unknown device kind"),
            (("compose", "x", "gpu x99"), 3, "99 gpu"),
            (("compose", "x", "host h9", "gpu"), 4, "h9"),
            (("decompose", "nothing"), 4, "composition 'nothing' not found"),
            (("recompose", "nothing", "--add", "gpu"), 4, "not found"),
            (("compose", "x", "gpu", "--reserve", "1000000"), 2, "--reserve 1e+06: the reservation time to live"),
        ],
    )
    def test_exit_codes(
        self,
        capsys: pytest.CaptureFixture[str],
        served: Served,
        args: tuple[str, ...],
        code: int,
        message: str,
    ) -> None:
        got, out, err = cli(capsys, "--server", served.address, *args)
        assert got == code, err
        assert err.startswith("disagg: error: ") and message in err
        assert out == ""
        assert served.composer.compositions() == []

    def test_name_taken(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        assert cli(capsys, "--server", served.address, "compose", "a", "gpu x1")[0] == 0
        code, _, err = cli(capsys, "--server", served.address, "compose", "a", "gpu x1")
        assert code == 5 and "taken" in err
        assert len(served.composer.compositions()) == 1

    def test_stale_etag(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        assert cli(capsys, "--server", served.address, "compose", "e", "gpu x1")[0] == 0
        code, _, err = cli(capsys, "--server", served.address, "recompose", "e", "--add", "gpu", "--etag", 'W/"0"')
        assert code == 5, err

    def test_a_request_id_makes_a_change_once(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        """After a timeout the CLI said to retry with a request id it had no option for: running the recompose
        again added its resources twice."""
        server = ["--server", served.address]
        assert cli(capsys, *server, "compose", "job", "gpu x1", "--request-id", "c-1")[0] == 0
        assert cli(capsys, *server, "compose", "job", "gpu x1", "--request-id", "c-1")[0] == 0
        for _ in range(2):
            assert cli(capsys, *server, "recompose", "job", "--add", "gpu", "--request-id", "grow-1")[0] == 0
        (job,) = served.composer.compositions()
        assert len(job.devices) == 2

    def test_an_unknown_outcome_names_the_option_to_use(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def timed_out(args: argparse.Namespace) -> int:
            metadata = {"request_id": "r-9", OUTCOME: OUTCOME_UNKNOWN}
            raise DeadlineExceededError("Deadline Exceeded; the change may have been made", metadata=metadata)

        monkeypatch.setattr(cli_main, "cmd_recompose", timed_out)
        code, _, err = cli(capsys, "recompose", "job", "--add", "gpu")
        assert code != 0 and "run the same command with --request-id r-9" in err

    def test_timeout(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        """A change slower than 30 s had no way to be waited for from the CLI."""
        assert cli(capsys, "--server", served.address, "--timeout", "90", "ls")[0] == 0
        assert cli(capsys, "ls", "--server", served.address, "--timeout", "0.5")[0] == 0
        for bad in ("nan", "0", "-1"):
            code, _, err = cli(capsys, "--server", served.address, "--timeout", bad, "ls")
            assert code == 2 and "timeout" in err
        code, _, err = cli(capsys, "--timeout", "5", "ls")
        assert code == 2 and "--timeout applies with --server only" in err

    def test_a_timeout_beyond_a_year(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        """--timeout 1e10 made every call fail at once with Deadline Exceeded, as if the server were too slow."""
        for bad in ("31536001", "1e10"):
            code, out, err = cli(capsys, "--server", served.address, "--timeout", bad, "ls")
            assert (code, out) == (2, "") and "the timeout must be at most 31536000 seconds" in err
        assert cli(capsys, "--server", served.address, "--timeout", "31536000", "ls")[0] == 0

    def test_decompose_ignore_missing(self, capsys: pytest.CaptureFixture[str], served: Served) -> None:
        code, _, _ = cli(capsys, "--server", served.address, "decompose", "nothing", "--ignore-missing")
        assert code == 0

    def test_a_name_that_cannot_be_an_id_is_not_found_as_locally(
        self, capsys: pytest.CaptureFixture[str], served: Served
    ) -> None:
        """Against a server a name with a space was invalid input (exit 2) where the local composer says not
        found (exit 4), and ``--ignore-missing`` stopped at it, decomposing nothing."""
        assert cli(capsys, "--server", served.address, "compose", "job", "gpu x1")[0] == 0
        assert cli(capsys, "--server", served.address, "decompose", "old job")[0] == 4
        assert cli(capsys, "--server", served.address, "decompose", "--ignore-missing", "old job", "job")[0] == 0
        assert served.composer.compositions() == []

    @pytest.mark.parametrize("key", ["old job", "j" * 200, "caf\udce9"], ids=["space", "200-characters", "not-utf-8"])
    def test_recompose_of_a_name_that_cannot_be_an_id_is_not_found_as_locally(
        self, capsys: pytest.CaptureFixture[str], served: Served, key: str
    ) -> None:
        """Against a server it was invalid input (exit 2) saying "id: give an id of 1 to 128 printable characters",
        a field the command line has not, where the local composer says not found (exit 4)."""
        for where in ((), ("--server", served.address)):
            code, out, err = cli(capsys, *where, "recompose", key, "--add", "gpu")
            assert (code, out) == (4, ""), (where, err)
            assert err == f"disagg: error: composition {key!r} not found\n", where
        assert served.composer.compositions() == []

    def test_unreachable_server(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        code, out, err = cli(capsys, "--server", f"unix:{tmp_path}/nobody.sock", "ls")
        assert code == 1 and out == ""
        assert "cannot reach the fabric manager" in err and "nobody.sock" in err

    @pytest.mark.parametrize("command", [["compose", "job", "gpu", "--reserve", "30"], ["apply", "r-000000000000"]])
    def test_a_change_that_could_not_be_sent_was_not_made(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
    ) -> None:
        """No attempt reached the server (no socket file): it said the change may have been made."""
        code, out, err = cli(capsys, "--server", f"unix:{tmp_path}/nobody.sock", "--timeout", "5", *command)
        assert (code, out) == (1, "")
        assert "may have been made" not in err and "nothing was sent, so the change was not made" in err


class TestLocalAndRemoteAgree:
    """A request the wire cannot carry, a mistyped operator and a bad request id are refused alike (exit 2), with
    --server and without: with it, the numbers crashed the client with a traceback (exit 1), and the local
    composer answered exit 3 to what it could not fit, or took an id the server refuses."""

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (("compose", "--preview", "j", "gpu x99999999999999999999"), "a count of"),
            (("compose", "--preview", "j", "cxl 99999999999PiB"), "an amount of bytes"),
            (("compose", "--preview", "j", "gpu latency<=99999999999999ms"), "a latency bound"),
            (("compose", "--preview", "j", "gpu k>=99999999999999999999999999"), "beyond the whole numbers"),
            (("compose", "--preview", "j", "gpu k>=-99999999999999999999999999"), "beyond the whole numbers"),
            (("compose", "--preview", "j", "host cores>=99999999999", "gpu"), "a minimum of cores"),
            (("compose", "j", "gpu model==H200"), "write model=H200"),
            (("compose", "j", "gpu gpu_memory=>80GiB"), "write gpu_memory>=80GiB"),
            (("compose", "j", "gpu gpu_memory>=80Gi"), "80GiB"),
            (("compose", "j", "gpu latency<=349.5ns"), "not a whole number of ns"),
            (("compose", "j", "gpu", "--request-id", "a b"), "--request-id: give an id of 1 to 128"),
            (("compose", "j", "gpu", "--request-id", "x" * 5000), "--request-id: give an id of 1 to 128"),
            (("compose", "j", "gpu", "--request-id", ""), "--request-id: give an id of 1 to 128"),
            (("recompose", "j", "--add", "gpu", "--request-id", "a\tb"), "--request-id: give an id of 1 to 128"),
        ],
    )
    def test_refused_alike(
        self, capsys: pytest.CaptureFixture[str], served: Served, args: tuple[str, ...], message: str
    ) -> None:
        for where in ((), ("--server", served.address)):
            code, out, err = cli(capsys, *where, *args)
            assert (code, out) == (2, ""), (where, err)
            assert err.startswith("disagg: error: ") and message in err
        assert served.composer.compositions() == []


class TestInterrupted:
    """Ctrl-C during a change says what it stopped and what to do: it exited 130 without a word."""

    @pytest.mark.parametrize("request_id", [None, "mine-1"])
    def test_a_remote_compose_names_the_request_id(
        self,
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        served: Served,
        request_id: str | None,
    ) -> None:
        sent: list[str | None] = []

        def interrupted(self: object, *args: object, request_id: str | None = None, **kw: object) -> None:
            sent.append(request_id)
            raise KeyboardInterrupt

        monkeypatch.setattr(RemoteBackend, "compose", interrupted)
        given = () if request_id is None else ("--request-id", request_id)
        code, out, err = cli(capsys, "--server", served.address, "compose", "job", "gpu", *given)
        assert (code, out) == (130, "")
        (used,) = sent
        assert used and (request_id is None or used == request_id)
        assert err.startswith("disagg: interrupted: compose job: the fabric manager may still make the change")
        assert f"run the same command with --request-id {used} to get its outcome" in err

    def test_a_remote_recompose_names_the_request_id(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, served: Served
    ) -> None:
        def interrupted(self: object, *args: object, **kw: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(RemoteBackend, "recompose", interrupted)
        code, _, err = cli(capsys, "--server", served.address, "recompose", "job", "--add", "gpu", "--request-id", "g")
        assert code == 130 and "--request-id g to get its outcome" in err


class TestServerOption:
    """--server goes before or after the command, beats $DISAGG_SERVER, excludes --config, and only where it applies."""

    def _args(self, *argv: str) -> argparse.Namespace:
        return build_parser().parse_args(list(argv))

    def test_positions(self) -> None:
        env: dict[str, str] = {}
        assert server_address(self._args("--server", "unix:/a", "ls"), env) == "unix:/a"
        assert server_address(self._args("ls", "--server", "unix:/b"), env) == "unix:/b"
        assert server_address(self._args("ls"), env) is None

    def test_environment(self) -> None:
        env = {"DISAGG_SERVER": "unix:/env"}
        assert server_address(self._args("ls"), env) == "unix:/env"
        assert server_address(self._args("ls", "--server", "unix:/flag"), env) == "unix:/flag"
        assert server_address(self._args("ls", "--config", "x.toml"), env) is None
        assert server_address(self._args("ls"), {"DISAGG_SERVER": ""}) is None

    def test_both_server_and_config(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = cli(capsys, "--server", "unix:/a", "ls", "--config", "x.toml")
        assert code == 2 and "not both" in err

    def test_empty_server(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = cli(capsys, "--server", "", "ls")
        assert code == 2 and "--server needs an address" in err

    @pytest.mark.parametrize(
        ("address", "message"),
        [
            ("unix:", "give the socket's path"),
            ("unix://", "give the socket's path"),
            ("http://localhost:1", "not a URL"),
            ("https://fm.example:443", "not a URL"),
            ("unix://tmp/fm.sock", "unix:/absolute/path"),  # gRPC takes no authority, and logged its own errors
            (":50051", "give HOST:PORT"),
            ("[::1:50051", "IPv6 host in brackets"),
        ],
    )
    def test_an_address_that_names_no_server_is_bad_input(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, address: str, message: str
    ) -> None:
        """It was exit 1, a fabric manager that cannot be reached, as if the server were down."""
        code, out, err = cli(capsys, "--server", address, "ls")
        assert (code, out) == (2, "") and message in err
        monkeypatch.setenv("DISAGG_SERVER", address)
        code, out, err = cli(capsys, "ls")
        assert (code, out) == (2, "") and "$DISAGG_SERVER" in err and message in err

    @pytest.mark.parametrize("command", ["demo", "plugins"])
    def test_not_for_local_commands(self, capsys: pytest.CaptureFixture[str], command: str) -> None:
        with pytest.raises(SystemExit) as info:
            main(["--server", "unix:/a", command])
        assert info.value.code == 2
        assert "runs locally" in capsys.readouterr().err

    @pytest.mark.parametrize("argv", [["ls"], ["compose", "job", "gpu x1"], ["decompose", "job"], ["devices"]])
    def test_no_local_composer_on_the_replicas_etcd_ledger(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
    ) -> None:
        """Without --server, a command on the replicas' own configuration ran a composer of its own on their etcd
        ledger: it recovered and reconciled there, and wrote compositions and events beside the leader's, with
        no lead and no fence. It is refused before anything connects (nothing listens at the endpoint)."""
        config = tmp_path / "replica.toml"
        config.write_text(
            '[state]\nledger = "etcd"\nendpoints = ["127.0.0.1:9"]\n\n'
            '[[fabric]]\nname = "pcie0"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n'
        )
        code, out, err = cli(capsys, *argv, "--config", str(config))
        assert (code, out) == (2, "")
        assert 'ledger = "etcd" is the ledger of `disagg serve` replicas' in err and "--server" in err

    @pytest.mark.parametrize("command", ["demo", "serve", "plugins"])
    def test_timeout_not_for_local_commands(self, capsys: pytest.CaptureFixture[str], command: str) -> None:
        """A deadline that nothing would use is refused, not silently dropped."""
        with pytest.raises(SystemExit) as info:
            main(["--timeout", "5", command])
        assert info.value.code == 2
        assert "--timeout does not apply to " + command in capsys.readouterr().err


class TestAgainstDisaggServe:
    """The installed command, as a user runs it, against `disagg serve` in another process."""

    def test_compose_ls_decompose(self, tmp_path: Path) -> None:
        with disagg_serve(tmp_path) as address:
            run = cli_against(tmp_path, address)

            composed = run("compose", "e2e", "gpu x2 model=H200", "--json")
            assert composed.returncode == 0, composed.stderr
            listed = run("ls", "--json")
            assert [c["name"] for c in json.loads(listed.stdout)] == ["e2e"]
            missing = run("decompose", "nothing")
            assert missing.returncode == 4 and "not found" in missing.stderr
            assert run("decompose", "e2e").returncode == 0
            assert json.loads(run("ls", "--json").stdout) == []
        assert not (tmp_path / "cli").exists()
