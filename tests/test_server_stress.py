"""Randomized concurrency stress of the fabric manager: the regression net for issue 5's concurrency and
crash-consistency clauses.

A real `FabricManagerServer` on a unix socket, over two sim fabrics that keep their state in files (the
hardware, which outlives every server) and bind with a delay, with the durable SQLite ledger. Sixteen client
threads, each on its own guarded channel (a call answered UNKNOWN fails the test), mix for a few seconds:
Compose (APPLY, PREVIEW, RESERVE with time-to-lives of a few seconds), apply and release of those reservations,
UpdateComposition with and without an etag, Decompose, retries of a request id with the same body and with
another one, and calls with a deadline of tens of milliseconds, which end while the server is still at work.
Meanwhile a fault thread fails and repairs GPUs on the sim, and the server reconciles every two seconds. The
hosts and GPUs are few, so the clients fight over them.

Once the load stops and the changes in flight have ended, the fabric manager must hold:

(a) nothing COMPOSING, DECOMPOSING or UNKNOWN, nothing with a change in flight; a FAILED composition (a release
    that a deadline cut short) only where the hardware holds exactly what it lists;
(b) every device a composition lists bound to its host on the sim, every sim binding a composition's;
(c) no device or host held twice, by compositions or reservations;
(d) every allocation the sim carves a composition's, of its size, and each pool's carved bytes what the
    compositions and reservations record;
(e) event revisions without gaps, and no binding or allocation ever quarantined (found with no record);
(f) a request id's retries with the same body answered what it was first answered, another body refused with
    REQUEST_ID_REUSED.

Then the reservations are given back and the ledger reconciled (which heals a DEGRADED composition that a
freed device can now mend), and the server restarts on the same ledger and sim state, failed GPUs and all: that
changes nothing and emits no event, the checks hold again, and two further reconciles change nothing.
(a)-(d) are the crash tests' `violations`.

Why randomized: the defects this guards against are interleavings (a reconcile reading the hardware in the
middle of a change, a retry racing its first attempt, a device failing during an update, a deadline expiring
between two driver calls) that no scripted test names in advance; a seeded mix reaches many of them in seconds.
The seed fixes every choice each thread makes, not the scheduler's interleaving: a failure names its seed, and
running that seed again explores the same neighbourhood. `TestChecksCatch` shows that the checks fail on a
corrupted state, so that a quiet run means something.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import sqlite3
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from composer_helpers import hardware_allocations, hardware_bindings
from crash_helpers import Hardware, describe_compositions, violations
from disagg.client import NO_RETRY, FabricManagerClient
from disagg.composer import FabricComposer, PoolUsage
from disagg.errors import DisaggError
from disagg.interfaces import CallContext, ComposeResult, Fabric
from disagg.model import ComposeMode, Composition, CompositionState, Event, EventType, Reservation
from disagg.requestlang import parse_request
from disagg.store import SqliteStore
from disagg_sim import SimFabric, create_fabric
from server_helpers import Served, guarded_channel, serving, socket_path, wait_until

pytestmark = pytest.mark.slow

SEEDS = (21, 43, 62)
THREADS = 16
LOAD_S = 6.0
"""How long the clients run; the rest of a case (start, settle, checks, restart) takes a fraction of a second."""
QUIET_S = 1.5
"""The end of the load, without decomposes: the state the restart must keep holds compositions."""
HOSTS = 4
GPUS = 10
NAMES = tuple(f"c{n}" for n in range(12))
"""More names than hosts: composes fail for want of a host as often as for want of a GPU."""
BIND_DELAY_S = 0.02
TICK_S = 0.2
RECONCILE_S = 2.0
"""During the load: reconciles race with the changes."""
NO_RECONCILE_S = 3600.0
"""After a restart: the test reconciles itself, and nothing else changes the state it compares."""
CLIENT_TIMEOUT_S = 5.0
SHORT_TIMEOUTS_S = (0.03, 0.06, 0.1)
"""The deadlines of the short calls: a bind takes `BIND_DELAY_S`, so they end in the middle of a change."""
TTL_RANGE_S = (1.0, 3.0)
REUSE_TTL_S = 60.0
"""The time to live of a request id's reuse, a RESERVE: outside `TTL_RANGE_S`, so its request always differs from
the first one (the composer's digest of a RESERVE includes it; an APPLY's does not)."""
RECENT = 20
"""Retries and reuses pick among a thread's last this many requests."""
FAULT_PAUSE_S = (0.2, 0.8)
JOIN_S = 3 * CLIENT_TIMEOUT_S
"""How long all the threads together may take to stop: an operation makes at most two calls."""
EVENT_PAGE = 1000

