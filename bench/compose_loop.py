"""The composer's own cost per Compose on the event loop, without gRPC: a tool for finding where it goes.

`bench/grpc_compose.py` measures Compose against a no-op over gRPC, where the machine's drift moves every
figure by a tenth between runs. This runs the asyncio servicer's Compose in one process, from 32 concurrent
callers on one event loop (as `disagg serve` does, less gRPC), on a generated sim fabric, and reports the loop
thread's CPU per Compose. Under valgrind its instruction count does not drift: the difference between two call
counts is the cost of the calls alone, start-up excluded, which is how docs/benchmarks.md counts a change::

    valgrind --tool=callgrind --separate-threads=yes python bench/compose_loop.py --calls 200
    valgrind --tool=callgrind --separate-threads=yes python bench/compose_loop.py --calls 1000

(the loop is the main thread, the first file; its total for 1,000 less that for 200, over 800). ``--profile``
writes a cProfile of the measured calls instead, for their call counts. Each Compose holds a host, so
``--calls`` plus the ``--warm-up`` calls (200) must stay within the fabric's hosts (1,400 at 10,000 devices);
more are refused before the fabric is built.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from disagg.config import build_composer, parse_config
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.server.aio import AsyncFabricManagerServicer
from disagg.server.loop import event_loop_factory
from disagg.server.servicer import FabricManagerServicer

sys.path.insert(0, str(Path(__file__).parent))
from grpc_compose import compose_capacity, compose_request  # the same request and fabric as the gRPC benchmark

CLIENTS = 32
DEVICES_STEP = 1_000
"""The granularity of the --devices the refusal of too many Composes suggests."""


class _Call:
    """The little of a gRPC call's context that Compose reads: no deadline."""

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> bool:
        return False


async def _compose_all(servicer: AsyncFabricManagerServicer, requests: list[fm.ComposeRequest]) -> None:
    queue = list(requests)
    call: Any = _Call()

    async def client() -> None:
        while queue:
            await servicer.Compose(queue.pop(), call)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))


async def _measure(servicer: AsyncFabricManagerServicer, calls: int, warm_up: int, profile: Path | None) -> float:
    """Loop CPU seconds per Compose over ``calls`` Composes, after ``warm_up`` others."""
    await _compose_all(servicer, [compose_request(f"warm-{n}") for n in range(warm_up)])
    requests = [compose_request(f"c-{n}") for n in range(calls)]
    profiler = cProfile.Profile() if profile is not None else None
    started = time.thread_time()
    if profiler is not None:
        profiler.enable()
    await _compose_all(servicer, requests)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)  # type: ignore[arg-type]
    return (time.thread_time() - started) / calls


def devices_for(composes: int, devices: int, holds: int) -> int:
    """The fewest devices, in `DEVICES_STEP`, whose generated fabric holds ``composes``: guessed from what
    ``devices`` hold (hosts grow with devices), then counted."""
    guess = -(-composes * devices // max(holds, 1))
    more = max(DEVICES_STEP, -(-guess // DEVICES_STEP) * DEVICES_STEP)
    while compose_capacity(more) < composes:
        more += DEVICES_STEP
    return more


def check_room(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before the fabric is built, more Composes than its hosts hold: the calls ran until a NoFitError."""
    if args.devices < 1 or args.calls < 1 or args.warm_up < 0:
        parser.error("--devices and --calls must be 1 or more, --warm-up 0 or more")
    composes = args.calls + args.warm_up
    holds = compose_capacity(args.devices)
    if composes > holds:
        more = devices_for(composes, args.devices, holds)
        parser.error(
            f"--calls {args.calls} and --warm-up {args.warm_up} make {composes} Composes, but a fabric of --devices "
            f"{args.devices} holds {holds} (one a host with 32 cores or more): give --devices {more} (it holds "
            f"{compose_capacity(more)}), or fewer --calls"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=1_000)
    parser.add_argument("--warm-up", type=int, default=200, help="Composes before the measured ones")
    parser.add_argument("--ledger", choices=("memory", "sqlite"), default="sqlite")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the measured calls here")
    args = parser.parse_args()
    check_room(parser, args)
    with tempfile.TemporaryDirectory() as state:
        doc = {
            "state": {"ledger": args.ledger, "path": os.path.join(state, "ledger.db")},
            "fabric": [{"name": "bench", "driver": "sim", "options": {"generate": {"devices": args.devices}}}],
        }
        composer = build_composer(parse_config(doc, "bench/compose_loop.py", {"DISAGG_STATE_DIR": state}))
        composer.start()
        gc.collect()
        gc.freeze()  # as `disagg serve` does after discovery
        try:
            with ThreadPoolExecutor(8) as threads:
                servicer = FabricManagerServicer(composer)
                servicer.mark_ready()
                serving = AsyncFabricManagerServicer(servicer, threads)
                with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # the server's loop
                    per_call = runner.run(_measure(serving, args.calls, args.warm_up, args.profile))
        finally:
            composer.close()
    size = f"{args.calls} Composes, {args.ledger} ledger, {args.devices} devices"
    print(f"{size}: {per_call * 1e6:.1f} µs of loop CPU each")


if __name__ == "__main__":
    main()
