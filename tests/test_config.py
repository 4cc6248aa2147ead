"""Unit tests of configuration loading (`disagg.config`), as described in docs/configuration.md."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from disagg.config import Config, FabricConfig, build_composer, load_config, parse_config
from disagg.errors import ConfigError
from disagg.store.etcd import EtcdStore

MINIMAL = """
[[fabric]]
name = "f0"
driver = "sim"
"""


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory, so that no ./disagg.toml is found by accident."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def _load_text(tmp_path: Path, text: str) -> Config:
    path = _write(tmp_path / "disagg.toml", text)
    return load_config(path, environ={"DISAGG_STATE_DIR": str(tmp_path / "state")})


def _error(tmp_path: Path, text: str) -> ConfigError:
    path = _write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"DISAGG_STATE_DIR": str(tmp_path / "state")})
    assert str(path) in info.value.message
    return info.value


class TestEmbeddedDefault:
    """With no file, load_config returns the embedded demo rack with {state_dir} expanded from the environment."""

    def test_fabrics(self, cwd: Path, tmp_path: Path) -> None:
        config = load_config(environ={"DISAGG_STATE_DIR": str(tmp_path / "st")})
        assert config.source == "embedded default"
        assert [(f.name, f.driver) for f in config.fabrics] == [("pcie0", "sim"), ("cxl0", "sim")]
        assert config.fabrics[0].options["topology"] == "demo-pcie"
        assert config.fabrics[1].options["topology"] == "demo-cxl"

    def test_state_dir_from_environment(self, cwd: Path, tmp_path: Path) -> None:
        state = tmp_path / "st"
        config = load_config(environ={"DISAGG_STATE_DIR": str(state)})
        assert config.ledger == "sqlite"
        assert config.ledger_path == str(state / "ledger.db")
        assert config.fabrics[0].options["state_file"] == str(state / "sim-pcie0.json")
        assert config.fabrics[1].options["state_file"] == str(state / "sim-cxl0.json")

    def test_state_dir_from_xdg(self, cwd: Path, tmp_path: Path) -> None:
        config = load_config(environ={"XDG_STATE_HOME": str(tmp_path / "xdg")})
        assert config.ledger_path == str(tmp_path / "xdg" / "disagg" / "ledger.db")

    def test_composer_and_listener(self, cwd: Path, tmp_path: Path) -> None:
        config = load_config(environ={"DISAGG_STATE_DIR": str(tmp_path)})
        assert (config.policy, config.auto_heal, config.call_timeout_s) == ("best-fit", True, 30.0)
        assert config.listeners == ("127.0.0.1:50051",)

    def test_nothing_is_left_unexpanded(self, cwd: Path, tmp_path: Path) -> None:
        config = load_config(environ={"DISAGG_STATE_DIR": str(tmp_path)})
        assert "{state_dir}" not in repr(config)


class TestFileLookup:
    """load_config reads the path given, else $DISAGG_CONFIG, else ./disagg.toml."""

    def test_explicit_path(self, cwd: Path, tmp_path: Path) -> None:
        path = _write(tmp_path / "mine.toml", MINIMAL)
        for given in (path, str(path)):
            config = load_config(given, environ={})
            assert config.source == str(path)
            assert config.fabrics == (FabricConfig("f0", "sim", {}),)

    def test_environment_variable(self, cwd: Path, tmp_path: Path) -> None:
        path = _write(tmp_path / "env.toml", MINIMAL)
        config = load_config(environ={"DISAGG_CONFIG": str(path)})
        assert config.source == str(path)
        assert [f.name for f in config.fabrics] == ["f0"]

    def test_explicit_path_wins_over_environment(self, cwd: Path, tmp_path: Path) -> None:
        mine = _write(tmp_path / "mine.toml", MINIMAL)
        other = _write(tmp_path / "other.toml", MINIMAL.replace("f0", "f1"))
        config = load_config(mine, environ={"DISAGG_CONFIG": str(other)})
        assert [f.name for f in config.fabrics] == ["f0"]

    def test_file_in_working_directory(self, cwd: Path) -> None:
        _write(cwd / "disagg.toml", MINIMAL.replace("f0", "local"))
        config = load_config(environ={})
        assert config.source == "disagg.toml"
        assert [f.name for f in config.fabrics] == ["local"]

    def test_defaults_of_a_minimal_file(self, cwd: Path, tmp_path: Path) -> None:
        config = load_config(_write(tmp_path / "m.toml", MINIMAL), environ={"DISAGG_STATE_DIR": str(tmp_path)})
        assert config.ledger == "sqlite"
        assert config.ledger_path == str(tmp_path / "ledger.db")
        assert (config.policy, config.auto_heal, config.call_timeout_s, config.listeners) == (
            "best-fit",
            True,
            30.0,
            (),
        )

    def test_full_file(self, tmp_path: Path) -> None:
        config = _load_text(
            tmp_path,
            """
            [state]
            ledger = "sqlite"
            path = "{state_dir}/x.db"

            [composer]
            policy = "closest"
            auto_heal = false
            call_timeout_s = 5

            [[fabric]]
            name = "a"
            driver = "sim"
            options = { dir = "{state_dir}/a", list = ["{state_dir}/1", 2], nested = { p = "{state_dir}" } }

            [[fabric]]
            name = "b"
            driver = "other"

            [[listener]]
            address = "unix:///run/disagg.sock"

            [[listener]]
            address = "0.0.0.0:50051"
            """,
        )
        state = str(tmp_path / "state")
        assert config.ledger == "sqlite"
        assert config.ledger_path == f"{state}/x.db"
        assert (config.policy, config.auto_heal, config.call_timeout_s) == ("closest", False, 5.0)
        assert isinstance(config.call_timeout_s, float)
        assert config.fabrics[0].options == {
            "dir": f"{state}/a",
            "list": [f"{state}/1", 2],
            "nested": {"p": state},
        }
        assert config.fabrics[1] == FabricConfig("b", "other", {})
        assert config.listeners == ("unix:///run/disagg.sock", "0.0.0.0:50051")


class TestFileErrors:
    """A missing or unreadable file, or bad TOML, is a ConfigError naming the file."""

    def test_missing_explicit_file(self, cwd: Path, tmp_path: Path) -> None:
        path = tmp_path / "nope.toml"
        with pytest.raises(ConfigError, match="does not exist") as info:
            load_config(path, environ={})
        assert str(path) in info.value.message

    def test_missing_file_from_environment(self, cwd: Path, tmp_path: Path) -> None:
        path = tmp_path / "nope.toml"
        with pytest.raises(ConfigError, match="does not exist") as info:
            load_config(environ={"DISAGG_CONFIG": str(path)})
        assert str(path) in info.value.message

    def test_bad_toml(self, tmp_path: Path) -> None:
        error = _error(tmp_path, "[[fabric]\nname = ")
        assert "cannot read" in error.message

    def test_not_utf8(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.toml"
        path.write_bytes(b'[state]\nledger = "memory"  # caf\xe9\n')
        with pytest.raises(ConfigError, match="cannot read") as info:
            load_config(path, environ={})
        assert str(path) in info.value.message
        assert "not UTF-8" in info.value.message

    def test_a_byte_order_mark(self, tmp_path: Path) -> None:
        """As some Windows editors save UTF-8: it was "Invalid statement (at line 1, column 1)", of a first line
        that looks right."""
        path = tmp_path / "bom.toml"
        path.write_bytes(b"\xef\xbb\xbf" + MINIMAL.encode())
        with pytest.raises(ConfigError) as info:
            load_config(path, environ={})
        assert info.value.message == (
            f"cannot read configuration file {path}: it starts with a byte order mark (U+FEFF), which TOML does not "
            "allow: save it as UTF-8 without one"
        )

    @pytest.mark.parametrize(
        "text",
        ["a = " + "[" * 3000 + "]" * 3000, "a = " + "{ b = " * 3000 + "1" + " }" * 3000],
        ids=["arrays", "tables"],
    )
    def test_nested_too_deeply(self, tmp_path: Path, text: str) -> None:
        error = _error(tmp_path, text)
        assert "cannot read" in error.message and "nested too deeply" in error.message

    def test_an_integer_of_too_many_digits(self, tmp_path: Path) -> None:
        error = _error(tmp_path, "a = " + "9" * 5000)
        assert "cannot read" in error.message

    def test_directory(self, cwd: Path, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="cannot read") as info:
            load_config(tmp_path, environ={})
        assert str(tmp_path) in info.value.message


class TestValueErrors:
    """Every unknown key or bad value is a ConfigError whose message names the file and the key."""

    @pytest.mark.parametrize(
        ("text", "key"),
        [
            ("colour = 1\n" + MINIMAL, "colour"),
            (MINIMAL + "[state]\nledger = 'memory'\nbackup = true\n", "backup"),
            (MINIMAL + "[composer]\ntimeout = 3\n", "timeout"),
            ("[[fabric]]\nname = 'f'\ndriver = 'sim'\nport = 3\n", "port"),
            (MINIMAL + "[[listener]]\naddress = 'x:1'\ntls = true\n", "tls"),
        ],
        ids=["top", "state", "composer", "fabric", "listener"],
    )
    def test_unknown_key(self, tmp_path: Path, text: str, key: str) -> None:
        error = _error(tmp_path, text)
        assert "unknown keys" in error.message
        assert key in error.message
        assert error.field.endswith(key)

    @pytest.mark.parametrize(
        ("text", "field"),
        [
            ("colour = 1\n" + MINIMAL, "colour"),
            (MINIMAL + "[state]\nbackup = true\n", "state.backup"),
            (MINIMAL + "[composer]\ntimeout = 3\n", "composer.timeout"),
            ("[[fabric]]\nname = 'f'\ndriver = 'sim'\nport = 3\n", "fabric[0].port"),
        ],
        ids=["top", "state", "composer", "fabric"],
    )
    def test_unknown_key_field_is_a_path(self, tmp_path: Path, text: str, field: str) -> None:
        """The field of an unknown key is written like the field of every other error (``state.ledger``)."""
        assert _error(tmp_path, text).field == field

    def test_bad_ledger(self, tmp_path: Path) -> None:
        error = _error(tmp_path, MINIMAL + "[state]\nledger = 'postgres'\n")
        assert error.field == "state.ledger"
        assert "'postgres'" in error.message
        assert "sqlite, memory, etcd" in error.message

    @pytest.mark.parametrize(
        ("state", "field", "says"),
        [
            ("ledger = 'etcd'", "state.endpoints", "needs endpoints"),
            ("ledger = 'etcd'\nendpoints = '127.0.0.1:2379'", "state.endpoints", "a list of HOST:PORT"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1']", "state.endpoints", "[state] endpoints: etcd endpoint"),
            ("ledger = 'etcd'\nendpoints = ['https://etcd:2379']", "state.endpoints", "without the scheme (etcd:2379)"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']\nprefix = 'disagg'", "state.prefix", "start and end"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']\nlease_ttl_s = 1", "state.lease_ttl_s", "from 2 to 60"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']\nepoch_base = -1", "state.epoch_base", "from 0"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']\nepoch_base = '9'", "state.epoch_base", "from 0"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']\nepoch_base = true", "state.epoch_base", "from 0"),
        ],
    )
    def test_etcd_settings(self, tmp_path: Path, state: str, field: str, says: str) -> None:
        error = _error(tmp_path, MINIMAL + f"[state]\n{state}\n")
        assert error.field == field and says in error.message

    @pytest.mark.parametrize(
        "endpoint",
        ["etcd?1:2379", "etcd#1:2379", "root@etcd:2379", "etcd%31:2379", "etcd\\u0000:2379", "[zz]:2379", "éetcd:2379"],
    )
    def test_an_endpoint_the_client_would_misread(self, tmp_path: Path, endpoint: str) -> None:
        """Passed on as a URL's authority, it reached another endpoint: 'etcd?1:2379' was etcd on port 80 and
        'root@etcd:2379' was etcd:2379, so a replica could run on another etcd than the one written."""
        error = _error(tmp_path, MINIMAL + f'[state]\nledger = "etcd"\nendpoints = ["{endpoint}"]\n')
        assert error.field == "state.endpoints"
        assert "[state] endpoints: etcd endpoint" in error.message
        assert "a host name (letters, digits, '.', '-', '_'), an IPv4 address or an IPv6 address in brackets" in (
            error.message
        )

    @pytest.mark.parametrize(
        ("state", "key", "ledger"),
        [
            ("endpoints = ['127.0.0.1:2379']", "endpoints", "etcd"),
            ("ledger = 'sqlite'\nendpoints = ['127.0.0.1:2379']", "endpoints", "etcd"),
            ("ledger = 'memory'\nprefix = '/disagg/'", "prefix", "etcd"),
            ("lease_ttl_s = 3", "lease_ttl_s", "etcd"),
            ("epoch_base = 0", "epoch_base", "etcd"),
            ("ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']\npath = '/var/x.db'", "path", "sqlite"),
        ],
    )
    def test_a_setting_of_another_ledger(self, tmp_path: Path, state: str, key: str, ledger: str) -> None:
        """Ignored, it hid a mistake: endpoints without ledger = "etcd" ran each replica on a SQLite ledger of its
        own, composing on the same hardware as the others."""
        error = _error(tmp_path, MINIMAL + f"[state]\n{state}\n")
        assert error.field == f"state.{key}"
        assert f'[state] {key} applies to ledger = "{ledger}" only' in error.message

    def test_etcd_ledger(self, tmp_path: Path) -> None:
        config = _load_text(
            tmp_path, MINIMAL + "[state]\nledger = 'etcd'\nendpoints = ['127.0.0.1:2379', '127.0.0.1:2479']\n"
        )
        assert config.ledger == "etcd" and config.etcd_endpoints == ("127.0.0.1:2379", "127.0.0.1:2479")
        assert config.etcd_prefix == "/disagg/" and config.lease_ttl_s == 3 and config.epoch_base == 0

    def test_etcd_requests_wait_a_sixth_of_the_lease(self, tmp_path: Path) -> None:
        """As the lease keeper's do: one stalled member must not hold every ledger call (and so every RPC of the
        leader) for the client's default 5 s, longer than the lease itself."""
        config = _load_text(
            tmp_path,
            MINIMAL + "options = { topology = 'demo-pcie' }\n"
            "[state]\nledger = 'etcd'\nendpoints = ['127.0.0.1:1']\nlease_ttl_s = 6\n",
        )
        composer = build_composer(config)
        try:
            assert isinstance(composer.store, EtcdStore) and composer.store.timeout_s == 1.0
        finally:
            composer.close()

    @pytest.mark.parametrize("value", ["0", "-1", "-0.5", "'30'", "true", "nan", "inf"])
    def test_timeout_not_positive(self, tmp_path: Path, value: str) -> None:
        error = _error(tmp_path, MINIMAL + f"[composer]\ncall_timeout_s = {value}\n")
        assert error.field == "composer.call_timeout_s"
        assert "call_timeout_s must be a positive number" in error.message

    @pytest.mark.parametrize("value", ["86400.001", "1e10", "1e308"])
    def test_timeout_over_a_day(self, tmp_path: Path, value: str) -> None:
        """A longer timeout overflows the threading waits of a change that waits on a busy composition."""
        error = _error(tmp_path, MINIMAL + f"[composer]\ncall_timeout_s = {value}\n")
        assert error.field == "composer.call_timeout_s"
        assert "at most 86400" in error.message

    def test_timeout_of_a_day(self, tmp_path: Path) -> None:
        assert _load_text(tmp_path, MINIMAL + "[composer]\ncall_timeout_s = 86400\n").call_timeout_s == 86400.0

    def test_ledger_path_with_a_nul(self, tmp_path: Path) -> None:
        error = _error(tmp_path, MINIMAL + '[state]\npath = "a\\u0000b"\n')
        assert error.field == "state.path"
        assert "must not hold a NUL character" in error.message

    @pytest.mark.parametrize("value", ["5", "''", "['best-fit']"])
    def test_policy_not_a_name(self, tmp_path: Path, value: str) -> None:
        error = _error(tmp_path, MINIMAL + f"[composer]\npolicy = {value}\n")
        assert error.field == "composer.policy"
        assert "policy must be a placement policy's name" in error.message

    @pytest.mark.parametrize("value", ["5", "''", "true"])
    def test_ledger_path_not_text(self, tmp_path: Path, value: str) -> None:
        error = _error(tmp_path, MINIMAL + f"[state]\npath = {value}\n")
        assert error.field == "state.path"
        assert "[state] path must be the ledger file's path" in error.message

    def test_auto_heal_not_boolean(self, tmp_path: Path) -> None:
        error = _error(tmp_path, MINIMAL + "[composer]\nauto_heal = 'yes'\n")
        assert error.field == "composer.auto_heal"
        assert "auto_heal" in error.message

    @pytest.mark.parametrize("key", ["state", "composer"])
    def test_section_not_a_table(self, tmp_path: Path, key: str) -> None:
        error = _error(tmp_path, f"{key} = 1\n" + MINIMAL)
        assert error.field == key
        assert f"[{key}] must be a table" in error.message

    def test_fabric_as_a_table(self, tmp_path: Path) -> None:
        error = _error(tmp_path, MINIMAL.replace("[[fabric]]", "[fabric]"))
        assert error.field == "fabric"
        assert "write each fabric as [[fabric]]" in error.message

    @pytest.mark.parametrize("text", ["", "fabric = []\n", "fabric = 'x'\n"])
    def test_no_fabric(self, tmp_path: Path, text: str) -> None:
        error = _error(tmp_path, text)
        assert error.field == "fabric"
        assert "[[fabric]]" in error.message

    def test_a_misspelt_placeholder(self, tmp_path: Path) -> None:
        """It would make a new, empty ledger in a folder named after it: every composition would seem gone."""
        error = _error(tmp_path, MINIMAL + '[state]\npath = "{statedir}/ledger.db"\n')
        assert "{statedir} is no placeholder (there is {state_dir})" in error.message

    def test_other_braces_are_left_alone(self, tmp_path: Path) -> None:
        """A kernel command line may hold braces, and so may the state directory's own path."""
        text = MINIMAL + "options = { note = 'systemd.unit={rescue}' }\n"
        (tmp_path / "ok.toml").write_text(text)
        sdir = tmp_path / "{user}"
        config = load_config(tmp_path / "ok.toml", environ={"DISAGG_STATE_DIR": str(sdir)})
        assert config.fabrics[0].options["note"] == "systemd.unit={rescue}"
        assert config.ledger_path == str(sdir / "ledger.db")

    def test_fabric_not_a_table(self, tmp_path: Path) -> None:
        error = _error(tmp_path, "fabric = ['x']\n")
        assert error.field == "fabric"
        assert "must be a table" in error.message

    def test_duplicate_fabric_names(self, tmp_path: Path) -> None:
        error = _error(tmp_path, MINIMAL + MINIMAL)
        assert error.field == "fabric[1].name"
        assert "two fabrics are named 'f0'" in error.message

    @pytest.mark.parametrize("name", ["", "a/b", "3", "pc ie", "x" * 64])
    def test_bad_fabric_name(self, tmp_path: Path, name: str) -> None:
        value = name if name == "3" else repr(name)
        error = _error(tmp_path, MINIMAL + f"[[fabric]]\nname = {value}\ndriver = 'sim'\n")
        assert error.field == "fabric[1].name"
        assert "needs a name" in error.message

    def test_fabric_without_name(self, tmp_path: Path) -> None:
        error = _error(tmp_path, "[[fabric]]\ndriver = 'sim'\n")
        assert error.field == "fabric[0].name"

    @pytest.mark.parametrize("driver", [None, "''", "3"])
    def test_fabric_without_driver(self, tmp_path: Path, driver: str | None) -> None:
        line = "" if driver is None else f"driver = {driver}\n"
        error = _error(tmp_path, f"[[fabric]]\nname = 'f9'\n{line}")
        assert error.field == "fabric[0].driver"
        assert "fabric 'f9' needs a driver" in error.message

    @pytest.mark.parametrize("options", ["'topology=demo'", "[1, 2]", "3"])
    def test_options_not_a_table(self, tmp_path: Path, options: str) -> None:
        error = _error(tmp_path, f"[[fabric]]\nname = 'f9'\ndriver = 'sim'\noptions = {options}\n")
        assert error.field == "fabric[0].options"
        assert "options of fabric 'f9' must be a table" in error.message

    @pytest.mark.parametrize(
        "listener", ["[[listener]]\nport = 1\n", "[[listener]]\naddress = 50051\n"], ids=["missing", "not-text"]
    )
    def test_listener_without_address(self, tmp_path: Path, listener: str) -> None:
        error = _error(tmp_path, MINIMAL + "[[listener]]\naddress = 'a:1'\n" + listener)
        assert error.field == "listener[1].address"
        assert "[[listener]] #2 needs an address" in error.message

    def test_a_listener_given_twice(self, tmp_path: Path) -> None:
        """Only `disagg serve` refused it, as it bound, naming neither the file nor the table."""
        error = _error(
            tmp_path, MINIMAL + "".join(f"[[listener]]\naddress = '{a}'\n" for a in ("a:1", "unix:/s", "a:1"))
        )
        assert error.field == "listener[2].address"
        assert "[[listener]] #3 address 'a:1' is #1's too: give each address once" in error.message

    @pytest.mark.parametrize(("key", "second"), [("state_file", "{d}/s.json"), ("state_dir", "{d}/x/../st")])
    def test_a_state_given_to_two_fabrics(self, tmp_path: Path, key: str, second: str) -> None:
        """Two sim fabrics on one state_file each saved over the other's bindings, and the first then refused to
        start ("saved by fabric 'b'"); the file is refused as it is read, naming both fabrics."""
        first = f"{tmp_path}/s.json" if key == "state_file" else f"{tmp_path}/st"
        doc = "".join(
            f"[[fabric]]\nname = '{name}'\ndriver = 'sim'\n[fabric.options]\n{key} = '{path}'\n"
            for name, path in (("a", first), ("b", second.format(d=tmp_path)))
        )
        error = _error(tmp_path, doc)
        assert error.field == f"fabric[1].options.{key}"
        assert f"fabric 'b' {key} {second.format(d=tmp_path)!r} is fabric 'a''s too: " in error.message