OPERATIONS = {
    "apply": 14,
    "preview": 4,
    "reserve": 10,
    "apply_reservation": 8,
    "release": 4,
    "update": 22,
    "decompose": 16,
    "retry": 8,
    "reuse": 3,
    "short": 8,
}
"""Operation to weight. "short" is one of `SHORT_OPERATIONS` on a client whose deadline is a short one."""
SHORT_OPERATIONS = ("apply", "update", "decompose", "apply_reservation")
IN_DOUBT = ("DeadlineExceededError", "FabricUnavailableError")
"""Errors that say no answer came: the change may have been made, and its outcome tells nothing."""
IN_FLIGHT = (CompositionState.COMPOSING, CompositionState.DECOMPOSING)
QUARANTINES = (EventType.BINDING_QUARANTINED, EventType.ALLOCATION_QUARANTINED)

PCIE = "".join(
    [
        '[[switch]]\nid = "top"\n\n',
        *(
            f'[[host]]\nid = "h{n}"\ncores = 32\nmemory = "256GiB"\nswitch = "top"\nlatency = "100ns"\n\n'
            for n in range(1, HOSTS + 1)
        ),
        f'[[devices]]\nid_prefix = "gpu"\ncount = {GPUS}\nkind = "gpu"\nswitch = "top"\nlatency = "100ns"\n',
    ]
)
CXL = "".join(
    [
        '[[switch]]\nid = "cxl-top"\nkind = "cxl"\n\n',
        *(
            f'[[host]]\nid = "h{n}"\ncores = 32\nmemory = "256GiB"\nswitch = "cxl-top"\nlatency = "120ns"\n\n'
            for n in range(1, HOSTS + 1)
        ),
        '[[device]]\nid = "cxlmem0"\nkind = "cxl-memory"\nserial = "S0"\nswitch = "cxl-top"\nlatency = "150ns"\n'
        'capacity = "4GiB"\n\n',
        '[[pool]]\nid = "mem0"\ndevice = "cxlmem0"\nkind = "dcd"\nblock_size = "256MiB"\n',
    ]
)
"""The sim topologies: hosts h1 .. h4, GPUs pcie0/gpu0 .. gpu9 on one switch, and one 4 GiB CXL memory pool."""
TOPOLOGIES = {"pcie0": PCIE, "cxl0": CXL}


# ------------------------------------------------------------------------------------------ the rig


@attrs.frozen
class Rig:
    """One case's files under one directory: the topologies, the sim's state files and the SQLite ledger."""

    root: Path

    @classmethod
    def create(cls, root: Path) -> Rig:
        for name, text in TOPOLOGIES.items():
            (root / f"{name}.toml").write_text(text)
        return cls(root)

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.db"

    def fabrics(self) -> dict[str, SimFabric]:
        """The sim fabrics, built afresh from their state files: the hardware as a restarted server finds it."""
        return {
            name: create_fabric(
                name,
                {
                    "topology": str(self.root / f"{name}.toml"),
                    "state_file": str(self.root / f"sim-{name}.json"),
                    "bind_delay_s": BIND_DELAY_S,
                },
            )
            for name in TOPOLOGIES
        }

    @contextlib.contextmanager
    def serving(self, reconcile_s: float) -> Iterator[Served]:
        """A server over the rig's hardware and ledger; stopped (its composer closed) when the block ends."""
        store = SqliteStore(self.ledger)
        with serving(
            socket_path(self.root), self.fabrics(), store=store, tick_s=TICK_S, reconcile_s=reconcile_s
        ) as served:
            yield served


# ------------------------------------------------------------------------------------------ the load


@attrs.define
class Journal:
    """What the clients were answered, per request id in the order the answers came as (body, outcome); the
    reservations they made; and whatever went wrong outside the protocol (a traceback each)."""

    answers: defaultdict[str, list[tuple[str, str]]] = attrs.field(factory=lambda: defaultdict(list))
    reservations: list[str] = attrs.field(factory=list)
    unexpected: list[str] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def answer(self, request_id: str, body: str, outcome: str) -> None:
        with self._lock:
            self.answers[request_id].append((body, outcome))

    def reserved(self, reservation_id: str) -> None:
        with self._lock:
            self.reservations.append(reservation_id)

    def some_reservation(self, rng: random.Random) -> str | None:
        with self._lock:
            return rng.choice(self.reservations) if self.reservations else None

    def failed(self, where: str) -> None:
        with self._lock:
            self.unexpected.append(f"{where}: {traceback.format_exc()}")


