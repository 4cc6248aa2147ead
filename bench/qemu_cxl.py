"""How long CXL memory carved by the qemu-cxl driver takes to reach a real Linux guest.

One qemu-cxl fabric with one host that boots the test guest of ``disagg_qemu_cxl.guest`` (Debian's kernel,
busybox, under TCG as the driver runs it). Measured: the guest's boot (fabric start to the guest's ready
marker on ttyS0), then ``--repeats`` times each, ``Pool.allocate`` of ``--size-mib`` and the composer adding
``cxl-memory <size>`` to that host (one ``compose``, then ``recompose`` calls): the call's own time, and the
time from the call returning to a device with the allocation's serial being listed in the guest's
``/sys/bus/cxl/devices``. The guest is asked through its ttyS1 shell; one round trip of that shell (reported
as ``shell_round_trip_s``) bounds how finely "visible" can be timed. Every wait is bounded and the QEMU is
stopped at the end.

Needs qemu-system-x86, kmod and the Debian mirror (the guest is built once into ``--cache``, default
``$DISAGG_GUEST_CACHE`` or ``~/.cache/disagg/guest``). Without them it prints what to install and exits with 0
("skipped: ..."), so that ``tox -e bench`` goes on to the report; on CI (``CI=true``) it exits with 1 instead,
since there the tools must be installed.

Run: ``python bench/qemu_cxl.py --out bench/out/qemu_cxl.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disagg.composer import FabricComposer
from disagg.errors import ConfigError, DisaggError
from disagg.interfaces import CallContext
from disagg.requestlang import parse_request, parse_resource
from disagg_qemu_cxl import QemuCxlFabric, create_fabric
from disagg_qemu_cxl.guest import (
    READY_MARKER,
    GuestBuildError,
    GuestImage,
    GuestShell,
    build_guest,
    wait_for_marker,
    wait_for_memdev,
)
from disagg_qemu_cxl.hosts import find_qemu

MIB = 1024 * 1024
FABRIC = "qg"
HOST = "g1"
COMPOSITION = "bench"
BOOT_TIMEOUT_S = 120.0
VISIBLE_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0
MAX_PORTS = 32
QEMU = "qemu-system-x86_64"


def default_cache() -> Path:
    configured = os.environ.get("DISAGG_GUEST_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "disagg" / "guest"


def start_fabric(image: GuestImage, state_dir: Path, ports: int, pool_bytes: int) -> QemuCxlFabric:
    """The driver with one host that boots ``image``: console to a file, the guest's shell on a unix socket."""
    host = {
        "name": HOST,
        "ports": ports,
        "memory": "1G",
        "kernel": str(image.kernel),
        "initrd": str(image.initrd),
        "append": image.append,
        "serial": [f"file:{state_dir / 'console.log'}", f"unix:{state_dir / 'shell.sock'},server=on,wait=off"],
    }
    options = {"state_dir": str(state_dir / "qc"), "pool_bytes": pool_bytes, "hosts": [host]}
    return create_fabric(FABRIC, {**options, "stop_hosts_on_close": True})


def stop_fabric(fabric: QemuCxlFabric) -> None:
    """Close (which quits the QEMU); kill it if closing failed, so that no QEMU outlives the run."""
    try:
        fabric.close()
    except DisaggError:
        for process in fabric.hosts.values():
            with contextlib.suppress(DisaggError, OSError):
                process.kill()


def serial_of(state_dir: Path, allocation_id: str) -> int:
    """The Type-3 serial the driver recorded for an allocation (its state file), the key the guest shows."""
    doc = json.loads((state_dir / "qc" / "state.json").read_text())
    return int(doc["allocations"][allocation_id]["sn"])


def timed_until_visible(
    shell: GuestShell, state_dir: Path, call: Callable[[], str], *, poll_s: float
) -> dict[str, float]:
    """Time ``call`` (which returns an allocation id), then the wait until the guest lists its serial."""
    start = time.perf_counter()
    allocation_id = call()
    returned = time.perf_counter()
    wait_for_memdev(shell, serial_of(state_dir, allocation_id), timeout_s=VISIBLE_TIMEOUT_S, poll_s=poll_s)
    return {"call_s": returned - start, "visible_after_return_s": time.perf_counter() - returned}


def shell_round_trip(shell: GuestShell, count: int = 10) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        shell.check("true")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def by_allocate(fabric: QemuCxlFabric, size_bytes: int, i: int) -> Callable[[], str]:
    """``Pool.allocate`` straight on the driver."""
    pool = fabric.pool(f"{FABRIC}/cxl-pool")
    ctx = CallContext.with_timeout(CALL_TIMEOUT_S, epoch=1)
    return lambda: pool.allocate(f"bench-{i}", HOST, size_bytes, ctx).id


