"""Test data and helpers shared by the sim tests (a uniquely named module: test directories share one import
namespace)."""

from __future__ import annotations

import threading
import time

from disagg_sim import SimFabric

SMALL = """
description = "a small fabric for tests"

[[switch]]
id = "top"
kind = "cxl"
failure_domains = { rack = "r1" }

[[switch]]
id = "box"
kind = "pcie"

[[host]]
id = "h1"
cores = 16
memory = "128GiB"
switch = "top"
latency = "100ns"

[[host]]
id = "h2"
cores = 64
memory = "1TiB"
switch = "top"
latency = 120
attributes = { cpu = "EPYC", scratch = "2TiB" }

[[link]]
a = "top"
b = "box"
latency = "200ns"
bandwidth_gbps = 256

[[devices]]
id_prefix = "gpu"
count = 4
kind = "gpu"
vendor = "NVIDIA"
model = "H100"
switch = "box"
latency = "100ns"
attributes = { gpu_memory = "80GiB", pcie_gen = 5 }
failure_domains = { chassis = "box" }

[[device]]
id = "nic0"
kind = "nic"
serial = "NIC-0"
switch = "top"
latency = "50ns"

[[device]]
id = "mem0"
kind = "cxl-memory"
switch = "top"
latency = "150ns"
capacity = "4GiB"

[[device]]
id = "mem1"
kind = "cxl-memory"
switch = "box"
latency = "150ns"
capacity = "1GiB"

[[pool]]
id = "dcd"
device = "mem0"
block_size = "256MiB"

[[pool]]
id = "mld"
device = "mem1"
kind = "mld"
block_size = "16MiB"
"""

MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40


def in_its_delay(fabric: SimFabric, caller: threading.Thread, timeout_s: float = 10.0) -> None:
    """Wait until the call of ``fabric`` that ``caller`` makes has validated and sleeps its delay, or ``caller``
    ended (the call answered at once): a fixed wait was too short when the thread was scheduled late (a loaded
    machine), and what the test did meanwhile came first."""
    deadline = time.monotonic() + timeout_s
    while not fabric._busy and caller.is_alive():
        assert time.monotonic() < deadline, f"no call of {fabric.name} began within {timeout_s:g} s"
        time.sleep(0.001)
