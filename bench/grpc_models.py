"""Sync thread-pool gRPC server vs grpc.aio server, measured side by side in one run.

Why: disagg exposes a *synchronous, thread-safe* driver interface and serves it with grpcio's
thread-pool server (``grpc.server(ThreadPoolExecutor(16))``) rather than ``grpc.aio``. This script
re-measures that choice on the machine at hand so the docs can quote current figures. Shared machines
are noisy, so only compare numbers from the same run; the two server models are measured back to back
for every point to keep drift out of the comparison.

What is measured, all on loopback (127.0.0.1, ephemeral ports):

* four server models, each in its own child process (this script re-run with ``--serve MODEL``):
  ``sync`` = ``grpc.server(ThreadPoolExecutor(max_workers=16))``, ``sync-64`` the same with 64 threads,
  ``aio`` = ``grpc.aio.server()`` with async handlers, ``aio-threads`` the aio server calling blocking handlers
  in a 16-thread executor (what serving synchronous drivers from aio would take);
* three handlers, registered through generic handlers with identity (raw bytes) serialisation, so no
  .proto or codegen is involved: ``noop`` returns at once, ``sleep_1ms`` blocks 1 ms like a driver
  talking to a device (``time.sleep`` in the sync servers and aio-threads, ``await asyncio.sleep`` in aio),
  and ``cpu_100us`` computes for 100 µs holding the GIL, as placement and the ledger do (run on the loop in
  aio, in the executor in aio-threads);
* client concurrency 1 and 32: one ``grpc.aio`` channel in the parent process with N coroutines
  (the lighter of the two Python clients).

Each point gets a warm-up, then runs until ``--seconds`` elapse or ``--max-calls`` complete, and records
calls/s, p50/p99 latency and the server child's CPU time per call (utime+stime from /proc/PID/stat).
``foreign_cpu_s`` is CPU burnt on the machine by processes other than the client and server during the
point; a large value means the point was disturbed by other work.

Run::

    python bench/grpc_models.py                  # ~30 s, writes bench/out/grpc_models.json
    python bench/grpc_models.py --quick          # 1 s per point, smoke test
    tox -e bench                                 # runs: python bench/grpc_models.py --out bench/out/grpc_models.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import select
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

SERVICE = "disagg.bench.Bench"
HANDLERS = ("noop", "sleep_1ms", "cpu_100us")
MODELS = ("sync", "sync-64", "aio", "aio-threads")
"""sync: 16 pool threads; sync-64: 64; aio: async handlers; aio-threads: blocking handlers run off the loop."""
CONCURRENCIES = (1, 32)
SYNC_WORKERS = 16
DEVICE_IO_S = 0.001
HANDLER_CPU_S = 100e-6
CALL_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 20.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------------- servers


def _compute(seconds: float = HANDLER_CPU_S) -> bytes:
    """Interpreter work for ``seconds`` of thread CPU time, never releasing the GIL on purpose."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(50))
    return b""


def _exit_when_parent_goes(on_eof: Callable[[], None]) -> None:
    """Call ``on_eof`` once stdin closes, so a server never outlives the benchmark that started it."""

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdin.buffer.read()
        on_eof()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _announce(port: int) -> None:
    """Tell the parent which ephemeral port was bound (the only thing a server writes to stdout)."""
    print(f"PORT {port}", flush=True)


def serve_sync(max_lifetime_s: float, workers: int = SYNC_WORKERS) -> None:
    """Thread-pool server: handlers are plain blocking functions, as disagg drivers are."""

    def noop(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    def sleep_1ms(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(DEVICE_IO_S)
        return b""

    def cpu_100us(request: bytes, context: grpc.ServicerContext) -> bytes:
        return _compute()

    # No (de)serializer = bytes pass through unchanged, so no .proto is needed.
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "noop": grpc.unary_unary_rpc_method_handler(noop),
            "sleep_1ms": grpc.unary_unary_rpc_method_handler(sleep_1ms),
            "cpu_100us": grpc.unary_unary_rpc_method_handler(cpu_100us),
        },
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=workers))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    done = threading.Event()
    _exit_when_parent_goes(done.set)
    _announce(port)
    done.wait(timeout=max_lifetime_s)
    server.stop(grace=None).wait(timeout=5)


