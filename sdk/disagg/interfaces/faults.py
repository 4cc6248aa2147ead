"""Fault injection, for fabrics that declare FAULT_INJECTION (simulators and emulators).

Tests, the demo and the conformance suite use it to make hardware misbehave on purpose.
"""

from __future__ import annotations

import abc

MAX_FAULT_COUNT = 1_000_000
"""The most binds `FaultInjection.flaky_bind` fails: the driver protocol's count, which a driver's service refuses
beyond it, so that an in-process fabric refuses the same (``failures: at most 1000000``)."""


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
        `FabricUnavailableError` without binding; more than `MAX_FAULT_COUNT` is an `InvalidRequestError`."""
