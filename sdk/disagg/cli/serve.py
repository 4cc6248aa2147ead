"""``disagg serve``: run the fabric manager's gRPC server until SIGTERM or SIGINT.

Prints ``serving on ADDRESS`` once per listener when the server is ready (health SERVING), so that scripts
and tests can wait for that line; logs go to standard error. On SIGTERM or SIGINT it shuts down gracefully
(see `disagg.server.FabricManagerServer.stop`) and exits 0.

With ``[state] ledger = "etcd"`` it is one replica of several: it prints ``standby on ADDRESS`` once
listening, ``serving on ADDRESS`` once it leads, and exits 3 if it loses the lead. A start that fails after
winning the lead (a ledger record that does not decode, etcd or the fabrics out of reach) is reported as one
without etcd is, with its error's message and exit code (2 for a configuration or ledger to restore), once the
lead is given up for another replica to try.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType

from disagg import failpoints
from disagg.config import build_composer, load_config
from disagg.errors import ConfigError
from disagg.plugins import load_plugins
from disagg.server import GRACE_S, FabricManagerServer, fabric_drivers, parse_listener
from disagg.server.loop import event_loop_factory

AddCommand = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


EXIT_LOST_LEAD = 3
"""The exit code of a replica that lost the lead: its supervisor restarts it, as a standby."""
EXIT_FAILED = 1
"""The ledger failed while serving: the server stopped, for its supervisor to restart it."""


class _StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT arrived before the server was serving."""


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failpoints.check()
    config = load_config(args.config)
    plugins = load_plugins()
    if not 0 <= args.grace < math.inf:
        raise ConfigError("--grace must be a number of seconds >= 0", field="grace")
    listeners = args.listen or list(config.listeners)
    if not listeners:
        raise ConfigError(
            f"no address to listen on: give --listen or a [[listener]] address in {config.source}", field="listener"
        )
    for address in listeners:  # before any fabric is built
        parse_listener(address, allow_remote=args.allow_remote)
    event_loop_factory()  # and $DISAGG_EVENT_LOOP, also before any fabric is built
    composer = build_composer(config, plugins=plugins)
    stop = threading.Event()
    lost = threading.Event()
    leadership = None
    if config.ledger == "etcd":
        from disagg.ha import Leadership

        local = [f.name for f in config.fabrics if f.driver != "remote"]
        if local:
            logging.getLogger("disagg.server").warning(
                "fabrics %s run in this process: replicas do not share them, so a standby that takes the lead "
                "finds other hardware; serve them with `disagg driver serve` and use the remote driver",
                ", ".join(local),
            )

        identity = f"{socket.gethostname()}:{os.getpid()}:{','.join(listeners)}"
        leadership = Leadership(
            config.etcd_endpoints,
            identity,
            key=f"{config.etcd_prefix}leader",
            ttl_s=config.lease_ttl_s,
            epoch_base=config.epoch_base,
        )

    def on_serving(addresses: list[str]) -> None:
        for address in addresses:
            print(f"serving on {address}", flush=True)

    def on_lost() -> None:
        lost.set()
        stop.set()

    failed: list[str] = []

    def on_failed(failure: str) -> None:
        failed.append(failure)
        stop.set()

    start_failed: list[Exception] = []

    def on_start_failed(error: Exception) -> None:
        start_failed.append(error)
        stop.set()

    try:
        server = FabricManagerServer(
            composer,
            listeners,
            drivers=fabric_drivers(config, plugins),
            allow_remote=args.allow_remote,
            leadership=leadership,
            on_serving=on_serving,
            on_lost=on_lost,
            on_failed=on_failed,
            on_start_failed=on_start_failed,
        )
    except BaseException:
        composer.close()
        raise
    starting = [True]
    signalled = [False]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # No lock here: a second SIGTERM arriving inside `Event.set` (holding its lock) deadlocked the process.
        signalled[0] = True
        if starting[0]:  # break out of a discovery that may never end; start() cleans up after itself
            # Once: a second signal raised inside that clean-up would interrupt it (closing the fabrics).
            starting[0] = False
            raise _StoppedWhileStarting

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            addresses = server.start()
            starting[0] = False
        except _StoppedWhileStarting:
            return 0
        if leadership is not None:
            for address in addresses:
                print(f"standby on {address}", flush=True)
        while not signalled[0] and not stop.wait(0.2):
            pass
        server.stop(0 if lost.is_set() or failed or start_failed else args.grace)
    finally:
        server.stop(0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if start_failed:  # as a start without etcd raises it from `server.start`, for `main` to report
        raise start_failed[0]
    if lost.is_set():
        print("disagg: error: this replica lost the lead; it stopped serving", file=sys.stderr)
        return EXIT_LOST_LEAD
    if failed:
        print(
            f"disagg: error: {failed[0]}; it stopped serving: restart it once the ledger can be written (it "
            "recovers from the ledger and the hardware)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0


def register(add: AddCommand) -> None:
    """Add ``serve`` to the command line through ``main.build_parser``'s ``add``."""
    p = add("serve", cmd_serve, "run the fabric manager's gRPC server (health, reflection) until SIGTERM")
    p.add_argument(
        "--listen",
        action="append",
        metavar="ADDRESS",
        help="host:port or unix:/path (repeatable; default: the configuration's [[listener]] addresses)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        metavar="SECONDS",
        help=f"how long calls in flight may take to finish at shutdown (default {GRACE_S:g})",
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow TCP listeners on non-loopback addresses (the server has no authentication or TLS yet)",
    )
