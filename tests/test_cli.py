"""The `disagg` command: the demo, the commands over the persistent default, JSON output and exit codes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from disagg.cli import entry
from disagg.cli.demo import run_demo
from disagg.cli.main import main


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own ledger and simulated hardware state, and no stray disagg.toml."""
    monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "state"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


class TestDemo:
    """`disagg demo` composes both systems, fails and heals a GPU, recomposes and releases everything."""

    def test_story(self) -> None:
        out = io.StringIO()
        assert run_demo(out=out) == 0
        text = out.getvalue()
        assert "composed training" in text and "on host h1: COMPOSED" in text
        assert "composed inference" in text and "on host h3: COMPOSED" in text
        assert "COMPOSED -> DEGRADED" in text
        assert "CompositionHealed" in text
        assert "training went DEGRADED and was healed: COMPOSED" in text
        assert "inference now has 4 GPUs and 512 GiB of CXL memory" in text
        assert "decomposed inference" in text and "decomposed training" in text
        assert "CXL memory all free" in text

    def test_json(self) -> None:
        out = io.StringIO()
        assert run_demo(json_output=True, out=out) == 0
        steps = json.loads(out.getvalue())["steps"]
        names = [s["step"] for s in steps]
        assert names == [
            "rack",
            "compose training",
            "compose inference",
            "fail and heal",
            "recompose inference",
            "decompose",
        ]
        by_name = {s["step"]: s for s in steps}
        training = next(c for c in by_name["fail and heal"]["compositions"] if c["name"] == "training")
        assert training["state"] == "COMPOSED" and by_name["fail and heal"]["failed"] not in [
            d["device"] for d in training["devices"]
        ]
        assert by_name["decompose"]["compositions"] == []
        assert all(p["free_bytes"] == p["total_bytes"] for p in by_name["decompose"]["pools"])