@attrs.frozen
class Phases:
    """The load's phases, which the test sets: ``ending`` for its last `QUIET_S`, then ``stop``."""

    ending: threading.Event = attrs.field(factory=threading.Event)
    stop: threading.Event = attrs.field(factory=threading.Event)

    def run(self) -> None:
        """The load's time: a bounded wait on events only the caller sets."""
        self.stop.wait(LOAD_S - QUIET_S)
        self.ending.set()
        self.stop.wait(QUIET_S)


Change = Callable[[FabricManagerClient, str], object]
"""A change made on a client under a request id; returns its answer."""


@attrs.frozen
class Sent:
    """A change a client sent, to retry: its request id, its body (what the composer's digest covers) and how."""

    request_id: str
    body: str
    change: Change


def outcome_of(answer: object) -> str:
    """What a change's answer made, by id: what every retry of it must be answered again."""
    made = (answer.composition or answer.reservation) if isinstance(answer, ComposeResult) else answer
    assert isinstance(made, Composition | Reservation), f"unexpected answer {answer!r}"
    return f"{type(made).__name__} {made.id}"


def request_lines(rng: random.Random) -> list[str]:
    """A Compose's lines: a GPU or a few, CXL memory, sometimes a host."""
    lines = [f"host h{rng.randint(1, HOSTS)}"] if rng.random() < 0.3 else []
    if rng.random() < 0.8:
        lines.append(f"gpu x{rng.choice([1, 1, 1, 2, 3])}")
    if rng.random() < 0.4 or not any(line.startswith("gpu") for line in lines):
        lines.append(f"cxl-memory {rng.choice([256, 512, 1024])}MiB")
    return lines