async def _serve_aio(max_lifetime_s: float, blocking_driver: bool = False) -> None:
    """Event-loop server: an async driver awaits its I/O; a blocking (synchronous) driver must be run in
    threads off the loop (``blocking_driver``), which is what serving disagg's sync drivers from aio costs."""
    pool = ThreadPoolExecutor(max_workers=SYNC_WORKERS)

    async def noop(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return b""

    async def sleep_1ms(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if blocking_driver:
            await asyncio.get_running_loop().run_in_executor(pool, time.sleep, DEVICE_IO_S)
        else:
            await asyncio.sleep(DEVICE_IO_S)
        return b""

    async def cpu_100us(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if blocking_driver:
            return await asyncio.get_running_loop().run_in_executor(pool, _compute)
        return _compute()

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "noop": grpc.unary_unary_rpc_method_handler(noop),
            "sleep_1ms": grpc.unary_unary_rpc_method_handler(sleep_1ms),
            "cpu_100us": grpc.unary_unary_rpc_method_handler(cpu_100us),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(done.set)

    _exit_when_parent_goes(wake)
    _announce(port)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout=max_lifetime_s)
    await server.stop(grace=None)


# ---------------------------------------------------------------------------------------- measurement


@dataclass
class Row:
    """One measured point; the fields the docs quote, plus a noise indicator."""

    server: str
    handler: str
    concurrency: int
    calls: int
    calls_per_s: float
    p50_us: float
    p99_us: float
    server_cpu_us_per_call: float
    foreign_cpu_s: float


@dataclass
class ServerProc:
    """A running server child: its process and the port it bound."""

    model: str
    proc: subprocess.Popen[bytes]
    port: int


def _proc_cpu_s(pid: int) -> float:
    """utime+stime of one process (all its threads) in seconds, from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # comm may contain spaces; skip past it
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of the full line


def _machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine, to estimate interference from other work."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / CLK_TCK


def _percentile_us(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in microseconds."""
    if not sorted_ns:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_ns)))
    return sorted_ns[rank - 1] / 1000