class TestParseConfig:
    """parse_config validates an already parsed document and names the given source in errors."""

    def test_source_in_errors(self) -> None:
        with pytest.raises(ConfigError, match=r"^inline: ") as info:
            parse_config({"fabric": [{"name": "a"}]}, "inline", environ={})
        assert info.value.field == "fabric[0].driver"

    def test_error_is_an_invalid_request(self) -> None:
        with pytest.raises(ConfigError) as info:
            parse_config({}, "inline", environ={})
        assert info.value.reason == "INVALID_CONFIG"
        assert not info.value.retryable

    @pytest.mark.parametrize(
        ("doc", "field"),
        [
            ({1: 2}, "1"),
            ({"state": {None: 2}}, "state.None"),
            ({"fabric": [{"name": "a", "driver": "sim", b"x": 1}]}, "fabric[0].b'x'"),
        ],
        ids=["top", "state", "fabric"],
    )
    def test_a_key_that_is_not_text(self, doc: dict[Any, Any], field: str) -> None:
        with pytest.raises(ConfigError, match="keys are text") as info:
            parse_config(doc, "inline", environ={})
        assert info.value.field == field

    def test_expands_from_environ(self, tmp_path: Path) -> None:
        doc = {"fabric": [{"name": "a", "driver": "sim", "options": {"f": "{state_dir}/x"}}]}
        config = parse_config(doc, "inline", environ={"DISAGG_STATE_DIR": str(tmp_path)})
        assert config.fabrics[0].options == {"f": f"{tmp_path}/x"}
        assert config.ledger_path == str(tmp_path / "ledger.db")
        assert config.source == "inline"


