"""Fault injection, for fabrics that declare FAULT_INJECTION (simulators and emulators).

Tests, the demo and the conformance suite use it to make hardware misbehave on purpose.
"""

from __future__ import annotations

import abc


class FaultInjection(abc.ABC):
    @abc.abstractmethod
    def fail_device(self, device: str, message: str = "") -> None:
        """Mark a device FAILED and report it as a DEVICE_HEALTH event. Raises `UnknownDeviceError`."""

    @abc.abstractmethod
    def repair_device(self, device: str) -> None:
        """Bring a failed device back to OK and report it."""

    @abc.abstractmethod
    def set_link(self, a: str, b: str, up: bool) -> None:
        """Take the link between two nodes down or up, reporting LINK_DOWN / LINK_UP.

        Raises `NotFoundError` for an unknown link.
        """

    @abc.abstractmethod
    def flaky_bind(self, device: str | None, failures: int) -> None:
        """Make the next ``failures`` binds (of ``device``, or of any device when None) raise
        `FabricUnavailableError` without binding."""