class StressClient:
    """One client thread: each operation drawn from its own seeded generator, on a client with the long
    deadline or (for "short") on one whose deadline ends mid-change. Retries always take the long one."""

    def __init__(self, number: int, seed: int, address: str, journal: Journal, phases: Phases) -> None:
        self.number = number
        self.phases = phases
        self.rng = random.Random(seed * 1000 + number)
        self.address = address
        self.journal = journal
        self.ids = itertools.count()
        self.sent: list[Sent] = []
        self.client = self._open(CLIENT_TIMEOUT_S)
        self.short = self._open(self.rng.choice(SHORT_TIMEOUTS_S))

    def _open(self, timeout_s: float) -> FabricManagerClient:
        channel = guarded_channel(self.address)
        return FabricManagerClient(self.address, timeout_s=timeout_s, retries=NO_RETRY, channel=channel)

    def close(self) -> None:
        self.client.close()
        self.short.close()

    def run(self) -> None:
        try:
            while not self.phases.stop.is_set():
                self.step()
        except Exception:
            self.journal.failed(f"client {self.number}")

    def step(self) -> None:
        operation = self.rng.choices(list(OPERATIONS), list(OPERATIONS.values()))[0]
        client = self.client
        if operation == "short":
            operation, client = self.rng.choice(SHORT_OPERATIONS), self.short
        try:
            getattr(self, operation)(client)
        except DisaggError:
            pass  # a refusal, or a deadline: the protocol's answers; the invariants judge what they left
        except Exception:
            self.journal.failed(f"client {self.number}, {operation}")

    def _send(self, client: FabricManagerClient, body: Sequence[Any], change: Change) -> object:
        sent = Sent(f"t{self.number}-{next(self.ids)}", json.dumps(body), change)
        self.sent = [*self.sent[-RECENT + 1 :], sent]
        return self._answer(sent.request_id, sent.body, lambda: change(client, sent.request_id))

    def _answer(self, request_id: str, body: str, call: Callable[[], object]) -> object:
        answer: object = None
        try:
            answer = call()
            outcome = outcome_of(answer)
        except DisaggError as exc:
            outcome = f"error {type(exc).__name__} {exc.reason}"
        self.journal.answer(request_id, body, outcome)
        return answer

    def apply(self, client: FabricManagerClient) -> None:
        self._compose(client, ComposeMode.APPLY)

    def reserve(self, client: FabricManagerClient) -> None:
        answer = self._compose(client, ComposeMode.RESERVE)
        if isinstance(answer, ComposeResult) and answer.reservation is not None:
            self.journal.reserved(answer.reservation.id)

    def preview(self, client: FabricManagerClient) -> None:
        client.compose(parse_request(self.rng.choice(NAMES), request_lines(self.rng)), ComposeMode.PREVIEW)

    def _compose(self, client: FabricManagerClient, mode: ComposeMode) -> object:
        name, lines, ttl = self.rng.choice(NAMES), request_lines(self.rng), self.rng.uniform(*TTL_RANGE_S)

        def change(on: FabricManagerClient, request_id: str) -> object:
            return on.compose(parse_request(name, lines), mode, reservation_ttl_s=ttl, request_id=request_id)

        # The time to live is part of a RESERVE only: an APPLY sent again with another is the same request.
        return self._send(
            client, ["compose", mode.value, name, lines, ttl if mode is ComposeMode.RESERVE else None], change
        )

    def apply_reservation(self, client: FabricManagerClient) -> None:
        reservation = self.journal.some_reservation(self.rng)
        if reservation is not None:
            self._send(
                client,
                ["apply", reservation],
                lambda on, request_id: on.apply_reservation(reservation, request_id=request_id),
            )

    def release(self, client: FabricManagerClient) -> None:
        reservation = self.journal.some_reservation(self.rng)
        if reservation is not None:
            client.release_reservation(reservation)

    def update(self, client: FabricManagerClient) -> None:
        comp = self.client.get(self.rng.choice(NAMES))
        add, remove = self._change_to(comp)
        etag = comp.etag if self.rng.random() < 0.5 else None
        resources = list(parse_request("update", add).resources) if add else []

        def change(on: FabricManagerClient, request_id: str) -> object:
            return on.recompose(comp.id, add=resources, remove=remove, expected_etag=etag, request_id=request_id)

        self._send(client, ["update", comp.id, add, remove, etag], change)

    def _change_to(self, comp: Composition) -> tuple[list[str], list[str]]:
        """Lines to add and ids to remove: one added, one removed (while it keeps one), or a GPU swapped."""
        held = [*comp.device_ids, *(a.id for a in comp.allocations)]
        draw = self.rng.random()
        if draw < 0.4:
            return [self.rng.choice(["gpu x1", "cxl-memory 256MiB"])], []
        if draw < 0.8:
            return ([], [self.rng.choice(held)]) if len(held) > 1 else (["gpu x1"], [])
        return ["gpu x1"], (list(comp.device_ids[:1]) if len(comp.devices) > 1 else [])

    def decompose(self, client: FabricManagerClient) -> None:
        name = self.rng.choice(NAMES)
        if not self.phases.ending.is_set():
            client.decompose(name)

    def retry(self, client: FabricManagerClient) -> None:
        if self.sent:
            sent = self.rng.choice(self.sent)
            self._answer(sent.request_id, sent.body, lambda: sent.change(self.client, sent.request_id))

    def reuse(self, client: FabricManagerClient) -> None:
        """A request id sent again with another request: a reservation whose time to live no first request has."""
        if self.sent:
            sent, name = self.rng.choice(self.sent), self.rng.choice(NAMES)
            body = json.dumps(["compose", ComposeMode.RESERVE.value, name, ["gpu x1"], REUSE_TTL_S])
            request = parse_request(name, ["gpu x1"])
            self._answer(
                sent.request_id,
                body,
                lambda: self.client.compose(
                    request, ComposeMode.RESERVE, reservation_ttl_s=REUSE_TTL_S, request_id=sent.request_id
                ),
            )


def inject_faults(fabric: SimFabric, seed: int, phases: Phases, journal: Journal) -> None:
    """Fail or repair a random GPU every fraction of a second until the load stops."""
    rng = random.Random(seed * 7 + 1)
    gpus = [f"pcie0/gpu{n}" for n in range(GPUS)]
    while not phases.stop.wait(rng.uniform(*FAULT_PAUSE_S)):
        device = rng.choice(gpus)
        try:
            if rng.random() < 0.5:
                fabric.fail_device(device, "failed by the stress test")
            else:
                fabric.repair_device(device)
        except Exception:
            journal.failed(f"fault injection on {device}")


