"""Compose over gRPC against a no-op RPC on the same server, at 1 and 32 concurrent clients, in one run.

Targets (issue 3): at 1 client the median Compose latency is at most 1.5x the median no-op latency; at 32
clients Compose throughput is at least half the no-op throughput. The no-op is ``grpc.health.v1.Health/Check``
on the same ``disagg serve`` process. The fabric is a generated sim fabric of 100,000 devices, or of each size
given with ``--devices`` (one server per size, measured one after the other in the same run, so the sizes
compare; the top-level figures are the largest size's, ``sizes`` holds every size's). Each client composes
``host cores>=32`` with ``gpu x1`` under a name of its own for the measured time, then the compositions are
decomposed (timed too), so every Compose places, binds and records a real composition.
The ledger is the in-memory one, or with ``--ledger sqlite`` the durable default (grouped commits). No-op and
Compose alternate on the same server in short blocks (five per round of each), each ratio is taken within a
block and the median over all blocks is reported: on these shared machines the speed of a no-op drifts by
tens of percent within a minute, and a single client's latency swings most with what else the machine runs.
Throughput counts the calls that end while every client is still calling, over that window (not the drain
at a block's end, which is longer for the slower call). Only the call is timed; building the request is not.
Each row also gives the CPU spent per call over its blocks (the whole machine's, the server's and the client's,
from ``/proc``) and the cores kept busy: at 32 clients, a throughput ratio below the CPU ratio with cores idle
means the calls wait on something other than the machine's CPU. The row's CPU of the server's busiest thread (its
event loop) and the share of the time that thread ran say whether that is the loop: one Python thread runs the
handlers, so a loop busy nearly all the time bounds Compose however many cores are idle. The share of the time
that thread was ready to run but waited for a core (Linux's ``schedstat``) says what the rest of its time was: a
loop that ran 70% of the time and waited 25% for a core had work all along, and lost the core to the client and
the server's other threads, not to a lock or a commit.
The server is `disagg serve`'s process and its children: with ``--front-end process`` (what ``auto`` gives
``--ledger sqlite``), gRPC's loop runs in a child, and each row names the process of its busiest thread.

Run: ``python bench/grpc_compose.py --out bench/out/grpc_compose.json`` (``tox -e bench`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.replay.report_control import THREAD_BUSY, THREAD_WAITING
from disagg.server.loop import event_loop_factory
from disagg_sim.generator import generate_topology
from grpc_health.v1 import health_pb2, health_pb2_grpc

CONFIG = """
[state]
ledger = "{ledger}"

