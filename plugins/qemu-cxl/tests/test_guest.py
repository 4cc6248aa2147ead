"""A Linux guest sees the CXL Type-3 memory it is given, by serial, within seconds of the call returning.

The guest is Debian's kernel with a busybox initramfs (`disagg_qemu_cxl.guest`), booted under TCG by the
qemu-cxl driver itself. Needs qemu-system-x86, kmod and the Debian mirror (skipped without them, failed on
CI); the guest is cached under $DISAGG_GUEST_CACHE so that reruns skip the download.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.composer import FabricComposer
from disagg.interfaces import CallContext
from disagg.requestlang import parse_request
from disagg_qemu_cxl.guest import GuestImage, list_memdevs, wait_for_memdev
from guest_helpers import (
    MIB,
    VISIBLE_TIMEOUT_S,
    DriverGuest,
    allocation_serial,
    direct_guest,
    driver_guest,
    guest_image,
)
from qemu_cxl_helpers import RawQMP

pytestmark = pytest.mark.slow

COLD_SERIAL = 0x1000
HOT_SERIAL = 0x2001


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> GuestImage:
    return guest_image(tmp_path_factory.getbasetemp())


@pytest.fixture
def guest(image: GuestImage, tmp_path: Path) -> Iterator[DriverGuest]:
    with driver_guest(image, tmp_path / "state") as booted:
        yield booted


def assert_in_qemu(booted: DriverGuest, serial: int, size: int) -> None:
    """QEMU itself (over the host's auxiliary monitor, not the driver's) holds a Type-3 with that serial."""
    with RawQMP(booted.state_dir, booted.host) as qmp:
        held = {d["sn"]: d["size"] for d in qmp.type3().values()}
    assert held.get(serial) == size, held


class TestComposedMemoryInGuest:
    """Memory composed or allocated to a host that boots a guest appears in the guest's /sys/bus/cxl."""

    def test_compose_reaches_the_guest(self, guest: DriverGuest) -> None:
        assert list_memdevs(guest.shell) == {}
        composer = FabricComposer({"qg": guest.fabric})
        try:
            composer.start()
            result = composer.compose(parse_request("guest-mem", [f"host {guest.host}", "cxl-memory 256MiB"]))
            returned = time.monotonic()
            assert result.composition is not None
            (allocation,) = result.composition.allocations
            serial = allocation_serial(guest.state_dir, allocation.id)
            device = wait_for_memdev(guest.shell, serial, timeout_s=VISIBLE_TIMEOUT_S)
            assert time.monotonic() - returned < VISIBLE_TIMEOUT_S
            assert device.pmem_bytes == allocation.amount_bytes == 256 * MIB
            assert_in_qemu(guest, serial, 256 * MIB)
        finally:
            composer.close()  # closes the fabric as well, which stops its QEMU (stop_hosts_on_close)

    def test_allocations_appear_by_serial_with_their_sizes(self, guest: DriverGuest) -> None:
        pool = guest.fabric.pool("qg/cxl-pool")
        ctx = CallContext.with_timeout(30.0, epoch=1)
        sizes = {"small": 256 * MIB, "large": 512 * MIB}
        for allocation_id, size in sizes.items():
            pool.allocate(allocation_id, guest.host, size, ctx)
            returned = time.monotonic()
            device = wait_for_memdev(
                guest.shell, allocation_serial(guest.state_dir, allocation_id), timeout_s=VISIBLE_TIMEOUT_S
            )
            assert time.monotonic() - returned < VISIBLE_TIMEOUT_S
            assert device.pmem_bytes == size
        seen = {s: d.pmem_bytes for s, d in list_memdevs(guest.shell).items()}
        assert seen == {allocation_serial(guest.state_dir, a): size for a, size in sizes.items()}


class TestGuestTooling:
    """With a hand-written QEMU, the guest lists a cold-plugged Type-3 and finds a hot-added one by serial."""

    def test_cold_and_hot_devices_by_serial(self, image: GuestImage) -> None:
        with direct_guest(image, cold={0: COLD_SERIAL}) as (host, shell, _ready):
            assert shell.check("echo hello").strip() == "hello"
            assert shell.run("false").status == 1
            cold = wait_for_memdev(shell, COLD_SERIAL, timeout_s=VISIBLE_TIMEOUT_S)
            assert cold.pmem_bytes == 256 * MIB
            host.hot_add(1, HOT_SERIAL)
            added = time.monotonic()
            hot = wait_for_memdev(shell, HOT_SERIAL, timeout_s=VISIBLE_TIMEOUT_S)
            assert time.monotonic() - added < VISIBLE_TIMEOUT_S
            assert hot.pmem_bytes == 256 * MIB
            assert set(list_memdevs(shell)) == {COLD_SERIAL, HOT_SERIAL}
            # `cxl` runs in the guest, so the initramfs holds every library it links.
            listed = json.loads(shell.check("cxl list -M", timeout_s=VISIBLE_TIMEOUT_S))
            assert {int(m["serial"]) for m in listed} == {COLD_SERIAL, HOT_SERIAL}

    def test_cache_is_reused(self, image: GuestImage, tmp_path_factory: pytest.TempPathFactory) -> None:
        """A second build in the same cache returns the same files without downloading or rebuilding them."""
        before = image.initrd.stat().st_mtime_ns
        again = guest_image(tmp_path_factory.getbasetemp())
        assert again == image
        assert again.initrd.stat().st_mtime_ns == before