def run_load(served: Served, seed: int) -> Journal:
    """`THREADS` clients and the fault thread for `LOAD_S` seconds; every thread joined (bounded) before it
    returns, and none may have hung or met an exception outside the protocol."""
    pcie = served.fabrics["pcie0"]
    assert isinstance(pcie, SimFabric)
    journal, phases = Journal(), Phases()
    faults = threading.Thread(target=inject_faults, args=(pcie, seed, phases, journal), name="faults", daemon=True)
    threads = [faults]
    with contextlib.ExitStack() as clients:
        try:
            for n in range(THREADS):
                worker = StressClient(n, seed, served.address, journal, phases)
                clients.callback(worker.close)
                threads.append(threading.Thread(target=worker.run, name=f"client-{n}", daemon=True))
            for thread in threads:
                thread.start()
            phases.run()
        finally:
            phases.stop.set()
            deadline = time.monotonic() + JOIN_S
            for thread in threads:
                if thread.ident is not None:
                    thread.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"seed {seed}: threads still running {JOIN_S:g} s after the load stopped: {hung}"
    assert not journal.unexpected, f"seed {seed}: " + "\n".join(journal.unexpected[:5])
    return journal


def settle(composer: FabricComposer) -> None:
    """Wait (bounded) until no change is in flight and the heals that device failures started have ended: the
    short calls' changes run on after their callers gave up."""

    def settled() -> bool:
        busy = [c for c in composer.compositions() if c.pending is not None or c.state in IN_FLIGHT]
        return not busy and composer.wait_for_heals(0)

    wait_until(settled, "the changes in flight and the heals to end")


# ------------------------------------------------------------------------------------------ the checks


@attrs.frozen
class Ledger:
    """The composer's records read at once, under its lock, with the event revision they reflect."""

    compositions: tuple[Composition, ...]
    reservations: tuple[Reservation, ...]
    pools: tuple[PoolUsage, ...]
    cordoned: frozenset[str]
    revision: int = attrs.field(eq=False)


def read_ledger(composer: FabricComposer) -> Ledger:
    def read() -> Ledger:
        return Ledger(
            tuple(composer.compositions()),
            tuple(composer.reservations()),
            tuple(composer.usage()[1]),
            frozenset(composer.cordoned_devices()),
            revision=0,
        )

    ledger, revision = composer.snapshot(read)
    return attrs.evolve(ledger, revision=int(revision))


def read_hardware(fabrics: Mapping[str, Fabric]) -> Hardware:
    carved = hardware_allocations(fabrics).values()
    return Hardware(hardware_bindings(fabrics), {(a.pool, a.id): a for a in carved})


def stress_violations(served: Served) -> list[str]:
    """Every broken invariant (a)-(e) of a settled fabric manager, one a line (see the module docstring)."""
    ledger = read_ledger(served.composer)
    return [
        *record_violations(ledger.compositions, read_hardware(served.fabrics)),
        *[f"(a) {c.id} {c.name!r} is UNKNOWN" for c in ledger.compositions if c.state is CompositionState.UNKNOWN],
        *reservation_violations(ledger),
        *carving_violations(ledger),
        *event_violations(served.composer, ledger.revision),
    ]


def record_violations(comps: Sequence[Composition], hardware: Hardware) -> list[str]:
    """The crash tests' `violations` (a)-(d), but for a FAILED composition: a release that a short deadline cut
    off leaves one, and it is right as long as the hardware holds exactly what it lists, which (b) and (d)
    check."""
    failed = {c.id for c in comps if c.state is CompositionState.FAILED}
    return [v for v in violations(comps, hardware) if not (v.startswith("(a) ") and _left_failed(v, failed))]


def _left_failed(line: str, failed: set[str]) -> bool:
    return "was left FAILED" in line and line.split()[1] in failed


def reservation_violations(ledger: Ledger) -> list[str]:
    """(c) for reservations: no device or host a reservation holds is held by anything else as well."""
    holders: defaultdict[str, list[str]] = defaultdict(list)
    for c in ledger.compositions:
        for held in (*c.device_ids, f"host {c.host}"):
            holders[held].append(c.id)
    for r in ledger.reservations:
        for held in (*(p.device for p in r.plan.devices), f"host {r.plan.host}"):
            holders[held].append(r.id)
    reserved = {r.id for r in ledger.reservations}
    return [
        f"(c) {held} is held by {', '.join(ids)}"
        for held, ids in sorted(holders.items())
        if len(ids) > 1 and reserved.intersection(ids)
    ]


