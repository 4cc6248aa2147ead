"""``disagg serve``: run the fabric manager's gRPC server until SIGTERM or SIGINT.

Prints ``serving on ADDRESS`` once per listener when the server is ready (health SERVING), so that scripts
and tests can wait for that line; logs go to standard error. On SIGTERM or SIGINT it shuts down gracefully
(see `disagg.server.FabricManagerServer.stop`) and exits 0; calls still running once ``--grace`` has passed
are cut off, as a crash would cut them, for the next start to finish or undo what they were changing: the
process ends without waiting for them (`_end_past_grace`). A signal before it serves (while the fabrics are
built, discovered and the ledger read) ends the start: exit 0, or 130 for SIGINT.

With ``[state] ledger = "etcd"`` it is one replica of several: it prints ``standby on ADDRESS`` once
listening, ``serving on ADDRESS`` once it leads, and exits 3 if it loses the lead, as when etcd does not answer
before its lease may have run out. A start that fails after winning the lead (a ledger record that does not
decode, a request etcd refuses, the fabrics out of reach) is reported as one
without etcd is, with its error's message and exit code (2 for a configuration or ledger to restore), once the
lead is given up for another replica to try. As it starts it warns once when etcd's election timeout, where a
member's command line shows it, is more than a third of ``lease_ttl_s`` (`disagg.ha.timeouts`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from disagg import failpoints
from disagg.config import Config, build_composer, load_config
from disagg.errors import ConfigError
from disagg.plugins import Plugins, load_plugins
from disagg.server import GRACE_S, FabricManagerServer, fabric_drivers, parse_listener
from disagg.server.collector import tune_for_serving
from disagg.server.front import FRONT_END_GONE
from disagg.server.loop import event_loop_factory
from disagg.server.runtime import FRONT_ENDS
from disagg.store import ownership
from disagg.store.sqlite import MEMORY

if TYPE_CHECKING:
    from disagg.ha import Leadership

AddCommand = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


EXIT_LOST_LEAD = 3
"""The exit code of a replica that lost the lead: its supervisor restarts it, as a standby."""
EXIT_FAILED = 1
"""The ledger failed while serving: the server stopped, for its supervisor to restart it."""
EXIT_NEEDS_OPERATOR = 2
"""The ledger failed while serving in a way the operator must mend before a restart (`Store.needs_operator`): its
data damaged (to restore from a backup), or its file removed or replaced (to put back), as for any bad state; a
supervisor that restarts on 1 stops."""


CLOSE_PAST_GRACE_S = 2.0
"""How long a ``disagg serve`` that ends with work still running past ``--grace`` gives its fabrics to close
(`_end_past_grace`), on top of the grace: a close waiting behind that work would hold the exit without end."""

EXIT_INTERRUPTED = 130
"""SIGINT (Ctrl-C) before the server served: the start was interrupted, as any command's is."""

log = logging.getLogger("disagg.server")