[[fabric]]
name = "bench"
driver = "sim"
options = {{ generate = {{ devices = {devices} }} }}
"""
STARTUP_TIMEOUT_S = 180.0


def start_server(
    devices: int, tmp: Path, ledger: str = "memory", front_end: str = "auto"
) -> tuple[subprocess.Popen[str], str]:
    config = tmp / "disagg.toml"
    config.write_text(CONFIG.format(devices=devices, ledger=ledger))
    address = f"unix:{tmp / 'fm.sock'}"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "disagg.cli.main", "serve", "--config", str(config), "--listen", address),
            *("--front-end", front_end),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DISAGG_STATE_DIR": str(tmp / "state")},
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"disagg serve exited with {proc.returncode}")
        if "serving on" in line:
            # Keep reading what the server logs, so that a full pipe can never stall it mid-measurement.
            threading.Thread(target=proc.stdout.read, name="server-output", daemon=True).start()
            return proc, address
    proc.kill()
    raise RuntimeError("disagg serve did not become ready")


def event_loop_name() -> str:
    """The event loop the server runs on, as ``$DISAGG_EVENT_LOOP`` (inherited by the server) chooses it."""
    return "uvloop" if event_loop_factory().__module__.startswith("uvloop") else "asyncio"


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def compose_request(name: str) -> fm.ComposeRequest:
    """The benchmark's Compose, as `disagg.client` sends it: with a request id of its own (a fresh uuid4), as every
    client should send with a change (docs/protocol.md), and which makes the fabric manager keep its answer."""
    return fm.ComposeRequest(
        name=name,
        host=fm.HostRequest(min_cores=32),
        resources=[fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)],
        mode=fm.COMPOSE_MODE_APPLY,
        request_id=uuid.uuid4().hex,
    )


async def timed(
    clients: int, seconds: float, max_calls: int, call: Callable[[int, int], Awaitable[float]]
) -> tuple[list[float], float, int]:
    """Run ``clients`` loops of ``call`` until ``seconds`` pass or ``max_calls`` have started (never more, since
    each Compose holds a host): the latencies in µs, the steady window and the calls ended within it. The window
    runs from the moment every client has had its first answer (before it, the first calls of all the clients,
    started together, are in flight, and none ends for a latency: counted from the start, the slower call lost
    more of its window) until the first client stops starting calls (after it, fewer than ``clients`` calls are
    in flight). When no call ended within it, the whole time and every call."""
    latencies: list[float] = []
    ended: list[float] = []
    first_answers: list[float] = []
    started = 0
    steady_until = 0.0
    stop_at = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal started, steady_until
        n = 0
        while time.monotonic() < stop_at and started < max_calls:
            started += 1
            latencies.append(await call(w, n))
            ended.append(time.monotonic())
            if n == 0:
                first_answers.append(ended[-1])
            n += 1
        steady_until = steady_until or time.monotonic()

    start = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    steady_from = max(first_answers) if len(first_answers) == clients else start
    in_window = sum(1 for t in ended if steady_from < t <= steady_until)
    if not in_window:  # fewer calls allowed than clients (a small fabric): all of them, over the whole time
        return latencies, time.monotonic() - start, len(latencies)
    return latencies, steady_until - steady_from, in_window


Reading = tuple[float, float, float, float, dict[str, float], dict[str, float], dict[str, str]]
Sample = tuple[float, float, float, float, float, float | None, str | None]

FRONT_END_MODULE = "disagg.server.front_end"
"""The module the front end's process runs (``disagg serve --front-end process``), by which the clock knows it."""
FRONT_END, COMPOSER = "front end", "composer"
"""The names of the server's processes: gRPC's child, and `disagg serve`'s own (gRPC's too with an inline front end)."""


