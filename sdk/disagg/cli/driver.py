"""``disagg driver serve``: run one fabric of any installed driver out of process, over FabricDriverService.

A fabric manager then reaches it with the built-in ``remote`` driver (``driver = "remote"``,
``options = { address = "unix:/run/disagg/pcie0.sock" }``). Options come from ``--options-file`` (a TOML
table) and ``--option KEY=VALUE`` (which wins); a value is read as a TOML value when it is one (numbers,
booleans, quoted strings, inline tables), else as a plain string, and a dotted key sets a nested table
(``--option generate.devices=1000``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from disagg.config import read_toml
from disagg.errors import ConfigError, PluginError
from disagg.model import fabric_name_refusal
from disagg.plugins import load_plugins
from disagg.remote.address import check_address
from disagg.remote.service import DriverServer

STOP_GRACE_S = 30.0
"""How long calls in flight may take to finish once a stop is asked for: as long as the fabric manager waits for
a driver call by default (its ``call_timeout_s``). A call cut off sooner still changes the hardware, and its
caller, told the outcome is unknown, undoes it against a driver that is stopping. An idle server stops at once."""


def option_value(raw: str) -> Any:
    """``raw`` as a TOML value when it parses as one, else the string itself."""
    if "\n" in raw or "\r" in raw:
        return raw
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw
    except (ValueError, RecursionError) as exc:  # an integer of too many digits; arrays nested too deeply
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError(f"--option: the value {raw[:40]!r}{'...' if len(raw) > 40 else ''}: {why}") from None


def _merge(into: dict[str, Any], key: list[str], value: Any, origin: str) -> None:
    table = into
    for n, part in enumerate(key[:-1]):
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(key[: n + 1])} is not a table", field=".".join(key))
        table = child
    last = key[-1]
    if isinstance(value, Mapping) and isinstance(table.get(last), dict):
        for k, v in value.items():
            _merge(table[last], [k], v, origin)
    else:
        table[last] = value


def parse_options(pairs: Iterable[str], options_file: str | None = None) -> dict[str, Any]:
    """The driver options: the file's table, then each ``KEY=VALUE`` over it. Raises `ConfigError`."""
    options: dict[str, Any] = {}
    if options_file == "":  # most often ``--options-file "$FILE"`` with FILE unset: serving without it would hide that
        raise ConfigError(
            "--options-file is empty: give the options file's path (was it a variable left unset?), or leave it out",
            field="options_file",
        )
    if options_file:
        path = Path(options_file)
        doc = read_toml(path, "--options-file", "options_file")
        for key, value in doc.items():
            _merge(options, [key], value, str(path))
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        parts = [p.strip() for p in key.split(".")]
        if not sep or not all(parts):
            raise ConfigError(f"--option: give KEY=VALUE, not {pair!r}", field="option")
        _merge(options, parts, option_value(raw.strip()), f"--option {pair}")
    return options


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    refused = fabric_name_refusal(args.name)
    if refused is not None:
        raise ConfigError(f"--name: {refused}", field="name")
    options = parse_options(args.option, args.options_file)
    address = check_address(args.listen, field="listen", listening=True)
    try:
        spec = load_plugins().driver(args.driver)
    except PluginError as exc:
        raise ConfigError(exc.message, field="driver") from None
    fabric = spec.factory(args.name, options)
    try:
        server = DriverServer(fabric, address, driver=args.driver).start()
        signalled = [False]

        def request_stop(signum: int, frame: FrameType | None) -> None:
            signalled[0] = True  # no lock in a handler: a second signal during `Event.set` would deadlock

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, request_stop)
        try:
            print(f"serving {args.name} ({args.driver}) on {server.address}", flush=True)
            while not signalled[0]:
                time.sleep(0.2)
        finally:
            server.stop(STOP_GRACE_S)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    finally:
        fabric.close()
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``driver serve`` to the subcommands of the ``disagg`` parser."""
    about = "run drivers out of process"
    driver = sub.add_parser("driver", help=about, description=about)
    commands = driver.add_subparsers(dest="driver_command", required=True)
    about = (
        "serve one fabric of an installed driver over disagg.driver.v1.FabricDriverService, for a fabric manager's "
        "`remote` driver; stops on SIGTERM or SIGINT"
    )
    serve = commands.add_parser("serve", help=about, description=about)
    serve.add_argument("driver", metavar="DRIVER", help="the driver (fabric type), as `disagg plugins` lists it")
    serve.add_argument("--name", required=True, metavar="FABRIC", help="the fabric instance name")
    serve.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a driver option (repeatable); the value is read as TOML when it can be, else as a string",
    )
    serve.add_argument("--options-file", metavar="FILE.toml", help="driver options as a TOML table")
    serve.add_argument(
        "--listen", required=True, metavar="ADDRESS", help="unix:/path/to/socket or 127.0.0.1:PORT (0: any free port)"
    )
    serve.set_defaults(func=cmd_serve)
