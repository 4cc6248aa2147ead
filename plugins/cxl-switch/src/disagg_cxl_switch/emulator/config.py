"""The emulator's settings, from command-line flags or a JSON/TOML file: the topology and the timings.

A file and the flags share one set of names (``ld_count`` in a file is ``--ld-count`` on the command line), and
an unknown key in a file is an error rather than a silently ignored typo.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

import attrs

from disagg_cxl_switch.emulator.handlers import DEFAULT_BIND_DELAY, Switch
from disagg_cxl_switch.emulator.state import GIB, default_topology


def _finite_delay(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    """A NaN or infinite delay never passes, so the first Bind would run for ever and every later one be Busy."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{attribute.name} must be a finite number of milliseconds, 0 or more, got {value!r}")


@attrs.frozen
class EmulatorConfig:
    """Parameters of `default_topology` (capacities in GiB), the background delay and the event log size."""

    hosts: int = 2
    gpus: int = 10
    nvme: int = 0
    nics: int = 0
    ld_count: int = 4
    mld_capacity_gib: int = 64
    dc_capacity_gib: int = 16
    dc_regions: int = 2
    bind_delay_ms: float = attrs.field(default=DEFAULT_BIND_DELAY * 1000, validator=_finite_delay)
    event_capacity: int = 256

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> EmulatorConfig:
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(unknown)}")
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number, got {value!r}")
            if key != "bind_delay_ms" and not isinstance(value, int):
                raise ValueError(f"{key} must be an integer, got {value!r}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: Path) -> EmulatorConfig:
        """Reads ``.toml`` as TOML and anything else as JSON; the document is one table of the keys above."""
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a table of settings")
        return cls.from_mapping(data)

    def build(self) -> Switch:
        state = default_topology(
            hosts=self.hosts,
            gpus=self.gpus,
            nvme=self.nvme,
            nics=self.nics,
            ld_count=self.ld_count,
            mld_capacity=self.mld_capacity_gib * GIB,
            dc_capacity=self.dc_capacity_gib * GIB,
            dc_regions=self.dc_regions,
        )
        return Switch(state, bind_delay=self.bind_delay_ms / 1000, event_capacity=self.event_capacity)