@contextlib.contextmanager
def servers(max_lifetime_s: float) -> Iterator[dict[str, ServerProc]]:
    """Start one child per server model and always stop them all, even when the benchmark fails."""
    started: list[subprocess.Popen[bytes]] = []
    running: dict[str, ServerProc] = {}
    try:
        for model in MODELS:
            cmd = [sys.executable, os.path.abspath(__file__), "--serve", model, "--max-lifetime", str(max_lifetime_s)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            started.append(proc)
            running[model] = ServerProc(model, proc, _read_port(proc))
        yield running
    finally:
        for proc in started:
            _stop(proc)


def _read_port(proc: subprocess.Popen[bytes]) -> int:
    """Wait (bounded) for the child's ``PORT n`` line."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("PORT "):
        raise RuntimeError(f"server {proc.args!r} did not start (exit code {proc.poll()}, got {line!r})")
    return int(line.split()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Close stdin (the polite signal), then terminate, then kill; each step bounded in time."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    for step in (None, proc.terminate, proc.kill):
        if step is not None:
            step()
        try:
            proc.wait(timeout=3)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.stdout is not None:
        proc.stdout.close()


async def _drive(
    call: Callable[[bytes], Awaitable[bytes]], concurrency: int, max_calls: int, seconds: float
) -> tuple[list[int], float]:
    """Run ``concurrency`` coroutines until the count cap or the deadline; return latencies and elapsed s."""
    latencies: list[int] = []
    start = time.perf_counter()
    deadline = start + seconds
    clock = time.perf_counter_ns

    async def worker() -> None:
        while len(latencies) < max_calls and time.perf_counter() < deadline:
            t0 = clock()
            await call(b"")
            latencies.append(clock() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


async def measure(
    srv: ServerProc, handler: str, concurrency: int, *, seconds: float, max_calls: int, warmup: int
) -> Row:
    """Warm up, then measure one (server, handler, concurrency) point."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = channel.unary_unary(f"/{SERVICE}/{handler}")  # no (de)serializer: raw bytes

        async def call(payload: bytes) -> bytes:
            response: bytes = await stub(payload, timeout=CALL_TIMEOUT_S)
            return response

        await _drive(call, concurrency, warmup, CALL_TIMEOUT_S)
        server_cpu0, client_cpu0, busy0 = _proc_cpu_s(srv.proc.pid), time.process_time(), _machine_busy_s()
        latencies, elapsed = await _drive(call, concurrency, max_calls, seconds)
        server_cpu = _proc_cpu_s(srv.proc.pid) - server_cpu0
        client_cpu = time.process_time() - client_cpu0
        busy = _machine_busy_s() - busy0
    latencies.sort()
    n = len(latencies)
    return Row(
        server=srv.model,
        handler=handler,
        concurrency=concurrency,
        calls=n,
        calls_per_s=round(n / elapsed, 1),
        p50_us=round(_percentile_us(latencies, 0.50), 1),
        p99_us=round(_percentile_us(latencies, 0.99), 1),
        server_cpu_us_per_call=round(server_cpu / n * 1e6, 1) if n else math.nan,
        foreign_cpu_s=round(max(0.0, busy - server_cpu - client_cpu), 2),
    )


def verdict(rows: list[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each handler and concurrency: which model answered more calls/s, and by what factor."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for handler in HANDLERS:
        for conc in CONCURRENCIES:
            rate = {r.server: r.calls_per_s for r in rows if r.handler == handler and r.concurrency == conc}
            if set(rate) != set(MODELS):
                continue
            winner = max(MODELS, key=lambda m: rate[m])
            runner_up = max((m for m in MODELS if m != winner), key=lambda m: rate[m])
            out.setdefault(handler, {})[str(conc)] = {
                "faster": winner,
                "runner_up": runner_up,
                "ratio": round(rate[winner] / rate[runner_up], 2) if rate[runner_up] else math.inf,
                "calls_per_s": dict(rate),
                "sync_drivers_best": max(("sync", "sync-64", "aio-threads"), key=lambda m: rate[m]),
            }
    return out


def markdown(rows: list[Row], verdicts: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The table the docs paste in."""
    lines = [
        "| handler | conc | server | calls | calls/s | p50 µs | p99 µs | server CPU µs/call | foreign CPU s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.handler} | {r.concurrency} | {r.server} | {r.calls:,} | {r.calls_per_s:,.0f} | {r.p50_us:,.0f} "
        f"| {r.p99_us:,.0f} | {r.server_cpu_us_per_call:,.0f} | {r.foreign_cpu_s:.2f} |"
        for r in rows
    ]
    lines.append("")
    for handler, by_conc in verdicts.items():
        for conc, v in by_conc.items():
            lines.append(
                f"- {handler}, c={conc}: **{v['faster']}** answered {v['ratio']:.2f}x the calls/s of {v['runner_up']}; "
                f"best with synchronous drivers: {v['sync_drivers_best']}"
            )
    return "\n".join(lines)


async def run_all(running: dict[str, ServerProc], *, seconds: float, max_calls: int, warmup: int) -> list[Row]:
    """All points; the two models run back to back per (handler, concurrency) so drift hits both alike."""
    rows: list[Row] = []
    for i, (handler, conc) in enumerate((h, c) for h in HANDLERS for c in CONCURRENCIES):
        order = MODELS if i % 2 == 0 else MODELS[::-1]  # alternate who goes first
        point = [
            await measure(running[m], handler, conc, seconds=seconds, max_calls=max_calls, warmup=warmup) for m in order
        ]
        rows += sorted(point, key=lambda r: MODELS.index(r.server))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; either serve (child mode) or run the whole benchmark (parent mode)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("bench/out/grpc_models.json"), help="JSON result file")
    p.add_argument("--seconds", type=float, default=3.0, help="measured time per point (default 3)")
    p.add_argument("--max-calls", type=int, default=100_000, help="cap on measured calls per point")
    p.add_argument("--warmup", type=int, default=200, help="warm-up calls per point")
    p.add_argument("--quick", action="store_true", help="1 s per point, for smoke tests")
    p.add_argument("--serve", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--max-lifetime", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.serve in ("sync", "sync-64"):
        serve_sync(args.max_lifetime, 64 if args.serve == "sync-64" else SYNC_WORKERS)
        return 0
    if args.serve in ("aio", "aio-threads"):
        asyncio.run(_serve_aio(args.max_lifetime, blocking_driver=args.serve == "aio-threads"))
        return 0

    seconds = 1.0 if args.quick else args.seconds
    points = len(MODELS) * len(HANDLERS) * len(CONCURRENCIES)
    # Generous upper bound on the run; servers exit on their own after it even if this process is killed -9.
    lifetime = points * (seconds + CALL_TIMEOUT_S) + 2 * STARTUP_TIMEOUT_S
    started = time.time()
    with servers(lifetime) as running:
        rows = asyncio.run(run_all(running, seconds=seconds, max_calls=args.max_calls, warmup=args.warmup))
    verdicts = verdict(rows)

    result = {
        "benchmark": "grpc_models",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": {
            "nproc": len(os.sched_getaffinity(0)),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "loadavg_at_start": os.getloadavg(),
        },
        "settings": {
            "seconds_per_point": seconds,
            "max_calls_per_point": args.max_calls,
            "warmup_calls": args.warmup,
            "concurrencies": list(CONCURRENCIES),
            "sync_server_workers": SYNC_WORKERS,
            "device_io_s": DEVICE_IO_S,
            "client": "grpc.aio, one channel, N coroutines, parent process",
            "transport": "insecure, 127.0.0.1, identity (bytes) serialisation",
            "quick": args.quick,
        },
        "rows": [asdict(r) for r in rows],
        "verdict": verdicts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(rows, verdicts))
    print(f"\nwrote {args.out} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