def carving_violations(ledger: Ledger) -> list[str]:
    """(d) in bytes: what each pool has carved is what the compositions and the reservations record."""
    parts = [(a.pool, a.amount_bytes) for c in ledger.compositions for a in c.allocations]
    parts += [(m.pool, m.amount_bytes) for r in ledger.reservations for m in r.plan.memory]
    recorded: Counter[str] = Counter()
    for pool, amount in parts:
        recorded[pool] += amount
    return [
        f"(d) pool {p.pool} has {p.total_bytes - p.free_bytes} bytes carved, the records {recorded[p.pool]}"
        for p in ledger.pools
        if p.total_bytes - p.free_bytes != recorded[p.pool]
    ]


def all_events(composer: FabricComposer) -> list[Event]:
    events: list[Event] = []
    while page := composer.events(events[-1].revision if events else 0, EVENT_PAGE):
        events.extend(page)
    return events


def event_violations(composer: FabricComposer, revision: int) -> list[str]:
    """(e): the log holds every revision up to ``revision`` (the ledger's as read), without a gap, and no
    quarantine."""
    events = all_events(composer)
    revisions = [e.revision for e in events]
    out = [f"(e) event revisions jump from {a} to {b}" for a, b in itertools.pairwise(revisions) if b != a + 1]
    if not revisions or revisions[-1] < revision:
        out.append(f"(e) the log ends at revision {revisions[-1] if revisions else 0}, the ledger is at {revision}")
    out += [f"(e) {e.type.value} {e.subject}: {e.message}" for e in events if e.type in QUARANTINES]
    return out


def request_id_violations(answers: Mapping[str, Sequence[tuple[str, str]]]) -> list[str]:
    """(f): once a request id made something, a call with the same body is answered the same and one with
    another body is refused with REQUEST_ID_REUSED. Answers before that say nothing (a refusal forgets the id,
    and a retry runs again), nor do calls that got no answer."""
    out = []
    for request_id, rows in sorted(answers.items()):
        made = next((n for n, (_, outcome) in enumerate(rows) if not outcome.startswith("error")), None)
        if made is None:
            continue
        body, first = rows[made]
        for other, outcome in rows[made + 1 :]:
            if outcome.startswith("error") and outcome.split()[1] in IN_DOUBT:
                continue
            if other == body and outcome != first:
                out.append(f"(f) {request_id} {body} was answered {first!r}, then {outcome!r}")
            elif other != body and "REQUEST_ID_REUSED" not in outcome:
                out.append(f"(f) {request_id} {body} was answered {first!r}, then {other} was answered {outcome!r}")
    return out


def describe(ledger: Ledger, hardware: Hardware) -> str:
    return f"{describe_compositions(ledger.compositions)}\n{hardware.describe()}"


def describe_change(before: tuple[Ledger, Hardware], after: tuple[Ledger, Hardware]) -> str:
    return f"the restart changed the state:\nbefore\n{describe(*before)}\nafter\n{describe(*after)}"


def release_reservations(composer: FabricComposer) -> None:
    """Give back the reservations still held, so that none expires between two states the test compares."""
    for reservation in composer.reservations():
        composer.release_reservation(reservation.id)


def heal_degraded(composer: FabricComposer) -> None:
    """Heal now each DEGRADED composition, so that none heals between two states the test compares: a heal whose
    binds failed (a spare the fault thread failed meanwhile) is tried again only after a back-off of reconcile
    passes (`FabricComposer._heal_waits`), which the server's timer may end while the test reads. One that finds no
    replacement stays DEGRADED, and every pass tries it again without changing it."""
    for comp in composer.compositions():
        if comp.state is CompositionState.DEGRADED:
            with contextlib.suppress(DisaggError):
                composer.heal(comp.id)


# ------------------------------------------------------------------------------------------ the tests


