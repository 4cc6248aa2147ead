"""The ``cxl-switch`` driver's options, checked once at the edge: a ConfigError names the fabric and the field."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import ConfigError, InvalidRequestError
from disagg.interfaces.fabric import MAX_ID, check_id

from disagg_cxl_switch.driver.client import parse_address
from disagg_cxl_switch.emulator.config import EmulatorConfig

MAX_BIND_DELAY_MS = 60_000.0
"""A minute: longer is no switch's bind, and NaN or infinity would leave every bind waiting for good."""

_EMULATOR_KEYS = ("gpus", "nvme", "nics", "ld_count", "mld_capacity_gib", "dc_capacity_gib", "dc_regions")
_STOP = ("when-idle", "always")
_STARTED_ONLY = ("ld_count", "mld_capacity_gib", "dc_capacity_gib", "dc_regions", "bind_delay_ms", "stop_emulator")
"""Settings of an emulator the driver starts: the one at ``address`` runs with its own, so one written beside it
would be ignored."""


@attrs.frozen
class Options:
    """``address`` of a running emulator, or ``state_dir`` to start one (both: adopt that emulator and keep the
    driver's state in ``state_dir``). ``hosts`` is a count (hosts ``h0, h1, ...``) or the host names, one per
    VCS; ``gpus``, ``nvme`` and ``nics`` say which downstream port holds what (the emulator's port order), and
    are passed, with the capacities, to an emulator the driver starts."""

    address: str | None
    state_dir: Path | None
    host_names: tuple[str, ...]
    emulator: Mapping[str, int]
    bind_delay_ms: float
    stop_emulator: str

    @property
    def gpus(self) -> int:
        return self.emulator["gpus"]

    @property
    def nvme(self) -> int:
        return self.emulator["nvme"]

    @property
    def nics(self) -> int:
        return self.emulator["nics"]

    def emulator_flags(self) -> list[str]:
        flags = ["--hosts", str(len(self.host_names)), "--bind-delay-ms", str(self.bind_delay_ms)]
        for key, value in self.emulator.items():
            flags += [f"--{key.replace('_', '-')}", str(value)]
        return flags


def _int(name: str, options: Mapping[str, Any], key: str, default: int, low: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"fabric {name!r} (driver cxl-switch): {key} must be an integer >= {low}", field=key)
    return value


def _field_of(refusal: str) -> str:
    """The option an emulator's refusal of its topology is about (its message names the setting)."""
    for key in ("mld_capacity", "dc_capacity", "dc_regions", "ld_count", "hosts"):
        if key in refusal:
            return key if key in ("dc_regions", "ld_count", "hosts") else f"{key}_gib"
    return "gpus"  # too many physical ports: the device counts


def parse_options(name: str, options: Mapping[str, Any]) -> Options:
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"fabric {name!r} (driver cxl-switch): {why}", field=field)

    known = {"address", "state_dir", "hosts", "bind_delay_ms", "stop_emulator", *_EMULATOR_KEYS}
    unknown = sorted(set(options) - known)
    if unknown:
        raise bad(unknown[0], f"unknown option {unknown[0]!r}; known: {', '.join(sorted(known))}")
    address, state_dir = options.get("address"), options.get("state_dir")
    if address is None and state_dir is None:
        raise bad("address", "give address (a running emulator) or state_dir (to start one)")
    for key in ("address", "state_dir"):  # TOML lets a string hold one; no path can
        if isinstance(options.get(key), str) and "\0" in options[key]:
            raise bad(key, f"{key} must not hold a NUL character")
    if address is not None:
        if not isinstance(address, str):
            raise bad("address", "address must be a string")
        try:
            parse_address(address)
        except ValueError as exc:
            raise bad("address", str(exc)) from None
        for key in _STARTED_ONLY:
            if key in options:
                raise bad(
                    key,
                    f"{key} applies to an emulator the driver starts (give state_dir without address); the one at "
                    f"{address} runs with its own settings: remove {key}",
                )
    if state_dir is not None and (not isinstance(state_dir, str) or not state_dir):
        raise bad("state_dir", "state_dir must be a path")
    hosts = options.get("hosts", 2)
    if isinstance(hosts, list) and hosts and all(_host_name(h) for h in hosts):
        names = tuple(hosts)
        if len(set(names)) != len(names):
            raise bad("hosts", "host names repeat")
    elif isinstance(hosts, int) and not isinstance(hosts, bool) and 1 <= hosts <= 32:
        names = tuple(f"h{i}" for i in range(hosts))
    else:
        raise bad(
            "hosts",
            "hosts must be a count 1..32 or a list of host names (ids: printable, no spaces or '/', at most "
            f"{MAX_ID} characters)",
        )
    defaults = {"gpus": 10, "nvme": 0, "nics": 0, "ld_count": 4, "mld_capacity_gib": 16, "dc_capacity_gib": 16}
    defaults["dc_regions"] = 1
    emulator = {key: _int(name, options, key, defaults[key], 1 if key == "dc_regions" else 0) for key in _EMULATOR_KEYS}
    delay = options.get("bind_delay_ms", 20.0)
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= MAX_BIND_DELAY_MS:
        raise bad("bind_delay_ms", f"bind_delay_ms must be a number of milliseconds from 0 to {MAX_BIND_DELAY_MS:g}")
    stop = options.get("stop_emulator", "when-idle")
    if stop not in _STOP:
        raise bad("stop_emulator", f"stop_emulator must be one of {', '.join(_STOP)}")
    if address is None:  # the driver starts the emulator: what it would refuse is refused here, as an option
        try:
            EmulatorConfig(hosts=len(names), bind_delay_ms=float(delay), **emulator).build()
        except ValueError as exc:
            raise bad(_field_of(str(exc)), f"the emulator cannot be started so: {exc}") from None
    return Options(
        address=address,
        state_dir=Path(state_dir) if state_dir is not None else None,
        host_names=names,
        emulator=emulator,
        bind_delay_ms=float(delay),
        stop_emulator=stop,
    )


def _host_name(name: object) -> bool:
    """Whether ``name`` can name a host: an id (`disagg.interfaces.check_id`: bind and unbind refuse any other,
    so a host the switch reported under it could never be bound) without a '/'."""
    try:
        check_id(name, "hosts")
    except InvalidRequestError:
        return False
    return "/" not in str(name)