class TestBuildErrors:
    """What only loading the plugins can check (the policy's name, a driver's options) is a `ConfigError` that
    names the file and the key too, and nothing is left open."""

    def test_unknown_policy(self, tmp_path: Path) -> None:
        config = _load_text(tmp_path, MINIMAL + "[composer]\npolicy = 'tightest'\n")
        with pytest.raises(ConfigError) as info:
            build_composer(config, ledger="memory")
        assert info.value.field == "composer.policy"
        assert info.value.message.startswith(f"{tmp_path / 'disagg.toml'}: [composer] policy: ")
        assert "'tightest'" in info.value.message and "best-fit" in info.value.message

    def test_a_ledger_that_cannot_be_opened(self, tmp_path: Path) -> None:
        """Found only when the ledger is opened, the path is a setting of the file: the error names both."""
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("")
        text = MINIMAL + f"options = {{ topology = 'demo-pcie' }}\n[state]\npath = '{blocker}/ledger.db'\n"
        config = _load_text(tmp_path, text)
        with pytest.raises(ConfigError) as info:
            build_composer(config)
        assert info.value.field == "state.path"
        assert info.value.message.startswith(f"{tmp_path / 'disagg.toml'}: [state] path: cannot open the ledger")

    def test_a_driver_not_installed(self, tmp_path: Path) -> None:
        """It named neither the fabric nor the key, and its field was empty."""
        text = MINIMAL + "options = { topology = 'demo-pcie' }\n[[fabric]]\nname = 'f1'\ndriver = 'simm'\n"
        config = _load_text(tmp_path, text)
        with pytest.raises(ConfigError) as info:
            build_composer(config, ledger="memory")
        assert info.value.field == "fabric[1].driver"
        assert info.value.message.startswith(
            f"{tmp_path / 'disagg.toml'}: [[fabric]] #2 ('f1') driver: no driver 'simm' is installed (installed: "
        )

    def test_bad_driver_option(self, tmp_path: Path) -> None:
        config = _load_text(tmp_path, MINIMAL + "options = { bogus = 1 }\n")
        with pytest.raises(ConfigError) as info:
            build_composer(config, ledger="memory")
        assert info.value.message.startswith(f"{tmp_path / 'disagg.toml'}: ")
        assert "bogus" in info.value.message