def by_compose(composer: FabricComposer, size_bytes: int, i: int) -> Callable[[], str]:
    """Memory through the composer (placement, ledger, steps): the first time a composition of
    ``cxl-memory <size>`` on the host, then a recompose that adds as much (a host belongs to one composition)."""
    clause = f"cxl-memory {size_bytes // MIB}MiB"

    def call() -> str:
        if i == 0:
            result = composer.compose(parse_request(COMPOSITION, [f"host {HOST}", clause]))
            assert result.composition is not None
            return result.composition.allocations[0].id
        before = composer.find(COMPOSITION)
        after = composer.recompose(before.id, add=[parse_resource(clause)])
        (added,) = {a.id for a in after.allocations} - {a.id for a in before.allocations}
        return added

    return call


def runs_summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "call_s": summary([r["call_s"] for r in runs]),
        "visible_after_return_s": summary([r["visible_after_return_s"] for r in runs]),
        "runs": runs,
    }


def measure(image: GuestImage, repeats: int, size_bytes: int, poll_s: float) -> dict[str, Any]:
    ports = 2 * repeats
    with tempfile.TemporaryDirectory(prefix="dqc-bench-", dir="/tmp") as tmp:
        state_dir = Path(tmp)
        started = time.perf_counter()
        fabric = start_fabric(image, state_dir, ports, ports * size_bytes)
        composer = FabricComposer({FABRIC: fabric})
        try:
            fabric_start_s = time.perf_counter() - started
            ready = wait_for_marker(state_dir / "console.log", READY_MARKER, timeout_s=BOOT_TIMEOUT_S)
            boot_s = time.perf_counter() - started
            with GuestShell.connect(state_dir / "shell.sock") as shell:
                round_trip_s = shell_round_trip(shell)
                allocations = [
                    timed_until_visible(shell, state_dir, by_allocate(fabric, size_bytes, i), poll_s=poll_s)
                    for i in range(repeats)
                ]
                composer.start()
                compositions = [
                    timed_until_visible(shell, state_dir, by_compose(composer, size_bytes, i), poll_s=poll_s)
                    for i in range(repeats)
                ]
        finally:
            with contextlib.suppress(DisaggError):
                composer.close()  # closes the fabric too
            stop_fabric(fabric)
    return {
        "guest_ready_line": ready,
        "fabric_start_s": fabric_start_s,
        "guest_boot_s": boot_s,
        "shell_round_trip_s": round_trip_s,
        "allocate": runs_summary(allocations),
        "compose": runs_summary(compositions),
    }


def qemu_version() -> str:
    try:
        out = subprocess.run([QEMU, "--version"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def unavailable(reason: str) -> int:
    """Without QEMU or the guest's build tools: skipped (0) where they may be absent, an error (1) on CI."""
    message = f"bench/qemu_cxl.py: {reason}"
    if os.environ.get("CI", "").lower() == "true":
        print(f"{message} (on CI the benchmark must run)", file=sys.stderr)
        return 1
    print(f"skipped: {message}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/qemu_cxl.json"))
    parser.add_argument("--repeats", type=int, default=5, help="allocations, and compositions, per run")
    parser.add_argument("--size-mib", type=int, default=256, help="size of each (a multiple of 256)")
    parser.add_argument("--poll-s", type=float, default=0.0, help="pause between two listings of the guest")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where the guest is built and kept")
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= MAX_PORTS // 2:
        parser.error(f"--repeats must be from 1 to {MAX_PORTS // 2} (each takes a downstream port)")
    if args.size_mib <= 0 or args.size_mib % 256:
        parser.error("--size-mib must be a positive multiple of 256")

    started = time.perf_counter()
    try:
        image = build_guest(args.cache)
        find_qemu(QEMU)
    except (GuestBuildError, ConfigError) as e:
        return unavailable(str(e))
    build_s = time.perf_counter() - started
    results = measure(image, args.repeats, args.size_mib * MIB, args.poll_s)
    report = {
        "benchmark": "qemu_cxl",
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
        "qemu": qemu_version(),
        "guest": {"kernel_release": image.kernel_release, "append": image.append, "build_or_cache_s": build_s},
        "settings": {
            "repeats": args.repeats,
            "size_mib": args.size_mib,
            "poll_s": args.poll_s,
            "accel": "tcg",
            "smp": 2,
            "visible_timeout_s": VISIBLE_TIMEOUT_S,
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k not in ("allocate", "compose")}, indent=2))
    for kind in ("allocate", "compose"):
        print(kind, json.dumps({k: v for k, v in results[kind].items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
