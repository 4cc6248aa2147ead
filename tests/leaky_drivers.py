"""Drivers that start a poller thread with every fabric built, to prove that ``disagg certify`` ends whatever
threads a driver leaves running after ``close()``, and holds those threads against it.

A plugin module for ``disagg certify DRIVER --plugin leaky_drivers``. Each driver is the ``sim`` driver, on the
options and the certification fabric of `broken_drivers`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import signal
import threading
import time
from typing import Any

from broken_drivers import certify_options, factory
from disagg import hookimpl
from disagg.model import Topology
from disagg.plugins import DriverRegistry
from disagg_sim.fabric import SIM_CAPABILITIES, SimFabric

POLLER = "acme-poller"
"""The name of every driver's poller thread, which certify's report names."""
LEAK_S = 600.0
"""How long a poller that nothing stops runs: past any run of the suite."""
POLL_S = 0.5
"""How often the poller that close() stops looks for its stop flag: it ends that long after close()."""


class _Polling(SimFabric):
    """The sim with a thread that polls the hardware (here: waits) from the fabric's building on."""

    daemon = False

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self._stopped = threading.Event()
        threading.Thread(target=self._poll, name=POLLER, daemon=self.daemon).start()

    def _poll(self) -> None:
        self._stopped.wait(LEAK_S)


class LeavesNonDaemonThread(_Polling):
    """Its close() leaves its poller, not a daemon, running: Python's exit waits for it."""


class LeavesDaemonThread(_Polling):
    """Its close() leaves its poller, a daemon, running: it polls hardware that no fabric owns any more."""

    daemon = True


class StopsItsThreadAtClose(_Polling):
    """Its close() tells its poller to stop, and the poller ends at its next look, up to `POLL_S` later: nothing
    is left behind."""

    def _poll(self) -> None:
        while not self._stopped.is_set():
            time.sleep(POLL_S)

    def close(self) -> None:
        self._stopped.set()
        super().close()


def _monitor() -> None:
    """A child process that watches the hardware (here: waits) until it is ended, by SIGTERM as a monitor is."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler the parent (certify's suite) set
    time.sleep(LEAK_S)


class LeavesADaemonicChildProcess(SimFabric):
    """Starts a daemonic child process (a hardware monitor) with the first fabric built, and leaves it to Python's
    exit, which ends a process's daemonic children (`multiprocessing`'s exit handler)."""

    monitor: multiprocessing.process.BaseProcess | None = None

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        if LeavesADaemonicChildProcess.monitor is None:
            monitor = multiprocessing.get_context("fork").Process(target=_monitor, daemon=True)
            monitor.start()
            LeavesADaemonicChildProcess.monitor = monitor


LEAKY: dict[str, type[SimFabric]] = {
    "leaky-non-daemon-thread": LeavesNonDaemonThread,
    "leaky-daemon-thread": LeavesDaemonThread,
    "leaky-stops-its-thread": StopsItsThreadAtClose,
    "leaky-daemonic-child-process": LeavesADaemonicChildProcess,
}


@hookimpl
def disagg_register_drivers(registry: DriverRegistry) -> None:
    for name, cls in LEAKY.items():
        registry.add_driver(
            name,
            factory(cls),
            capabilities=SIM_CAPABILITIES,
            description=" ".join((cls.__doc__ or "").split()),
            certify_options=certify_options,
        )
