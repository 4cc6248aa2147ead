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
        error = _build_error(tmp_path, f'driver = "remote"\noptions = {{ address = "127.0.0.1:1", {option} = {value} }}')
        assert error.field == option
        assert f"option {option!r}: must be a number of seconds above 0 and at most 86400 (a day)" in error.message