class TestEmptyConfigPath:
    """An empty ``--config`` is refused: most often a variable left unset (``--config "$CFG"``), it served the
    embedded demo rack on ~/.local/state instead. An empty ``$DISAGG_CONFIG`` is unset, as in most tools."""

    def test_empty_path_is_refused(self, cwd: Path) -> None:
        with pytest.raises(ConfigError) as info:
            load_config("", environ={})
        assert info.value.field == "config"
        assert info.value.message.startswith("--config is empty: give the configuration file's path")

    def test_empty_variable_is_unset(self, cwd: Path, tmp_path: Path) -> None:
        config = load_config(environ={"DISAGG_CONFIG": "", "DISAGG_STATE_DIR": str(tmp_path / "st")})
        assert config.source == "embedded default"


SQLITE_RACK = MINIMAL + "options = { topology = 'demo-pcie' }\n"


class TestLedgerPath:
    """``[state] path`` is read as the operator wrote it in the file: ``~`` is the home directory and a relative
    path is read from the file's directory, not from wherever the command runs; SQLite's ``:memory:`` and a
    directory are refused, naming the file and the key."""

    def test_relative_to_the_file(self, cwd: Path, tmp_path: Path) -> None:
        """It was read from the working directory: the same file gave another ledger from another directory."""
        config = _load_text(tmp_path, SQLITE_RACK + "[state]\npath = 'rel/ledger.db'\n")
        assert config.ledger_path == str(tmp_path / "rel" / "ledger.db")

    def test_home(self, cwd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A directory named ``~`` was made in the working directory."""
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        config = _load_text(tmp_path, SQLITE_RACK + "[state]\npath = '~/ledger.db'\n")
        assert config.ledger_path == str(tmp_path / "home" / "ledger.db")

    def test_the_home_of_no_user(self, cwd: Path, tmp_path: Path) -> None:
        error = _error(tmp_path, SQLITE_RACK + "[state]\npath = '~no-such-user-of-disagg/ledger.db'\n")
        assert error.field == "state.path"
        assert "no such home directory" in error.message

    def test_a_relative_state_dir_is_read_from_the_working_directory(self, cwd: Path, tmp_path: Path) -> None:
        path = _write(tmp_path / "disagg.toml", SQLITE_RACK + "[state]\npath = '{state_dir}/l.db'\n")
        config = load_config(path, environ={"DISAGG_STATE_DIR": "st"})
        assert config.ledger_path == str(cwd / "st" / "l.db")

    @pytest.mark.parametrize("state", ["ledger = 'memory'", "ledger = 'etcd'\nendpoints = ['127.0.0.1:2379']"])
    def test_a_state_dir_that_is_a_file_where_nothing_uses_it(self, tmp_path: Path, state: str) -> None:
        """Refused as the default ledger's directory, which only the SQLite ledger uses: a replica on etcd whose
        drivers are remote did not start, for a setting it does not read."""
        blocker = tmp_path / "state-file"
        blocker.write_text("")
        path = _write(tmp_path / "disagg.toml", MINIMAL + f"[state]\n{state}\n")
        config = load_config(path, environ={"DISAGG_STATE_DIR": str(blocker)})
        assert config.fabrics[0].name == "f0"

    def test_memory_is_refused(self, cwd: Path, tmp_path: Path) -> None:
        """SQLite kept it in memory: a ledger lost at exit, with a lock file named ``:memory:.lock`` beside it."""
        config = _load_text(tmp_path, SQLITE_RACK + "[state]\npath = ':memory:'\n")
        with pytest.raises(ConfigError) as info:
            build_composer(config)
        assert info.value.field == "state.path"
        assert info.value.message.startswith(f"{tmp_path / 'disagg.toml'}: [state] path: the ledger's path ':memory:'")
        assert 'ledger = "memory"' in info.value.message
        assert list(cwd.iterdir()) == []

    def test_a_directory_is_refused(self, tmp_path: Path) -> None:
        """SQLite said only "unable to open database file", after a lock file was made beside the directory."""
        folder = tmp_path / "ledgers"
        folder.mkdir()
        config = _load_text(tmp_path, SQLITE_RACK + f"[state]\npath = '{folder}'\n")
        with pytest.raises(ConfigError) as info:
            build_composer(config)
        assert info.value.field == "state.path"
        assert f"the ledger's path {folder} is a directory: give the ledger's file" in info.value.message
        assert not (tmp_path / "ledgers.lock").exists()