class CpuClock:
    """CPU time spent while calls run: the machine's (busy, from Linux's ``/proc/stat``), the server's, its busiest
    thread's and this client's. Per call, it says whether a throughput ratio is bound by the machine's cores (every
    core busy, so the ratio can be no better than the quotient of the CPU costs), by one server thread (its event
    loop, busy most of the time while cores are idle) or by waiting. The server is `disagg serve`'s process and its
    descendants: with a front end in a process of its own, gRPC's work is in its child. Without ``/proc``, None."""

    TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def read(self) -> Reading | None:
        """(wall, machine busy, server, client) seconds, the server's CPU seconds by thread id, by thread id the
        seconds each waited for a core (only the threads whose ``schedstat`` could be read), and by thread id the
        process it belongs to (`FRONT_END` or `COMPOSER`)."""
        try:
            cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            server = self._busy(Path(f"/proc/{self.server_pid}/stat").read_text())
            threads, waits, owners = self._threads(self.server_pid, COMPOSER)
        except OSError:
            return None
        for pid in self._descendants():
            try:
                server += self._busy(Path(f"/proc/{pid}/stat").read_text())
                found = self._threads(pid, self._role(pid))
            except OSError:  # the process ended meanwhile
                continue
            threads.update(found[0])
            waits.update(found[1])
            owners.update(found[2])
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in cpu[:7])
        return (
            time.monotonic(),
            (user + nice + system + irq + softirq) * self.TICK_S,
            server,
            time.process_time(),
            threads,
            waits,
            owners,
        )

    def front_end(self) -> str:
        """Where the server runs gRPC, as `disagg serve --front-end` names it: ``process`` when one of its
        descendants is the front end, else ``inline``."""
        return "process" if any(self._role(pid) == FRONT_END for pid in self._descendants()) else "inline"

    def _descendants(self) -> list[int]:
        """The server's descendants' pids, from each thread's ``children`` (Linux 3.5 with ``CONFIG_PROC_CHILDREN``),
        or else by each process's parent in ``/proc``; those that end meanwhile are left out."""
        found: list[int] = []
        parents = [self.server_pid]
        while parents:
            children = []
            for pid in parents:
                try:
                    tasks = list(Path(f"/proc/{pid}/task").iterdir())
                except OSError:
                    continue
                for task in tasks:
                    try:
                        children += [int(c) for c in (task / "children").read_text().split()]
                    except OSError:  # a kernel without the file, or a thread that ended meanwhile
                        return self._descendants_by_parent()
            found += children
            parents = children
        return found

    def _descendants_by_parent(self) -> list[int]:
        """The server's descendants' pids, by the parent in each process's ``stat``: slower, for any kernel."""
        parent_of = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parent_of[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        found, parents = [], {self.server_pid}
        while parents:
            parents = {pid for pid, parent in parent_of.items() if parent in parents}
            found += sorted(parents)
        return found

    @staticmethod
    def _role(pid: int) -> str:
        """`FRONT_END` for a process that runs the front end's module, else `COMPOSER` (any other process under
        `disagg serve` works for it)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return COMPOSER
        return FRONT_END if FRONT_END_MODULE.encode() in argv else COMPOSER

    @classmethod
    def _threads(cls, pid: int, role: str) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
        threads, waits = {}, {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                threads[task.name] = cls._busy((task / "stat").read_text())
            except OSError:  # the thread ended meanwhile
                continue
            try:  # on-CPU, run-queue wait (both in ns) and time slices; absent without the kernel's schedstats
                waits[task.name] = int((task / "schedstat").read_text().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                continue
        return threads, waits, dict.fromkeys(threads, role)

    @classmethod
    def _busy(cls, stat: str) -> float:
        """User and system seconds from a ``stat`` line (the command name, in parentheses, may hold spaces)."""
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) * cls.TICK_S

    @staticmethod
    def spent(before: Reading, after: Reading) -> Sample:
        """What the time between two readings cost: (wall, machine, server, client, the server's busiest thread),
        how long that thread waited for a core (None when either reading lacks its wait) and its process's name
        (None without threads)."""
        wall, machine, server, client = (b - a for a, b in zip(before[:4], after[:4], strict=True))
        ran = {tid: t - before[4].get(tid, 0.0) for tid, t in after[4].items()}
        if not ran:
            return wall, machine, server, client, 0.0, None, None
        tid = max(ran, key=ran.__getitem__)
        waited = None
        if tid in after[5] and (tid in before[5] or tid not in before[4]):  # a thread new since `before` waited 0
            waited = after[5][tid] - before[5].get(tid, 0.0)
        return wall, machine, server, client, ran[tid], waited, after[6].get(tid)


TICKS_PER_BLOCK_MIN = 10
"""``/proc/stat`` counts CPU in clock ticks (10 ms on Linux), so each block's count is off by up to a tick. Below
this many ticks per block, the per-call figures would be mostly rounding (a small fabric's short blocks can
count none at all), so they are left out of the row rather than reported wrong."""


THREAD_PROCESS = "server_busiest_thread_process"
"""A row's key for the process of the server's busiest thread: `FRONT_END` or `COMPOSER`."""


def cpu_figures(spent: list[Sample], calls: int) -> dict[str, float | str]:
    """CPU per call over the blocks ``spent`` (each `CpuClock.spent` between two readings), the cores the machine
    kept busy meanwhile, the share of the time the server's busiest thread ran, (where the kernel tells) the
    share it waited for a core, and the process whose busiest threads ran longest over the blocks; none when the
    blocks are too short for the clock to count them."""
    if not spent or not calls:
        return {}
    wall, machine, server, client, busiest = (
        sum(column) for column in zip(*(sample[:5] for sample in spent), strict=True)
    )
    if machine < TICKS_PER_BLOCK_MIN * len(spent) * CpuClock.TICK_S:
        return {}
    out: dict[str, float | str] = {
        "busy_cores": machine / wall,
        "machine_cpu_us_per_call": machine / calls * 1e6,
        "server_cpu_us_per_call": server / calls * 1e6,
        "client_cpu_us_per_call": client / calls * 1e6,
        "server_busiest_thread_cpu_us_per_call": busiest / calls * 1e6,
        THREAD_BUSY: busiest / wall,
    }
    waits = [sample[5] for sample in spent]
    if all(w is not None for w in waits):
        out[THREAD_WAITING] = sum(w for w in waits if w is not None) / wall
    ran: dict[str, float] = {}
    for sample in spent:
        if sample[6] is not None:
            ran[sample[6]] = ran.get(sample[6], 0.0) + sample[4]
    if ran:
        out[THREAD_PROCESS] = max(ran, key=ran.__getitem__)
    return out


def summary(latencies: list[float], window: float, in_window: int) -> dict[str, float]:
    latencies = sorted(latencies)
    return {
        "calls": len(latencies),
        "calls_per_s": in_window / window,
        "p50_us": statistics.median(latencies),
        "p99_us": latencies[int(0.99 * (len(latencies) - 1))],
    }


async def drive(
    clients: int, seconds: float, max_calls: int, call: Callable[[int, int], Awaitable[float]]
) -> dict[str, float]:
    return summary(*await timed(clients, seconds, max_calls, call))


async def measure(address: str, seconds: float, max_calls: int, rounds: int, clock: CpuClock) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = fm_grpc.FabricManagerServiceStub(channel)

        async def noop(w: int, n: int) -> float:
            request = health_pb2.HealthCheckRequest()
            t = time.perf_counter()
            await health.Check(request, timeout=30)
            return (time.perf_counter() - t) * 1e6

        composed: list[str] = []

        async def compose(w: int, n: int) -> float:
            request = compose_request(f"b{w}-{n}-{len(composed)}")
            t = time.perf_counter()
            reply = await stub.Compose(request, timeout=30)
            took = (time.perf_counter() - t) * 1e6
            composed.append(reply.composition.id)
            return took

        async def decompose(w: int, n: int) -> float:
            if not composed:
                return 0.0
            comp_id = composed.pop()
            t = time.perf_counter()
            await stub.Decompose(fm.DecomposeRequest(id=comp_id), timeout=30)
            return (time.perf_counter() - t) * 1e6

        for clients in (1, 32):
            await drive(clients, 0.5, 200, noop)
            for round_ in range(rounds):
                point = {"clients": clients, "round": round_}
                noop_row, compose_row, block_ratios = await blocks(
                    clients, seconds, max_calls, noop, compose, clock=clock
                )
                rows.append({"rpc": "noop", **point, **noop_row})
                rows.append({"rpc": "compose", **point, **compose_row, "block_ratios": block_ratios})
                count = len(composed)
                rows.append({"rpc": "decompose", **point, **await drive(clients, seconds * 4, count, decompose)})
                while composed:
                    await stub.Decompose(fm.DecomposeRequest(id=composed.pop()), timeout=30)
    return rows


BLOCKS = 5
"""Blocks per round: no-op, then Compose, each for a fifth of the round's time."""


async def blocks(
    clients: int,
    seconds: float,
    max_calls: int,
    noop: Callable[[int, int], Awaitable[float]],
    compose: Callable[..., Any],
    *,
    clock: CpuClock,
) -> tuple[dict[str, float | str], dict[str, float | str], list[float]]:
    """No-op and Compose alternating in short blocks: both rows (with their CPU per call over all the blocks),
    and each block's Compose / no-op ratio: of median latency at one client, of throughput at more."""
    runs: dict[str, list[tuple[list[float], float, int]]] = {"noop": [], "compose": []}
    spent: dict[str, list[Sample]] = {"noop": [], "compose": []}
    ratios: list[float] = []
    for _ in range(BLOCKS):
        for rpc, call in (("noop", noop), ("compose", compose)):
            before = clock.read()
            runs[rpc].append(await timed(clients, seconds / BLOCKS, max_calls // BLOCKS, call))
            after = clock.read()
            if before is not None and after is not None:
                spent[rpc].append(CpuClock.spent(before, after))
        n, c = runs["noop"][-1], runs["compose"][-1]
        if clients == 1:
            ratios.append(statistics.median(c[0]) / statistics.median(n[0]))
        else:
            ratios.append((c[2] / c[1]) / (n[2] / n[1]))
    noop_row, compose_row = (
        {
            **summary([x for r in runs[rpc] for x in r[0]], sum(r[1] for r in runs[rpc]), sum(r[2] for r in runs[rpc])),
            **cpu_figures(spent[rpc], sum(len(r[0]) for r in runs[rpc])),
        }
        for rpc in ("noop", "compose")
    )
    return noop_row, compose_row, ratios


def device_counts(text: str) -> list[int]:
    """``1000,100000`` -> ``[1000, 100000]``: the fabric sizes to measure, one server each."""
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated device counts, got {text!r}") from None
    if not sizes or sizes[0] <= 0:
        raise argparse.ArgumentTypeError(f"device counts must be positive, got {text!r}")
    return sizes


def figures(rows: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """The ratios of one fabric size, each taken within a block, and whether they meet the targets."""
    by = {(row["rpc"], row["clients"], row["round"]): row for row in rows}

    def per_round(clients: int, r: int) -> float:
        return float(statistics.median(by[("compose", clients, r)]["block_ratios"]))

    latency_blocks = [x for r in range(rounds) for x in by[("compose", 1, r)]["block_ratios"]]
    throughput_blocks = [x for r in range(rounds) for x in by[("compose", 32, r)]["block_ratios"]]
    latency_ratio = statistics.median(latency_blocks)
    throughput_ratio = statistics.median(throughput_blocks)
    measured = {
        rpc: [row for row in rows if row["rpc"] == rpc and row["clients"] == 32 and "busy_cores" in row]
        for rpc in ("noop", "compose")
    }
    cpu, busy, thread, waiting = (
        {
            rpc: statistics.median(row[key] for row in found)
            for rpc, found in measured.items()
            if found and all(key in row for row in found)
        }
        for key in ("machine_cpu_us_per_call", "busy_cores", THREAD_BUSY, THREAD_WAITING)
    )
    process = {
        rpc: statistics.mode(row[THREAD_PROCESS] for row in found)
        for rpc, found in measured.items()
        if found and all(THREAD_PROCESS in row for row in found)
    }
    return {
        "rows": rows,
        "machine_cpu_us_per_call_at_32_clients": cpu,
        "busy_cores_at_32_clients": busy,
        "server_busiest_thread_busy_at_32_clients": thread,
        "server_busiest_thread_waiting_for_cpu_at_32_clients": waiting,
        "server_busiest_thread_process_at_32_clients": process,
        "machine_cpu_ratio_at_32_clients": cpu["noop"] / cpu["compose"] if len(cpu) == 2 else None,
        "compose_p50_over_noop_p50_at_1_client": latency_ratio,
        "compose_throughput_over_noop_at_32_clients": throughput_ratio,
        "per_round": {
            "latency_ratio_at_1_client": [per_round(1, r) for r in range(rounds)],
            "throughput_ratio_at_32_clients": [per_round(32, r) for r in range(rounds)],
        },
        "latency_ratio_per_block_at_1_client": latency_blocks,
        "throughput_ratio_per_block_at_32_clients": throughput_blocks,
        "targets": {"latency_ratio_max": 1.5, "throughput_ratio_min": 0.5},
        "targets_met": latency_ratio <= 1.5 and throughput_ratio >= 0.5,
    }


def measure_size(devices: int, args: argparse.Namespace) -> dict[str, Any]:
    """Serve a fabric of ``devices`` devices, measure no-op against Compose on it, and stop the server."""
    max_calls = min(args.max_calls, compose_capacity(devices))
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server(devices, Path(tmp), args.ledger, args.front_end)
        try:
            clock = CpuClock(proc.pid)
            front_end = clock.front_end()
            if args.front_end not in ("auto", front_end):
                raise RuntimeError(f"disagg serve --front-end {args.front_end} runs its front end {front_end}")
            rows = asyncio.run(measure(address, args.seconds, max_calls, args.rounds, clock))
        finally:
            stop_server(proc)
    return {"devices": devices, "front_end": front_end, "max_calls_per_point": max_calls, **figures(rows, args.rounds)}


def compose_capacity(devices: int) -> int:
    """How many of the benchmark's Composes the server's fabric holds at once: one per host with 32 cores or
    more. A point takes at most that many calls (no-op points too, so both see the same window), which limits
    a small fabric's points to a short window: 144 calls at 1,000 devices."""
    topology = generate_topology("bench", devices=devices)
    return sum(1 for host in topology.hosts if host.cores >= 32)


def print_table(sizes: dict[str, dict[str, Any]]) -> None:
    print("| devices | rpc | clients | round | calls | calls/s | p50 µs | p99 µs |")
    print("|---|---|---|---|---|---|---|---|")
    for devices, fig in sizes.items():
        for r in fig["rows"]:
            cells = (
                devices,
                r["rpc"],
                r["clients"],
                r["round"],
                r["calls"],
                f"{r['calls_per_s']:.0f}",
                f"{r['p50_us']:.0f}",
                f"{r['p99_us']:.0f}",
            )
            print("| " + " | ".join(str(c) for c in cells) + " |")
    for devices, fig in sizes.items():
        print(
            f"{devices} devices, front end {fig['front_end']}: Compose p50 / no-op p50 at 1 client, median of "
            f"{len(fig['latency_ratio_per_block_at_1_client'])} blocks: "
            f"{fig['compose_p50_over_noop_p50_at_1_client']:.2f} (target <= 1.5); "
            f"Compose / no-op throughput at 32 clients, median of "
            f"{len(fig['throughput_ratio_per_block_at_32_clients'])} blocks: "
            f"{fig['compose_throughput_over_noop_at_32_clients']:.2f} (target >= 0.5)"
        )
        cpu = fig["machine_cpu_us_per_call_at_32_clients"]
        if fig["machine_cpu_ratio_at_32_clients"] is not None:
            busy, thread = fig["busy_cores_at_32_clients"], fig["server_busiest_thread_busy_at_32_clients"]
            processes = fig["server_busiest_thread_process_at_32_clients"]
            whose = {rpc: f" (the {name}'s)" for rpc, name in processes.items()}
            print(
                f"{devices} devices at 32 clients: machine CPU per call {cpu['noop']:.0f} µs for a no-op, "
                f"{cpu['compose']:.0f} µs for a Compose (their ratio, {fig['machine_cpu_ratio_at_32_clients']:.2f}, "
                f"bounds the throughput ratio when every core is busy); busy cores of {os.cpu_count()}: "
                f"{busy['noop']:.2f} no-op, {busy['compose']:.2f} Compose; the server's busiest thread ran "
                f"{thread['noop']:.0%} of the time for a no-op{whose.get('noop', '')}, {thread['compose']:.0%} for a "
                f"Compose{whose.get('compose', '')} (medians over the rounds; front end {fig['front_end']})"
            )
            waiting = fig["server_busiest_thread_waiting_for_cpu_at_32_clients"]
            if len(waiting) == 2:
                print(
                    f"{devices} devices at 32 clients: the server's busiest thread waited for a core "
                    f"{waiting['noop']:.0%} of the time for a no-op, {waiting['compose']:.0%} for a Compose"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out/grpc_compose.json")
    parser.add_argument(
        "--devices",
        type=device_counts,
        default=[100_000],
        help="comma-separated fabric sizes, each measured on a server of its own (default 100000)",
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="per point and round")
    parser.add_argument("--rounds", type=int, default=3, help="no-op and Compose alternate this many times")
    parser.add_argument("--max-calls", type=int, default=8_000, help="per point; each Compose holds a host")
    parser.add_argument(
        "--ledger", choices=("memory", "sqlite"), default="memory", help="sqlite: the durable default ledger"
    )
    parser.add_argument(
        "--front-end",
        choices=("auto", "process", "inline"),
        default="auto",
        help="disagg serve --front-end: gRPC in a process of its own or beside the composer; auto: a process unless "
        "the ledger is in memory (default auto)",
    )
    args = parser.parse_args(argv)
    sizes = {str(devices): measure_size(devices, args) for devices in args.devices}
    largest = sizes[str(args.devices[-1])]
    report = {
        "benchmark": "grpc_compose",
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
        "settings": {
            "devices": args.devices[-1],
            "sizes": args.devices,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "ledger": args.ledger,
            "front_end": largest["front_end"],
            "front_end_asked": args.front_end,
            "noop": "Health/Check",
            "event_loop": event_loop_name(),
        },
        **largest,
        "sizes": sizes,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(sizes)
    print(f"top-level figures are those of the largest size, {args.devices[-1]} devices; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
