"""``python -m disagg_cxl_switch.emulator --listen unix:/path|127.0.0.1:PORT [--config FILE | topology flags]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import attrs
from disagg.errors import ConfigError
from disagg.wire.sockets import prepare_unix_socket

from disagg_cxl_switch.emulator.config import EmulatorConfig
from disagg_cxl_switch.emulator.server import ListenAddress, serve


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m disagg_cxl_switch.emulator", description=__doc__)
    parser.add_argument("--listen", required=True, help="unix:/path, or HOST:PORT on a loopback address")
    parser.add_argument("--config", type=Path, help="a JSON or TOML file of settings (flags override it)")
    for field in attrs.fields(EmulatorConfig):
        kind = float if field.name == "bind_delay_ms" else int
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, dest=field.name)
    parser.add_argument("--log-level", default="WARNING")
    return parser


async def _run(config: EmulatorConfig, address: ListenAddress) -> None:
    task = asyncio.ensure_future(serve(config.build(), address))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    claim: IO[bytes] | None = None
    try:
        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
        address = ListenAddress.parse(args.listen)
        base = EmulatorConfig.from_file(args.config) if args.config else EmulatorConfig()
        flags = {
            f.name: getattr(args, f.name) for f in attrs.fields(EmulatorConfig) if getattr(args, f.name) is not None
        }
        config = attrs.evolve(base, **flags)
        config.build()  # reject an impossible topology before listening
        if address.unix_path is not None:
            # A live emulator's socket is refused, not taken over (listening would unlink it); a stale one goes.
            # The claim is held until the socket file is removed: let go earlier, a second emulator started at
            # the same moment would listen on the path too, and the first to exit would remove the other's file.
            claim = prepare_unix_socket(address.unix_path)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(config, address))
    except OSError as exc:  # the address cannot be listened on: a port in use, a folder that is not there
        print(f"error: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # the socket's permissions could not be set
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    finally:
        if claim is not None:
            claim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