class _StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT arrived before the server was serving."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGTERM and SIGINT from before the fabrics are built (a remote fabric may wait its connect timeout there)
    until the command returns. While the server starts, the first one ends the start, raising
    `_StoppedWhileStarting` wherever the main thread is (every step of the start cleans up after itself); once it
    serves, one asks for the graceful stop (`signalled`). Installed before the fabrics are built: a signal there
    ended the process by the signal, without a word."""

    def __init__(self) -> None:
        self.starting = True
        self.signalled = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No lock here: a second SIGTERM arriving inside `Event.set` (holding its lock) deadlocked the process.
        self.signalled = True
        if self.starting:  # break out of a discovery that may never end; start() cleans up after itself
            # Once: a second signal raised inside that clean-up would interrupt it (closing the fabrics).
            self.starting = False
            raise _StoppedWhileStarting(signum)


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failpoints.check()
    config = load_config(args.config)
    plugins = load_plugins()
    if not 0 <= args.grace < math.inf:
        raise ConfigError(f"--grace must be a number of seconds, 0 or more, not {args.grace!r}", field="grace")
    listeners = _listeners(args, config)  # before any fabric is built
    event_loop_factory()  # and $DISAGG_EVENT_LOOP, also before any fabric is built
    tune_for_serving()
    with _Signals() as signals:
        try:
            return _serve(args, config, plugins, listeners, signals)
        except _StoppedWhileStarting as stopped:
            name = signal.Signals(stopped.signum).name
            log.info("stopped by %s while starting: nothing was served", name)
            return EXIT_INTERRUPTED if stopped.signum == signal.SIGINT else 0


def _listeners(args: argparse.Namespace, config: Config) -> list[str]:
    """The addresses to listen on (``--listen``, else the configuration's), each checked; a bad one is refused
    naming where it was given: the option, or the file and its ``[[listener]]``."""
    if args.listen:
        for address in args.listen:
            try:
                parse_listener(address, allow_remote=args.allow_remote)
            except ConfigError as exc:
                raise ConfigError(f"--listen: {exc.message}", field="listen") from None
        return list(args.listen)
    if not config.listeners:
        raise ConfigError(
            f"no address to listen on: give --listen or a [[listener]] address in {config.source}", field="listener"
        )
    for n, address in enumerate(config.listeners):
        try:
            parse_listener(address, allow_remote=args.allow_remote)
        except ConfigError as exc:
            raise ConfigError(
                f"{config.source}: [[listener]] #{n + 1} address: {exc.message}", field=f"listener[{n}].address"
            ) from None
    return list(config.listeners)


def _leadership(config: Config, listeners: list[str]) -> Leadership | None:
    """With ``[state] ledger = "etcd"``: this replica's part in the election, else None."""
    if config.ledger != "etcd":
        return None
    from disagg.ha import Leadership
    from disagg.ha.timeouts import advise
    from disagg.store.etcd import request_timeout

    # Read beside the start, which an etcd out of reach would hold up for each member's request timeout.
    threading.Thread(
        target=advise,
        args=(config.etcd_endpoints, config.lease_ttl_s, request_timeout(config.lease_ttl_s)),
        name="disagg-etcd-advice",
        daemon=True,
    ).start()
    local = [f.name for f in config.fabrics if f.driver != "remote"]
    if local:
        log.warning(
            "fabrics %s run in this process: replicas do not share them, so a standby that takes the lead "
            "finds other hardware; serve them with `disagg driver serve` and use the remote driver",
            ", ".join(local),
        )
    identity = f"{socket.gethostname()}:{os.getpid()}:{','.join(listeners)}"
    return Leadership(
        config.etcd_endpoints,
        identity,
        key=f"{config.etcd_prefix}leader",
        ttl_s=config.lease_ttl_s,
        epoch_base=config.epoch_base,
    )


@contextlib.contextmanager
def _ledger_claimed(config: Config) -> Iterator[None]:
    """Hold a SQLite ledger from before the server listens until its composer, built once it listens, holds it
    too (the holds of one process are shared, `disagg.store.ownership`): a second fabric manager on the ledger is
    refused before it listens, as when the fabrics were built before listening. A ledger not to be claimed here (a
    directory, SQLite's ``:memory:``, a folder not made yet, a failing disk) is the store's to refuse, in its own
    words, as it opens."""
    path = Path(config.ledger_path)
    key = None
    if config.ledger == "sqlite" and config.ledger_path != MEMORY and not path.is_dir():
        try:
            key = ownership.hold(path)
        except ConfigError as exc:  # in use: worded as the store would, naming the file
            raise ConfigError(
                f"{config.source}: [state] path: {exc.message}", field="state.path", metadata=exc.metadata
            ) from exc
        except OSError:
            pass
    try:
        yield
    finally:
        if key is not None:
            ownership.let_go(key)


def _serve(args: argparse.Namespace, config: Config, plugins: Plugins, listeners: list[str], signals: _Signals) -> int:
    """Build the server, listen, build the composer (the fabrics, the ledger) and serve until a signal (or a lost
    lead, a failed ledger), stop. Listening comes first, health NOT_SERVING until the composer serves: a fabric
    may take its driver's connect timeout to build, and a silent socket meanwhile looked like a dead server."""
    stop = threading.Event()
    lost = threading.Event()

    def on_serving(addresses: list[str]) -> None:
        for address in addresses:
            print(f"serving on {address}", flush=True)

    def on_lost() -> None:
        lost.set()
        stop.set()

    failed: list[str] = []
    needs_operator = threading.Event()

    def on_failed(failure: str) -> None:
        failed.append(failure)
        if failure != FRONT_END_GONE and server.composer.store.needs_operator:
            needs_operator.set()
        stop.set()

    start_failed: list[Exception] = []

    def on_start_failed(error: Exception) -> None:
        start_failed.append(error)
        stop.set()

    leadership = _leadership(config, listeners)
    server = FabricManagerServer(
        lambda: build_composer(config, plugins=plugins),
        listeners,
        drivers=fabric_drivers(config, plugins),
        allow_remote=args.allow_remote,
        leadership=leadership,
        on_serving=on_serving,
        on_lost=on_lost,
        on_failed=on_failed,
        on_start_failed=on_start_failed,
        front_end=_front_end(args.front_end, config),
    )
    try:
        with _ledger_claimed(config):
            addresses = server.start()
        signals.starting = False
        if leadership is not None:
            for address in addresses:
                print(f"standby on {address}", flush=True)
        while not signals.signalled and not stop.wait(0.2):
            pass
        server.stop(0 if lost.is_set() or failed or start_failed else args.grace)
    finally:
        server.stop(0)
    if start_failed:  # as a start without etcd raises it from `server.start`, for `main` to report
        raise start_failed[0]
    code = _outcome(lost.is_set(), failed, needs_operator=needs_operator.is_set())
    _end_past_grace(server, code)
    return code


def _front_end(asked: str, config: Config) -> str:
    """Where gRPC's work runs (`disagg.server.runtime.FRONT_ENDS`): "auto" gives a durable ledger (SQLite, etcd) a
    front end of its own, where a Compose waits for the disk and the hop's latency is lost in that wait, and keeps
    the in-memory ledger, for tests and benchmarks of the composer's own latency, on one process."""
    if asked != "auto":
        return asked
    return "inline" if config.ledger == "memory" else "process"


def _outcome(lost: bool, failed: list[str], *, needs_operator: bool = False) -> int:
    """The exit code of a server that stopped, with what it says on standard error when that is no plain stop."""
    if lost:
        print("disagg: error: this replica lost the lead; it stopped serving", file=sys.stderr)
        return EXIT_LOST_LEAD
    if failed and needs_operator:  # the failure says what to mend
        print(f"disagg: error: {failed[0]}; it stopped serving", file=sys.stderr)
        return EXIT_NEEDS_OPERATOR
    if failed and failed[0] == FRONT_END_GONE:
        print(
            f"disagg: error: {failed[0]}, so no client could reach this server; it stopped serving: restart it (it "
            "recovers from the ledger and the hardware)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if failed:
        print(
            f"disagg: error: {failed[0]}; it stopped serving: restart it once the ledger can be written (it "
            "recovers from the ledger and the hardware)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0


def _end_past_grace(server: FabricManagerServer, code: int) -> None:
    """End the process at once with ``code`` when work still runs after the stop (a driver call past the grace, a
    discovery, a reconcile, a heal): the interpreter would join the threads running calls and heals at exit, so
    that ``--grace`` bounded nothing, and the process, still able to change the hardware, kept its ledger claimed
    meanwhile. The work is cut off as a crash would cut it: the next start finishes or undoes the changes it was
    making, from the ledger and the hardware. First the fabrics are closed, within `CLOSE_PAST_GRACE_S`: the
    composer would have closed them once that work returned, and a fabric left open leaves what it holds behind
    (a switch emulator it started, to stop with ``stop_emulator = "always"``); one whose close waits behind the
    work is left as the process's end leaves it. Here, in the command, and not in the server: a program embedding
    the server is not to be ended."""
    cut = server.in_flight()
    if not cut:
        return
    log.warning(
        "exiting without waiting for %d calls still running after the grace period, which end with the process: "
        "%s; the next start finishes or undoes what they were changing, as after a crash",
        len(cut),
        ", ".join(cut),
    )
    left = server.close_fabrics(CLOSE_PAST_GRACE_S)
    if left:
        log.warning(
            "fabrics %s did not close within %g s (busy with what was cut off): left as they are",
            ", ".join(left),
            CLOSE_PAST_GRACE_S,
        )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


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
        "--front-end",
        choices=("auto", *FRONT_ENDS),
        default="auto",
        help="run gRPC in a process of its own (process) or beside the composer (inline); auto: process unless the "
        "ledger is in memory (default auto)",
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow TCP listeners on non-loopback addresses (the server has no authentication or TLS yet)",
    )