class TestDriverDemo:
    """`disagg demo --fabric DRIVER` composes from one driver's fabric and shows what the driver itself reports,
    composed and after the release."""

    def test_certification_fabric(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, err = cli(capsys, "demo", "--fabric", "sim")
        assert code == 0, err
        assert "== fabric demo-sim (driver sim, plugin sim)" in out
        assert "256 MiB of cxl-memory" in out and ": COMPOSED" in out
        composed, released = out.split("== Decomposed")
        assert "allocation  demo-sim/" in composed.split("What driver sim reports")[1]
        assert "(none)" in released

    def test_json(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, err = cli(capsys, "demo", "--fabric", "sim", "--memory", "512MiB", "--json")
        assert code == 0, err
        doc = json.loads(out)
        ((what, pool, size),) = doc["driver_view_composed"]
        assert what == "allocation" and pool.startswith(doc["composition"]["allocations"][0]["pool"])
        assert size == "512 MiB" and doc["driver_view_released"] == []

    def test_configured_fabric_of_that_driver(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        config = tmp_path / "rack.toml"
        config.write_text('[[fabric]]\nname = "racka"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n')
        code, out, err = cli(capsys, "demo", "--fabric", "sim", "--config", str(config))
        assert code == 0, err
        assert "== fabric racka (driver sim" in out and "gpu" in out and "binding  racka/" in out

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (("demo", "--fabric", "nope"), "no driver 'nope' is installed"),
            (("demo", "--fabric", "remote"), "offers no demo fabric"),
            (("demo", "--fabric", "sim", "--memory", "lots"), "is not a size of memory"),
            (("demo", "--fabric", "sim", "--memory", "x8"), "is not a size of memory"),
            (("demo", "--fabric", "sim", "--memory", "8"), "is not a size of memory"),
            (("demo", "--fabric", "sim", "--memory", "512.0"), "has no unit: 512GiB?"),
            (("demo", "--fabric", "sim", "--memory", "1.5"), "has no unit: 1.5GiB?"),
            (("demo", "--memory", "1GiB"), "--memory and --keep apply with --fabric only"),
            (("demo", "--keep"), "--memory and --keep apply with --fabric only"),
        ],
    )
    def test_bad_input(self, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str) -> None:
        code, out, err = cli(capsys, *args)
        assert code == 2 and message in err and out == ""


class TestCommands:
    """compose, ls, recompose and decompose share state across invocations through the default ledger."""

    def test_round_trip(self, capsys: pytest.CaptureFixture[str], state_dir: Path) -> None:
        code, out, err = cli(capsys, "compose", "job", "host h2", "gpu x2 model=H200", "cxl-memory 256GiB")
        assert code == 0, err
        assert "composed job" in out
        assert (state_dir / "ledger.db").exists() and (state_dir / "sim-pcie0.json").exists()
        code, out, _ = cli(capsys, "ls", "--json")
        comps = json.loads(out)
        assert [(c["name"], c["host"], c["state"]) for c in comps] == [("job", "h2", "COMPOSED")]
        code, out, err = cli(capsys, "recompose", "job", "--add", "nvme", "--json")
        assert code == 0, err
        assert len(json.loads(out)["devices"]) == 3
        code, out, _ = cli(capsys, "devices", "--kind", "gpu", "--json")
        held = [d for d in json.loads(out) if d["kind"] == "gpu"]
        assert len(held) == 20
        code, out, _ = cli(capsys, "topology")
        assert "fabric pcie0" in out and "job" in out
        code, out, err = cli(capsys, "decompose", "job")
        assert code == 0, err
        code, out, _ = cli(capsys, "ls", "--json")
        assert json.loads(out) == []

    def test_preview_and_reserve(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = cli(capsys, "compose", "p", "gpu x1", "--preview")
        assert code == 0 and "would compose on host" in out
        code, out, _ = cli(capsys, "compose", "r", "gpu x1", "--reserve", "30", "--json")
        assert code == 0 and json.loads(out)["reservation"]["id"].startswith("r-")

    def test_request_file(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        path = tmp_path / "req.toml"
        path.write_text('name = "doc"\n[[resource]]\nkind = "gpu"\ncount = 1\nselectors = ["model=H200"]\n')
        code, out, err = cli(capsys, "compose", "--file", str(path), "--json")
        assert code == 0, err
        assert json.loads(out)["composition"]["name"] == "doc"

    @pytest.mark.parametrize("name", ["req.JSON", "req.Json"])
    def test_a_json_request_file_in_any_case(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
    ) -> None:
        """A .JSON file was read as TOML and refused as a file that cannot be read."""
        path = tmp_path / name
        path.write_text('{"name": "doc", "resource": [{"kind": "gpu"}]}')
        code, _, err = cli(capsys, "compose", "--file", str(path), "--preview")
        assert code == 0, err

    def test_plugins_lists_sim(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = cli(capsys, "plugins")
        assert code == 0
        assert "disagg-sim" in out and "best-fit" in out and "fault-injection" in out


class TestThePrivateLedger:
    """The ledger holds the fabric's state: a file disagg makes is its owner's alone, and one that exists is
    closed to other users as it is opened (an older disagg, a copy or a restore left it 0644); its group keeps
    what the owner gave it, as a ledger shared with a group is so on purpose."""

    @pytest.mark.parametrize(("found", "left"), [(0o644, 0o640), (0o666, 0o660), (0o660, 0o660), (0o600, 0o600)])
    def test_an_existing_ledger(
        self, capsys: pytest.CaptureFixture[str], state_dir: Path, found: int, left: int
    ) -> None:
        assert cli(capsys, "compose", "a", "gpu x1")[0] == 0
        (state_dir / "ledger.db").chmod(found)
        assert cli(capsys, "ls")[0] == 0
        assert (state_dir / "ledger.db").stat().st_mode & 0o777 == left


class TestErrors:
    """Every mistake a user can make gets a clear message and its own exit code; nothing changes."""

    @pytest.mark.parametrize(
        ("args", "code", "message"),
        [
            (("compose", "x", "gpux8"), 2, "unknown device kind"),
            (("compose", "x", "gpu x2 spread="), 2, "spread= needs"),
            (("compose", "x", "gpu 512GiB"), 2, "only be carved from cxl-memory"),
            (("compose",), 2, "give a composition name"),
            (("compose", "bad name!", "gpu"), 2, "invalid composition name"),
            (("compose", "--file", "/nonexistent.toml"), 2, "does not exist"),
            (("compose", "x", "gpu x99"), 3, "99 gpu"),
            (("compose", "x", "host h9", "gpu"), 4, "host 'h9'"),
            (("decompose", "nothing"), 4, "composition 'nothing' not found"),
            (("recompose", "nothing", "--add", "gpu"), 4, "not found"),
            (("ls", "--config", "/nonexistent/disagg.toml"), 2, "does not exist"),
        ],
    )
    def test_exit_codes(
        self, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], code: int, message: str
    ) -> None:
        got, out, err = cli(capsys, *args)
        assert got == code
        assert err.startswith("disagg: error: ") and message in err
        assert out == ""

    @pytest.mark.parametrize(
        ("content", "clauses", "message"),
        [
            ('[{"kind": "gpu", "count": 1}]', (), "a request document is a table"),
            ('{"name": "a", "resource": [{"kind": "gpu", "selectors": [5]}]}', (), "5 is not a selector"),
            ('{"name": "a", "resource": [{"kind": "gpu"}]}', ("nic x2",), "give no resource clauses with it"),
        ],
    )
    def test_bad_request_files(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, clauses: tuple[str, ...], message: str
    ) -> None:
        """A request file that is not a request table, or one given with clauses, is refused (exit 2) and composes
        nothing; the first gave a traceback, the last dropped the clauses."""
        path = tmp_path / "request.json"
        path.write_text(content)
        code, out, err = cli(capsys, "compose", "y", *clauses, "--file", str(path))
        assert (code, out) == (2, "")
        assert err.startswith("disagg: error: ") and message in err
        assert cli(capsys, "ls", "--json")[1].strip() == "[]"

    @pytest.mark.parametrize("clauses", [(), ("gpu x1",)], ids=["alone", "with-clauses"])
    def test_an_empty_request_file_path(self, capsys: pytest.CaptureFixture[str], clauses: tuple[str, ...]) -> None:
        """Most often ``--file "$REQUEST"`` with REQUEST unset: ``--file ""`` was dropped, so that the clauses
        composed without a word (exit 0), and alone it said "a composition needs at least one resource"."""
        code, out, err = cli(capsys, "compose", "y", *clauses, "--file", "")
        assert (code, out) == (2, "")
        assert err == (
            "disagg: error: --file is empty: give the request file's path (was it a variable left unset?), or "
            "leave --file out and give the resources as clauses\n"
        )
        assert cli(capsys, "ls", "--json")[1].strip() == "[]"

    @pytest.mark.parametrize(
        ("content", "key"),
        [
            ('{"name": "a", "resource": [{"kind": "gpu"}], "name": "b"}', "name"),
            ('{"name": "a", "resource": [{"kind": "gpu", "count": 1, "count": 8}]}', "count"),
            ('{"name": "a", "host": {"name": "h1", "name": "h2"}, "resource": [{"kind": "gpu"}]}', "name"),
        ],
    )
    def test_a_json_request_file_with_a_key_twice(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, key: str
    ) -> None:
        """A key given twice in a JSON request file was taken, the last silently winning (TOML refuses it)."""
        path = tmp_path / "request.json"
        path.write_text(content)
        code, out, err = cli(capsys, "compose", "--file", str(path))
        assert (code, out) == (2, "")
        assert err.startswith(f"disagg: error: cannot read request file {path}: ")
        assert f"{key!r} is given twice" in err
        assert cli(capsys, "ls", "--json")[1].strip() == "[]"

    @pytest.mark.parametrize(
        ("name", "content"),
        [
            ("deep.json", "[" * 100_000 + "]" * 100_000),
            ("deep.json", '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}"),
            ("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ],
    )
    def test_a_request_file_nested_too_deep(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, content: str
    ) -> None:
        """The parser's RecursionError escaped as a traceback."""
        path = tmp_path / name
        path.write_text(content)
        code, out, err = cli(capsys, "compose", "--file", str(path))
        assert (code, out) == (2, "")
        assert err.startswith(f"disagg: error: cannot read request file {path}: ") and "nested" in err

    @pytest.mark.parametrize(
        ("clause", "code", "message"),
        [
            ("gpu x" + "9" * 4301, 2, "is more than the most a request may give"),
            ("gpu x2 spread=chassis=a", 2, "is not a failure-domain label"),
            ("cxl-memory 512.0", 2, "has no unit: 512GiB?"),
        ],
    )
    def test_clauses_refused_as_through_a_server(
        self, capsys: pytest.CaptureFixture[str], clause: str, code: int, message: str
    ) -> None:
        """Each crashed (a count of 4301 digits), did not fit (exit 3, a label no label can be) or asked for 512
        bytes; compose and recompose --add read a clause alike."""
        for args in (("compose", "--preview", "x", clause), ("recompose", "x", "--add", clause)):
            got, out, err = cli(capsys, *args)
            assert (got, out) == (code, "") and message in err

    def test_reserve_zero_reserves_for_the_default_time(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--reserve 0 bound the hardware as a plain compose did; 0 is the protocol's default, 60 s."""
        code, out, _ = cli(capsys, "compose", "r", "gpu x1", "--reserve", "0", "--json")
        assert code == 0 and json.loads(out)["reservation"] is not None
        assert cli(capsys, "ls", "--json")[1].strip() == "[]"

    @pytest.mark.parametrize("ttl", ["nan", "inf", "-5", "1e12"])
    def test_a_reserve_time_that_cannot_expire_is_refused(self, capsys: pytest.CaptureFixture[str], ttl: str) -> None:
        """``--reserve nan`` held the devices and the name for good (no command could release it then)."""
        code, out, err = cli(capsys, "compose", "r", "gpu x1", "--reserve", ttl)
        assert (code, out) == (2, "") and "reservation time to live must be above 0 and at most 86400" in err
        assert cli(capsys, "compose", "r", "gpu x1")[0] == 0

    @pytest.mark.parametrize("ttl", ["nan", "-1", "1e6"])
    def test_a_refused_reserve_time_names_reserve(self, capsys: pytest.CaptureFixture[str], ttl: str) -> None:
        """The refusal was in the composer's words, which name no flag (and the server's named
        reservation_ttl_s, a field of the protocol the command line has not)."""
        code, out, err = cli(capsys, "compose", "r", "gpu x1", "--reserve", ttl)
        assert (code, out) == (2, "") and err.startswith(f"disagg: error: --reserve {float(ttl):g}: ")
        assert "at most 86400 seconds" in err and "0 for the default" in err

    def test_name_taken_and_nothing_changes(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert cli(capsys, "compose", "a", "gpu x1")[0] == 0
        code, _, err = cli(capsys, "compose", "a", "gpu x1")
        assert code == 5 and "taken" in err
        _, out, _ = cli(capsys, "ls", "--json")
        assert len(json.loads(out)) == 1

    def test_unknown_driver_in_config(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        cfg = tmp_path / "disagg.toml"
        cfg.write_text('[[fabric]]\nname = "x"\ndriver = "nope"\n')
        code, _, err = cli(capsys, "ls")
        assert code == 2 and "no driver 'nope' is installed" in err

    def test_decompose_ignore_missing(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, _ = cli(capsys, "decompose", "nothing", "--ignore-missing")
        assert code == 0

    def test_decompose_json_lists_what_it_decomposed(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = cli(capsys, "compose", "job", "gpu x1")
        assert code == 0, err
        code, out, err = cli(capsys, "decompose", "job", "ghost", "--ignore-missing", "--json")
        assert code == 0, err
        assert json.loads(out) == {"decomposed": ["job"]}

    def test_decompose_with_a_mistyped_name_decomposes_nothing(self, capsys: pytest.CaptureFixture[str]) -> None:
        """It decomposed the names before the unknown one and never tried those after it, saying so of neither."""
        for name in ("a", "b"):
            assert cli(capsys, "compose", name, "gpu x1")[0] == 0
        code, out, err = cli(capsys, "decompose", "a", "ghost", "b")
        assert code == 4 and out == ""
        assert "composition 'ghost' not found; nothing was decomposed" in err
        assert {c["name"] for c in json.loads(cli(capsys, "ls", "--json")[1])} == {"a", "b"}

    def test_recompose_with_an_empty_etag_is_bad_input(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--etag ""`` was a guard no composition meets locally (a conflict) and no guard at all with --server;
        both now refuse it as bad input, changing nothing."""
        assert cli(capsys, "compose", "job", "gpu x1")[0] == 0
        code, out, err = cli(capsys, "recompose", "job", "--add", "nic", "--etag", "")
        assert code == 2 and out == ""
        assert err.startswith("disagg: error: ") and "an etag is never empty" in err
        assert len(json.loads(cli(capsys, "ls", "--json")[1])[0]["devices"]) == 1

    @pytest.mark.parametrize(
        ("clauses", "quoted"),
        [
            (("gpu", "x2"), "'gpu x2'"),
            (("gpu x1", "nic", "model=CX7"), "'nic model=CX7'"),
            (("cxl-memory", "512GiB"), "'cxl-memory 512GiB'"),
        ],
    )
    def test_a_clause_split_into_words_says_to_quote_it(
        self, capsys: pytest.CaptureFixture[str], clauses: tuple[str, ...], quoted: str
    ) -> None:
        """``disagg compose job gpu x2``, the clause unquoted, said only that x2 is an unknown device kind: each
        argument is a clause, so the error says to quote the clause whole; nothing is composed."""
        code, out, err = cli(capsys, "compose", "job", *clauses)
        assert (code, out) == (2, "")
        assert err.startswith("disagg: error: ") and f"each clause is one argument: quote it whole, {quoted}" in err
        assert cli(capsys, "ls", "--json")[1].strip() == "[]"

    def test_an_empty_etag_names_the_option(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--etag "$ETAG"`` with ETAG unset was refused in the Python API's words ("expected_etag ... leave it out
        (None)"), which name neither the option nor how to give no guard on the command line."""
        assert cli(capsys, "compose", "job", "gpu x1")[0] == 0
        code, out, err = cli(capsys, "recompose", "job", "--add", "nic", "--etag", "")
        assert (code, out) == (2, "")
        assert "--etag is empty" in err and "leave --etag out" in err
        assert "expected_etag" not in err and "None" not in err

    def test_a_missing_config_named_by_the_environment_says_so(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        """A $DISAGG_CONFIG left over in the environment named a file that is gone: the error spoke of a
        configuration file the command line never named, without saying where it came from."""
        monkeypatch.setenv("DISAGG_CONFIG", str(tmp_path / "gone.toml"))
        code, out, err = cli(capsys, "ls")
        assert (code, out) == (2, "")
        assert f"configuration file {tmp_path / 'gone.toml'} (from $DISAGG_CONFIG) does not exist" in err

    @pytest.mark.parametrize("command", [["ls"], ["serve", "--listen", "127.0.0.1:0"]])
    def test_an_etcd_endpoint_given_as_a_url_names_the_file_and_key(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
    ) -> None:
        """``endpoints = ["http://127.0.0.1:2379"]``, as etcdctl writes them, was refused only by ``serve``, as it
        built its election, in words that named neither the file nor ``[state] endpoints``."""
        config = tmp_path / "disagg.toml"
        config.write_text(
            '[state]\nledger = "etcd"\nendpoints = ["127.0.0.1:2379", "http://127.0.0.1:2479"]\n'
            '[[fabric]]\nname = "lab"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n'
        )
        code, out, err = cli(capsys, "--config", str(config), *command)
        assert (code, out) == (2, "")
        assert f"disagg: error: {config}: [state] endpoints: etcd endpoint 'http://127.0.0.1:2479'" in err
        assert "without the scheme (127.0.0.1:2479)" in err

    @pytest.mark.parametrize("config", [None, '[[fabric]]\nname = "lab"\ndriver = "sim"\n'])
    def test_a_state_dir_that_is_a_file(
        self, capsys: pytest.CaptureFixture[str], state_dir: Path, tmp_path: Path, config: str | None
    ) -> None:
        """It said that a driver could not make the directory of its state file: File exists, naming a path
        under the file, and not where that path came from."""
        state_dir.write_text("")
        given = []
        if config is not None:
            (tmp_path / "disagg.toml").write_text(config)
            given = ["--config", str(tmp_path / "disagg.toml")]
        code, out, err = cli(capsys, *given, "ls")
        assert (code, out) == (2, "")
        assert f"$DISAGG_STATE_DIR: {state_dir} is a file, not a directory" in err

    def test_a_fabric_without_a_name(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        """It said "a fabric name is 1 to 63 characters, not None": Python's word for the name it did not find."""
        config = tmp_path / "disagg.toml"
        config.write_text('[[fabric]]\ndriver = "sim"\n')
        code, out, err = cli(capsys, "--config", str(config), "ls")
        assert (code, out) == (2, "")
        assert f"disagg: error: {config}: [[fabric]] #1 has no name: give it one (name = " in err
        assert "None" not in err

    @pytest.mark.parametrize("command", [["ls"], ["demo", "--fabric", "sim"]])
    def test_an_empty_config_is_bad_input(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: list[str]
    ) -> None:
        """``--config "$CFG"`` with CFG unset: with $DISAGG_SERVER set, ls went to that server (exit 1, cannot
        reach it), and demo --fabric ran the embedded rack (exit 0), as if --config were not given."""
        monkeypatch.setenv("DISAGG_SERVER", "unix:/nonexistent/fm.sock")
        code, out, err = cli(capsys, *command, "--config", "")
        assert (code, out) == (2, "")
        assert "--config is empty" in err

    def test_config_before_the_command(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        """``disagg --config FILE ls`` took FILE for the command ("invalid choice"), where --server works there."""
        config = tmp_path / "disagg.toml"
        config.write_text('[[fabric]]\nname = "lab"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n')
        code, out, err = cli(capsys, "--config", str(config), "topology")
        assert code == 0, err
        assert "lab" in out
        code, _, err = cli(capsys, "--config", str(tmp_path / "absent.toml"), "ls")
        assert code == 2 and "does not exist" in err

    def test_recompose_takes_clauses_separated_as_compose_does(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--add "gpu x1; nic"`` was refused, blaming the count: "'x1;' is neither a count nor an amount"."""
        assert cli(capsys, "compose", "job", "gpu x1")[0] == 0
        code, _, err = cli(capsys, "recompose", "job", "--add", "gpu x1; nic")
        assert code == 0, err
        (job,) = json.loads(cli(capsys, "ls", "--json")[1])
        assert [r["kind"] for r in job["resources"]] == ["gpu", "gpu", "nic"]

    def test_recompose_with_nothing_to_do_is_a_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            main(["recompose", "job"])
        out, err = capsys.readouterr()
        assert exited.value.code == 2 and out == ""
        assert err.startswith("usage: ") and "give at least one --add CLAUSE or --remove ID" in err

    def test_devices_of_an_unknown_kind(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            main(["devices", "--kind", "quantum"])
        out, err = capsys.readouterr()
        assert exited.value.code == 2 and out == ""
        assert "unknown device kind 'quantum'; known kinds: gpu, cxl-memory" in err

    def test_devices_of_a_kind_by_its_alias(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, err = cli(capsys, "devices", "--kind", "ssd", "--json")
        assert code == 0, err
        kinds = {d["kind"] for d in json.loads(out)}
        assert kinds == {"nvme"}


SLOW_BIND = """
[[fabric]]
name = "pcie0"
driver = "sim"
options = { topology = "demo-pcie", state_file = "{state_dir}/sim-pcie0.json", bind_delay_s = 20.0 }
"""


class _InterruptedLoading:
    """A finder that stops the import of the command line as Ctrl-C would while it loads."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "disagg.cli.main":
            raise KeyboardInterrupt


class TestInterruptedWhileStarting:
    def test_it_is_said_not_a_traceback(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Ctrl-C in the third of a second the command line takes to load (grpc, the composer) was a traceback
        and a death by SIGINT, where a moment later it is "disagg: interrupted" and exit 130."""
        monkeypatch.delitem(sys.modules, "disagg.cli.main")
        monkeypatch.setattr(sys, "meta_path", [_InterruptedLoading(), *sys.meta_path])
        assert entry.main(["ls"]) == 130
        assert capsys.readouterr().err == "disagg: interrupted while starting: nothing was done\n"

    def test_the_console_script_is_the_entry(self) -> None:
        project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
        assert project["project"]["scripts"]["disagg"] == "disagg.cli.entry:script"
        assert entry.main(["plugins"]) == 0


class TestInterruptedWhileExiting:
    """A Ctrl-C that came while ``disagg`` exited after its command (the interpreter's exit takes a while) killed
    it by SIGINT: CI saw ``disagg certify`` killed where it had judged the run and written its reports."""

    SCRIPT = (
        "import os, signal, sys, time\n"
        "from disagg.cli import entry\n"
        "code = entry.script()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "sys.exit(code)\n"
    )

    @pytest.mark.parametrize(("argv", "status"), [(["plugins"], 0), (["decompose", "c-nosuch"], 4)])
    def test_the_command_keeps_its_status(self, tmp_path: Path, argv: list[str], status: int) -> None:
        env = {**os.environ, "DISAGG_STATE_DIR": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-c", self.SCRIPT, *argv], capture_output=True, text=True, env=env, timeout=60, check=False
        )
        assert done.returncode == status, done.stderr
        assert "KeyboardInterrupt" not in done.stderr and "interrupted" not in done.stderr, done.stderr

    def test_an_interrupt_before_the_end_still_interrupts(self) -> None:
        """`finished` only acts once the command has returned: in a process that calls `main`, Ctrl-C still
        interrupts."""
        assert entry.main(["plugins"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class TestInterrupted:
    """Ctrl-C during a local compose says what it stopped and that the next command finishes or undoes it: it
    exited 130 without a word, leaving a COMPOSING composition that the next command silently undid."""

    def _composing(self, ledger: Path) -> bool:
        if not ledger.exists():
            return False
        with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=1)) as db:
            try:
                rows = db.execute("SELECT doc FROM compositions").fetchall()
            except sqlite3.OperationalError:  # not made yet, or busy
                return False
        return any('"COMPOSING"' in str(row) for row in rows)

    def test_sigint_during_a_local_compose(self, tmp_path: Path, state_dir: Path) -> None:
        config = tmp_path / "slow.toml"
        config.write_text(SLOW_BIND)
        env = {**os.environ, "DISAGG_STATE_DIR": str(state_dir)}
        command = [sys.executable, "-m", "disagg.cli.main", "compose", "--config", str(config), "job", "gpu x1"]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 25
            while not self._composing(state_dir / "ledger.db"):
                assert proc.poll() is None and time.monotonic() < deadline, "the compose never started binding"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert (proc.returncode, out) == (130, "")
        assert err.startswith("disagg: interrupted: compose job: the change may be half made")
        assert "the next disagg command on this ledger (or disagg serve) finishes or undoes it" in err
        done = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "ls", "--config", str(config), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0 and json.loads(done.stdout) == []


GENERATED = """
[state]
ledger = "memory"

[[fabric]]
name = "big"
driver = "sim"
options = { generate = { devices = 2000 } }
"""
"""A fabric whose device table (about 200 kB) is far more than a pipe holds."""


class TestReaderGone:
    """Output piped into a reader that stops early (``disagg devices | head -1``) ends quietly with 141, as a
    Unix tool ended by SIGPIPE does: it ended in a BrokenPipeError traceback (exit 1), or, when the output was
    still in the buffer, in an "Exception ignored" message at exit (exit 120)."""

    def _run_closing_early(self, argv: list[str], state_dir: Path, lines: int) -> tuple[int, str]:
        """Runs the command with its standard output read for ``lines`` lines and then closed."""
        command = [sys.executable, "-m", "disagg.cli.main", *argv]
        env = {**os.environ, "DISAGG_STATE_DIR": str(state_dir)}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            for _ in range(lines):
                assert proc.stdout.readline()
            proc.stdout.close()
            proc.wait(timeout=60)
            return proc.returncode, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def test_a_reader_that_stops_after_one_line(self, tmp_path: Path, state_dir: Path) -> None:
        config = tmp_path / "big.toml"
        config.write_text(GENERATED)
        code, err = self._run_closing_early(["devices", "--config", str(config)], state_dir, lines=1)
        assert (code, err) == (141, "")

    def test_a_reader_gone_before_anything_is_written(self, state_dir: Path) -> None:
        """All the output is still in the buffer when the command ends: the flush at exit found the pipe closed."""
        code, err = self._run_closing_early(["plugins"], state_dir, lines=0)
        assert (code, err) == (141, "")
