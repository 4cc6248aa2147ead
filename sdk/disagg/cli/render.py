"""Plain-text tables for people and JSON for scripts."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from disagg import codec
from disagg.composer import KindUsage, PoolUsage
from disagg.model import Composition, Reservation, format_size


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO | None = None) -> None:
    """Columns padded to their widest cell; an empty table prints ``(none)``."""
    stream = out or sys.stdout
    if not rows:
        stream.write("  (none)\n")
        return
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        stream.write("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
        if n == 0:
            stream.write("  " + "  ".join("-" * w for w in widths) + "\n")


def emit_json(value: Any, out: TextIO | None = None) -> None:
    (out or sys.stdout).write(json.dumps(codec.to_public_data(value), indent=2, sort_keys=True) + "\n")


def composition_rows(comps: Sequence[Composition]) -> list[list[object]]:
    rows: list[list[object]] = []
    for c in comps:
        memory = sum(a.amount_bytes for a in c.allocations)
        rows.append(
            [
                c.name,
                c.id,
                c.host,
                c.state.value,
                len(c.devices),
                format_size(memory) if memory else "-",
                c.message or "",
            ]
        )
    return rows


COMPOSITION_HEADERS = ("NAME", "ID", "HOST", "STATE", "DEVICES", "CXL MEMORY", "NOTE")


def show_compositions(comps: Sequence[Composition], out: TextIO | None = None) -> None:
    table(COMPOSITION_HEADERS, composition_rows(comps), out)


def show_composed(comp: Composition, out: TextIO | None = None) -> None:
    """What `compose` and `apply` print for the composition they made."""
    (out or sys.stdout).write(f"composed {comp.name} ({comp.id}) on {comp.host}\n")
    show_composition_devices(comp, out)


def timestamp(seconds: float) -> str:
    """A time as the ledger keeps it (seconds since the epoch) in UTC, to the second."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


def reservation_next_steps(reservation_id: str) -> str:
    """How to use a reservation: a plan held with `compose --reserve` blocks its devices and its name until then."""
    return f"disagg apply {reservation_id} composes it, disagg release {reservation_id} gives it back"


RESERVATION_HEADERS = ("RESERVATION", "NAME", "HOST", "DEVICES", "CXL MEMORY", "EXPIRES")


def show_reservations(reservations: Sequence[Reservation], out: TextIO | None = None) -> None:
    rows: list[list[object]] = []
    for r in reservations:
        memory = sum(m.amount_bytes for m in r.plan.memory)
        rows.append(
            [
                r.id,
                r.request.name,
                r.plan.host,
                len(r.plan.devices),
                format_size(memory) if memory else "-",
                timestamp(r.expires_at),
            ]
        )
    table(RESERVATION_HEADERS, rows, out)


def show_composition_devices(comp: Composition, out: TextIO | None = None) -> None:
    rows: list[list[object]] = [[p.device, f"{p.latency_ns} ns", f"#{p.resource}"] for p in comp.devices]
    rows += [[f"{a.pool} ({a.id})", format_size(a.amount_bytes), f"{len(a.extents)} extents"] for a in comp.allocations]
    table(("DEVICE / ALLOCATION", "LATENCY / SIZE", "LINE"), rows, out)


def show_usage(kinds: Sequence[KindUsage], pools: Sequence[PoolUsage], out: TextIO | None = None) -> None:
    table(
        ("KIND", "TOTAL", "FREE", "USED", "UNHEALTHY"),
        [[k.kind.value, k.total, k.free, k.used, k.unhealthy] for k in kinds],
        out,
    )
    if pools:
        table(
            ("POOL", "DEVICE", "CAPACITY", "FREE", "USED %"),
            [
                [
                    p.pool,
                    p.device,
                    format_size(p.total_bytes),
                    format_size(p.free_bytes),
                    f"{100 * (p.total_bytes - p.free_bytes) / p.total_bytes:.0f}%" if p.total_bytes else "-",
                ]
                for p in pools
            ],
            out,
        )
