"""The ``sim`` driver's options: checked one by one, so that a mistake names the option and the fabric.

Options come from the fabric manager's configuration (a TOML table per fabric), so values are what TOML
gives: strings, numbers, tables. Unknown options are errors, not ignored: a misspelt ``state_flie`` would
otherwise silently give a fabric that forgets everything between runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import ConfigError

from disagg_sim.generator import DEVICE_MEMORY_BYTES, MAX_GENERATED_DEVICES, domain_size

OPTIONS = ("topology", "generate", "state_file", "bind_delay_s")
GENERATE_OPTIONS = ("devices", "hosts_per_domain", "gpus_per_chassis", "seed")
MAX_BIND_DELAY_S = 86_400.0
"""The longest ``bind_delay_s``: a day, the longest ``call_timeout_s``. Far longer ones overflow ``time.sleep``."""


@attrs.frozen
class GenerateOptions:
    """Arguments of `disagg_sim.generator.generate_topology`."""

    devices: int
    hosts_per_domain: int = 8
    gpus_per_chassis: int = 10
    seed: int = 0


@attrs.frozen
class SimOptions:
    """Validated options: exactly one of ``topology`` and ``generate`` is set."""

    topology: str | None = None
    generate: GenerateOptions | None = None
    state_file: Path | None = None
    bind_delay_s: float = 0.0


def _gigabytes(amount: int) -> str:
    """``amount`` bytes in GB, for a message: one decimal place below 10 GB."""
    gb = amount / 1e9
    return f"{gb:.1f} GB" if gb < 10 else f"{gb:.0f} GB"


def parse_options(fabric: str, options: Mapping[str, Any]) -> SimOptions:
    """Check the options of fabric ``fabric``; raises ConfigError naming the option and the fabric."""

    def bad(option: str, message: str) -> ConfigError:
        return ConfigError(f"fabric {fabric!r} (driver sim): option {option!r}: {message}", field=option)

    if not isinstance(options, Mapping):
        raise ConfigError(f"fabric {fabric!r} (driver sim): options must be a table, not {options!r}")
    for key in options:
        if key not in OPTIONS:
            raise bad(str(key), f"unknown option (known: {', '.join(OPTIONS)})")
    has_topology = "topology" in options
    has_generate = "generate" in options
    if has_topology == has_generate:
        which = "both are given" if has_topology else "neither is given"
        raise ConfigError(
            f"fabric {fabric!r} (driver sim): exactly one of 'topology' and 'generate' is required; {which}",
            field="topology",
        )

    topology = None
    if has_topology:
        value = options["topology"]
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            raise bad("topology", f"must be a built-in name (demo-pcie, demo-cxl) or a file path, not {value!r}")
        if "\0" in value:  # TOML lets a string hold one; no file name can
            raise bad("topology", "must not hold a NUL character")
        topology = value

    generate = None
    if has_generate:
        table = options["generate"]
        if not isinstance(table, Mapping):
            raise bad("generate", f"must be a table such as {{ devices = 100000, seed = 0 }}, not {table!r}")
        values: dict[str, int] = {}
        for key, item in table.items():
            name = f"generate.{key}"
            if key not in GENERATE_OPTIONS:
                raise bad(name, f"unknown option (known: {', '.join(GENERATE_OPTIONS)})")
            if isinstance(item, bool) or not isinstance(item, int):
                raise bad(name, f"must be an integer, not {item!r}")
            if key != "seed" and item < 1:
                raise bad(name, f"must be at least 1, not {item}")
            if key == "devices" and item > MAX_GENERATED_DEVICES:
                raise bad(
                    name,
                    f"must be at most {MAX_GENERATED_DEVICES}, not {item}: a simulated device takes about "
                    f"{DEVICE_MEMORY_BYTES // 1000} kB of memory ({item}: about "
                    f"{_gigabytes(item * DEVICE_MEMORY_BYTES)}), and the bound keeps a mistyped count from "
                    "exhausting the machine's",
                )
            if key != "seed" and item > MAX_GENERATED_DEVICES:
                raise bad(name, f"must be at most {MAX_GENERATED_DEVICES}, not {item}")
            values[key] = item
        if "devices" not in values:
            raise bad("generate.devices", "is required: how many devices to generate")
        generate = GenerateOptions(**values)
        per_domain = domain_size(hosts_per_domain=generate.hosts_per_domain, gpus_per_chassis=generate.gpus_per_chassis)
        if per_domain > MAX_GENERATED_DEVICES:
            raise bad(
                "generate.gpus_per_chassis" if "gpus_per_chassis" in values else "generate.hosts_per_domain",
                f"a domain of {generate.hosts_per_domain} hosts and {generate.gpus_per_chassis} GPUs per chassis "
                f"holds {per_domain} devices; at most {MAX_GENERATED_DEVICES}",
            )

    state_file = None
    if "state_file" in options:
        value = options["state_file"]
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            raise bad("state_file", f"must be a file path, not {value!r}")
        if "\0" in value:
            raise bad("state_file", "must not hold a NUL character")
        state_file = Path(value)

    delay = options.get("bind_delay_s", 0.0)
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay) or delay < 0:
        raise bad("bind_delay_s", f"must be a number of seconds >= 0, not {delay!r}")
    if delay > MAX_BIND_DELAY_S:
        raise bad("bind_delay_s", f"must be a number of seconds >= 0 and at most {MAX_BIND_DELAY_S:.0f}, not {delay!r}")

    return SimOptions(topology=topology, generate=generate, state_file=state_file, bind_delay_s=float(delay))