class TestRandomLoad:
    """After a seeded random load, and again after a restart on the same ledger and hardware, every invariant
    holds, the restart changes nothing, and reconciles change nothing."""

    @pytest.mark.parametrize("seed", SEEDS)
    def test_invariants_hold_and_a_restart_changes_nothing(self, tmp_path: Path, seed: int) -> None:
        rig = Rig.create(tmp_path)
        with rig.serving(RECONCILE_S) as served:
            journal = run_load(served, seed)
            settle(served.composer)
            assert stress_violations(served) == [], f"seed {seed}"
            assert request_id_violations(journal.answers) == [], f"seed {seed}"
            release_reservations(served.composer)
            served.composer.reconcile()  # heals what the reservations held back
            heal_degraded(served.composer)  # and what waits out a back-off; then nothing is left to change
            settle(served.composer)  # a heal the timer had started meanwhile
            assert (served.composer.reconcile(), served.composer.reconcile()) == (0, 0), f"seed {seed}"
            before = (read_ledger(served.composer), read_hardware(served.fabrics))
            revision = served.composer.revision
        with rig.serving(NO_RECONCILE_S) as served:
            settle(served.composer)
            after = (read_ledger(served.composer), read_hardware(served.fabrics))
            assert after == before, f"seed {seed}: " + describe_change(before, after)
            assert list(served.composer.events(revision)) == [], f"seed {seed}: the restart emitted events"
            assert stress_violations(served) == [], f"seed {seed}, after the restart"
            assert (served.composer.reconcile(), served.composer.reconcile()) == (0, 0), f"seed {seed}"


def compose_two(composer: FabricComposer) -> tuple[Composition, Composition]:
    """Two compositions with GPUs and memory, directly on the composer: a small settled state to corrupt."""
    made = [composer.compose(parse_request(name, ["gpu x2", "cxl-memory 512MiB"])).composition for name in ("a", "b")]
    assert made[0] is not None and made[1] is not None
    return made[0], made[1]


class TestChecksCatch:
    """The checks pass a settled state and name each corruption of it: they can fail."""

    def test_a_binding_made_behind_the_composers_back(self, tmp_path: Path) -> None:
        with Rig.create(tmp_path).serving(NO_RECONCILE_S) as served:
            compose_two(served.composer)
            assert stress_violations(served) == []
            device = next(f"pcie0/gpu{n}" for n in range(GPUS) if f"pcie0/gpu{n}" not in served.bindings())
            served.fabrics["pcie0"].bind(device, "h1", CallContext(epoch=served.composer.epoch))
            found = stress_violations(served)
        assert [v for v in found if v.startswith(f"(b) orphaned binding: {device}")], found

    def test_a_composition_deleted_from_the_ledger(self, tmp_path: Path) -> None:
        rig = Rig.create(tmp_path)
        with rig.serving(NO_RECONCILE_S) as served:
            lost, _ = compose_two(served.composer)
            before = (read_ledger(served.composer), read_hardware(served.fabrics))
        with contextlib.closing(sqlite3.connect(rig.ledger)) as db, db:
            db.execute("DELETE FROM compositions WHERE id = ?", (lost.id,))
        with rig.serving(NO_RECONCILE_S) as served:
            after = (read_ledger(served.composer), read_hardware(served.fabrics))
            found = stress_violations(served)
        assert after != before
        for device in lost.device_ids:
            assert [v for v in found if v.startswith(f"(b) orphaned binding: {device}")], found
            assert [v for v in found if v.startswith(f"(e) BindingQuarantined {device}")], found
        assert [v for v in found if v.startswith(f"(d) leaked allocation: cxl0/mem0:{lost.id}")], found

    def test_an_event_deleted_from_the_ledger(self, tmp_path: Path) -> None:
        rig = Rig.create(tmp_path)
        with rig.serving(NO_RECONCILE_S) as served:
            compose_two(served.composer)
        with contextlib.closing(sqlite3.connect(rig.ledger)) as db, db:
            db.execute("DELETE FROM events WHERE revision = 2")
        with rig.serving(NO_RECONCILE_S) as served:
            found = stress_violations(served)
        assert "(e) event revisions jump from 1 to 3" in found, found

    def test_a_request_id_answered_twice_or_reused_quietly(self) -> None:
        answers = {
            "same": [("A", "error NoFitError NO_FIT"), ("A", "Composition c-1"), ("A", "Composition c-2")],
            "reused": [("A", "Composition c-1"), ("B", "Composition c-1")],
            "fine": [
                ("A", "Composition c-1"),
                ("A", "error DeadlineExceededError DEADLINE_EXCEEDED"),
                ("B", "error RequestIdReusedError REQUEST_ID_REUSED"),
                ("A", "Composition c-1"),
            ],
        }
        found = request_id_violations(answers)
        assert [v.split()[1] for v in found] == ["reused", "same"], found
