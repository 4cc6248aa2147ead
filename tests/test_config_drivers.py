"""Driver options as a configuration file gives them: a bad one is a `ConfigError` naming the file, the fabric and
the option, as the fabric is built (docs/configuration.md), never a traceback or a setting other than the one
written."""

from __future__ import annotations

from pathlib import Path

import pytest
from disagg.config import build_composer, load_config
from disagg.errors import ConfigError


def _build_error(tmp_path: Path, fabric: str) -> ConfigError:
    path = tmp_path / "disagg.toml"
    path.write_text(f'[state]\nledger = "memory"\n\n[[fabric]]\nname = "f0"\n{fabric}\n')
    config = load_config(path, environ={"DISAGG_STATE_DIR": str(tmp_path / "state")})
    with pytest.raises(ConfigError) as info:
        build_composer(config).close()
    assert info.value.message.startswith(f"{path}: fabric 'f0' ")
    return info.value


class TestRemote:
    @pytest.mark.parametrize("option", ["call_timeout_s", "connect_timeout_s"])
    @pytest.mark.parametrize("value", ["86400.5", "1e10", "1e300"])
    def test_a_timeout_over_a_day(self, tmp_path: Path, option: str, value: str) -> None:
        """Taken, 1e10 s overflowed the threads' waits: tracebacks, and the driver, answering, was counted out of
        reach ("Deadline Exceeded")."""
        error = _build_error(
            tmp_path, f'driver = "remote"\noptions = {{ address = "127.0.0.1:1", {option} = {value} }}'
        )
        assert error.field == option
        assert f"option {option!r}: must be a number of seconds above 0 and at most 86400 (a day)" in error.message


class TestNul:
    """TOML lets a string hold a NUL; no path, address or command-line word can."""

    @pytest.mark.parametrize(
        ("fabric", "field"),
        [
            ('driver = "cxl-switch"\noptions = { state_dir = "{tmp}/s\\u0000" }', "state_dir"),
            ('driver = "cxl-switch"\noptions = { address = "unix:{tmp}/s\\u0000.sock" }', "address"),
            ('driver = "qemu-cxl"\noptions = { state_dir = "{tmp}/q\\u0000", hosts = [{ name = "h" }] }', "state_dir"),
            (
                'driver = "qemu-cxl"\n'
                'options = { state_dir = "{tmp}/q", hosts = [{ name = "h", kernel = "/k\\u0000" }] }',
                "hosts[0].kernel",
            ),
            (
                'driver = "qemu-cxl"\n'
                'options = { state_dir = "{tmp}/q", hosts = [{ name = "h", kernel = "{k}", initrd = "/i\\u0000" }] }',
                "hosts[0].initrd",
            ),
            (
                'driver = "qemu-cxl"\n'
                'options = { state_dir = "{tmp}/q", hosts = [{ name = "h", kernel = "{k}", append = "a\\u0000" }] }',
                "hosts[0].append",
            ),
            (
                'driver = "qemu-cxl"\n'
                'options = { state_dir = "{tmp}/q", hosts = [{ name = "h", serial = ["file:/s\\u0000"] }] }',
                "hosts[0].serial",
            ),
            (
                'driver = "qemu-cxl"\n'
                'options = { state_dir = "{tmp}/q", qemu = "/bin/q\\u0000", hosts = [{ name = "h" }] }',
                "qemu",
            ),
        ],
        ids=["switch-state_dir", "switch-address", "qemu-state_dir", "kernel", "initrd", "append", "serial", "qemu"],
    )
    def test_refused_naming_the_option(self, tmp_path: Path, fabric: str, field: str) -> None:
        """It was a ValueError traceback ("embedded null byte"), or, in a switch's address, a switch out of reach."""
        kernel = tmp_path / "vmlinuz"
        kernel.write_bytes(b"")
        error = _build_error(tmp_path, fabric.replace("{tmp}", str(tmp_path)).replace("{k}", str(kernel)))
        assert error.field == field
        assert "must not hold a NUL character" in error.message
        assert not list(tmp_path.glob("q/hosts/*"))


class TestQemuCxl:
    def test_a_state_dir_that_cannot_be_made(self, tmp_path: Path) -> None:
        """It was a FabricUnavailableError (exit 1, as for hardware out of reach) naming neither the option nor the
        file, for a setting of the file."""
        (tmp_path / "file").write_text("")
        error = _build_error(
            tmp_path,
            f'driver = "qemu-cxl"\noptions = {{ state_dir = "{tmp_path}/file/q", hosts = [{{ name = "h" }}] }}',
        )
        assert error.field == "state_dir"
        assert f"(driver qemu-cxl): state_dir {tmp_path}/file/q cannot be used: " in error.message
