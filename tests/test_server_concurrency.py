"""Concurrent clients against a real server on a unix socket, over a small sim rack (four hosts, three GPUs) and
the durable SQLite ledger: the race for the last free GPU, etags that went stale before or during an update,
and an update racing a decompose of the same composition.

Every call goes through real gRPC stubs from threads released together by a barrier. After each race the
outcome is checked three ways: what the sim driver holds bound, what ListCompositions answers, and what the
ledger file holds when opened again (what a restarted server would find). Every loop is bounded in rounds and
in time, and every call carries a deadline.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from composer_helpers import compositions_on_disk
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces import Fabric
from disagg.store import SqliteStore
from disagg.wire.fabric import composition_to_wire
from disagg_sim import create_fabric
from server_helpers import (
    WAIT_S,
    Failure,
    Served,
    compose_request,
    failure_of,
    gpu,
    guarded_channel,
    serving,
    socket_path,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("front_end")

GPUS = 3
HOSTS = 4
TOPOLOGY = (
    'description = "one switch, four hosts and three GPUs: the GPUs run out before the hosts do"\n\n'
    '[[switch]]\nid = "top"\n\n'
    + "".join(
        f'[[host]]\nid = "h{n}"\ncores = 32\nmemory = "256GiB"\nswitch = "top"\nlatency = "100ns"\n\n'
        for n in range(1, HOSTS + 1)
    )
    + f'[[devices]]\nid_prefix = "gpu"\ncount = {GPUS}\nkind = "gpu"\nswitch = "top"\nlatency = "100ns"\n'
)
"""A sim topology file: ``pcie0/gpu0`` .. ``pcie0/gpu2`` and hosts h1 .. h4, all on one switch."""

BUSY_STATES = (fm.COMPOSITION_STATE_COMPOSING, fm.COMPOSITION_STATE_DECOMPOSING)
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
BUDGET_S = 15.0
"""The longest the rounds of one test may take together."""


@attrs.frozen
class Outcome:
    """How one call ended: OK with its reply, or an error code with what the error carried."""

    code: grpc.StatusCode
    reply: Any = None
    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


def outcome(call: Callable[..., Any], request: Any) -> Outcome:
    """Make one unary call with a deadline; never raises a gRPC error, returns how it ended."""
    try:
        reply = call(request, timeout=WAIT_S)
    except grpc.RpcError as err:
        return Outcome(err.code(), failure=failure_of(err))
    return Outcome(grpc.StatusCode.OK, reply=reply)


def later(wait_s: float, call: Callable[..., Any], request: Any) -> Callable[[], Outcome]:
    """A call to make ``wait_s`` seconds after it is started, for `together`."""

    def run() -> Outcome:
        time.sleep(wait_s)
        return outcome(call, request)

    return run


def brief(result: Outcome) -> str:
    """One line for an assertion message: the code, and the devices of a composition or the error's message."""
    if result.failure is not None:
        return f"{result.code.name} ({result.failure.reason}: {result.failure.message})"
    comp = getattr(result.reply, "composition", None)
    return f"OK {devices_of(comp)} {fm.CompositionState.Name(comp.state)}" if comp is not None else "OK"


def together(*calls: Callable[[], Outcome]) -> list[Outcome]:
    """Run each of ``calls`` on its own thread, all released at once by a barrier; their outcomes in order."""
    start = threading.Barrier(len(calls), timeout=WAIT_S)

    def run(call: Callable[[], Outcome]) -> Outcome:
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls), thread_name_prefix="client") as pool:
        futures = [pool.submit(run, call) for call in calls]
        return [f.result(timeout=2 * WAIT_S) for f in futures]


def rounds(count: int, budget_s: float = BUDGET_S) -> Iterator[int]:
    """``range(count)``, failing the test if the rounds together take longer than ``budget_s``."""
    deadline = time.monotonic() + budget_s
    for n in range(count):
        assert time.monotonic() < deadline, f"round {n} of {count} started after the {budget_s:g} s budget"
        yield n


@attrs.define
class Rack:
    """A running server over the small sim rack, with the SQLite ledger file it writes."""

    served: Served
    fabric: Fabric
    ledger: Path

    @property
    def stub(self) -> fm_grpc.FabricManagerServiceStub:
        return self.served.stub

    def bound(self) -> list[tuple[str, str]]:
        """(device, host) of every binding the sim driver holds, as a list: a repeat would show."""
        return sorted((b.device, b.host) for b in self.fabric.bindings())

    def listing(self) -> fm.ListCompositionsResponse:
        reply = self.stub.ListCompositions(fm.ListCompositionsRequest(page_size=1000), timeout=WAIT_S)
        assert not reply.next_page_token
        return reply

    def durable(self) -> dict[str, fm.Composition]:
        """The compositions in the ledger file, read through a second store on it, in wire form by id."""
        return {c.id: composition_to_wire(c) for c in compositions_on_disk(self.ledger)}

    def free_gpus(self) -> int:
        reply = self.stub.ListPools(fm.ListPoolsRequest(), timeout=WAIT_S)
        (usage,) = [k for k in reply.kinds if k.kind == pb.DEVICE_KIND_GPU]
        assert usage.total == GPUS
        return usage.free

    def get(self, key: str) -> fm.Composition:
        return self.stub.GetComposition(fm.GetCompositionRequest(id=key), timeout=WAIT_S).composition

    def compose(self, name: str, *lines: fm.ResourceRequest) -> fm.Composition:
        return self.stub.Compose(compose_request(name, *lines), timeout=WAIT_S).composition

    def decompose(self, key: str) -> None:
        self.stub.Decompose(fm.DecomposeRequest(id=key), timeout=WAIT_S)

    def check_consistent(self) -> list[fm.Composition]:
        """The live compositions, after checking that none is mid-change, that the ledger file holds exactly
        them, that the driver binds exactly their devices to their hosts, and that the free GPU count agrees."""
        comps = list(self.listing().compositions)
        assert [c.name for c in comps if c.state in BUSY_STATES] == []
        live = {c.id: c for c in comps}
        # A Compose answers before its COMPOSED record is on disk; the next commit, at once, holds it.
        wait_until(lambda: self.durable() == live, "the ledger file to hold exactly the live compositions")
        held = sorted((p.device, c.host) for c in comps for p in c.devices)
        assert self.bound() == held
        assert self.free_gpus() == GPUS - len(held)
        return comps


@contextlib.contextmanager
def small_rack(tmp_path: Path, *, bind_delay_s: float = 0.0, **server_options: Any) -> Iterator[Rack]:
    """A server on a unix socket over the small sim rack and a SQLite ledger in ``tmp_path``."""
    topology = tmp_path / "three-gpus.toml"
    topology.write_text(TOPOLOGY)
    fabric = create_fabric("pcie0", {"topology": str(topology), "bind_delay_s": bind_delay_s})
    ledger = tmp_path / "state" / "ledger.db"
    with serving(socket_path(tmp_path), {"pcie0": fabric}, store=SqliteStore(ledger), **server_options) as served:
        yield Rack(served, fabric, ledger)


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[Rack]:
    with small_rack(tmp_path) as running:
        yield running


@contextlib.contextmanager
def clients(address: str, count: int) -> Iterator[list[fm_grpc.FabricManagerServiceStub]]:
    """``count`` clients of the server at ``address``, each on its own guarded channel."""
    channels = [guarded_channel(address) for _ in range(count)]
    try:
        yield [fm_grpc.FabricManagerServiceStub(c) for c in channels]
    finally:
        for channel in channels:
            channel.close()


@pytest.fixture
def stubs(rack: Rack) -> Iterator[Sequence[fm_grpc.FabricManagerServiceStub]]:
    """32 clients of the rack's server, each on its own channel."""
    with clients(rack.served.address, 32) as made:
        yield made


def devices_of(comp: fm.Composition) -> list[str]:
    return [p.device for p in comp.devices]


class TestLastFreeDevice:
    """Of 32 concurrent composes for the last free GPU exactly one gets it, once; the others are RESOURCE_EXHAUSTED."""

    ROUNDS = 5

    def test_32_clients_race_for_the_last_gpu(
        self, rack: Rack, stubs: Sequence[fm_grpc.FabricManagerServiceStub]
    ) -> None:
        holders = [rack.compose(f"holder-{n}") for n in range(GPUS - 1)]
        (last,) = {f"pcie0/gpu{n}" for n in range(GPUS)} - {d for h in holders for d in devices_of(h)}
        for n in rounds(self.ROUNDS):
            assert rack.free_gpus() == 1
            names = [f"race-{n}-{k}" for k in range(len(stubs))]
            outcomes = together(
                *(
                    functools.partial(outcome, stub.Compose, compose_request(name))
                    for stub, name in zip(stubs, names, strict=True)
                )
            )
            codes = [o.code for o in outcomes]
            assert codes.count(grpc.StatusCode.OK) == 1, codes
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == len(stubs) - 1, codes
            for lost in (o for o in outcomes if not o.ok):
                assert lost.failure is not None and lost.failure.reason == "NO_FIT", lost
                assert "gpu" in lost.failure.message
            (won,) = (o.reply.composition for o in outcomes if o.ok)
            assert won.name in names and won.state == fm.COMPOSITION_STATE_COMPOSED
            assert devices_of(won) == [last]
            assert [b for b in rack.bound() if b[0] == last] == [(last, won.host)]
            comps = rack.check_consistent()
            assert sorted(c.name for c in comps) == sorted([*(h.name for h in holders), won.name])
            assert [c.id for c in comps if last in devices_of(c)] == [won.id]
            assert rack.get(won.id) == won
            rack.decompose(won.id)
            assert last not in dict(rack.bound())
            assert sorted(c.id for c in rack.check_consistent()) == sorted(h.id for h in holders)


class TestStaleEtag:
    """An UpdateComposition whose etag a change made stale is FAILED_PRECONDITION and changes nothing at all."""

    def test_refused_and_nothing_changes(self, rack: Rack) -> None:
        first = rack.compose("guarded")
        grown = rack.stub.UpdateComposition(
            fm.UpdateCompositionRequest(id=first.id, add=[gpu()], etag=first.etag), timeout=WAIT_S
        ).composition
        assert grown.etag != first.etag and len(grown.devices) == 2
        before = (rack.get(first.id), rack.listing(), rack.bound(), rack.durable())
        assert before[0] == grown
        stale = [
            fm.UpdateCompositionRequest(id=first.id, add=[gpu()], etag=first.etag),
            fm.UpdateCompositionRequest(id=first.id, remove=[first.devices[0].device], etag=first.etag),
            fm.UpdateCompositionRequest(id="guarded", add=[gpu()], remove=devices_of(first), etag=first.etag),
        ]
        for request in stale:
            refused = outcome(rack.stub.UpdateComposition, request)
            assert refused.code is grpc.StatusCode.FAILED_PRECONDITION, refused
            assert refused.failure is not None and refused.failure.reason == "CONFLICT"
            assert refused.failure.preconditions == (("CONFLICT", first.id),)
            assert refused.failure.metadata["etag"] == grown.etag
            assert (rack.get(first.id), rack.listing(), rack.bound(), rack.durable()) == before
        rack.check_consistent()
        current = rack.stub.UpdateComposition(
            fm.UpdateCompositionRequest(id=first.id, add=[gpu()], etag=grown.etag), timeout=WAIT_S
        ).composition
        assert len(current.devices) == GPUS and len(rack.bound()) == GPUS


class TestRacingEtags:
    """Of two updates sent together with the same etag exactly one applies; the other is refused as stale."""

    ROUNDS = 10

    def test_one_wins_and_the_other_adds_nothing(
        self, rack: Rack, stubs: Sequence[fm_grpc.FabricManagerServiceStub]
    ) -> None:
        for n in rounds(self.ROUNDS):
            comp = rack.compose(f"twice-{n}")
            request = fm.UpdateCompositionRequest(id=comp.id, add=[gpu()], etag=comp.etag)
            outcomes = together(*(functools.partial(outcome, s.UpdateComposition, request) for s in stubs[:2]))
            codes = sorted((o.code for o in outcomes), key=lambda c: c.name)
            assert codes == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK], codes
            (won,) = (o.reply.composition for o in outcomes if o.ok)
            (lost,) = (o.failure for o in outcomes if not o.ok)
            assert lost is not None and lost.reason == "CONFLICT" and lost.preconditions == (("CONFLICT", comp.id),)
            assert len(won.devices) == 2 and devices_of(won)[0] == devices_of(comp)[0]
            (now,) = rack.check_consistent()
            assert now == won
            rack.decompose(comp.id)
            assert rack.check_consistent() == []


class TestUpdateAgainstDecompose:
    """An update and a decompose of one composition sent together end as one of the two serial orders would."""

    BIND_DELAY_S = 0.02
    OFFSETS_S = (-0.06, 0.06, 0.0, 0.005, 0.01, 0.015, -0.005, -0.01, 0.03, -0.03)
    """How much later than the update the decompose is sent (negative: earlier); the first two force an order."""
    ROUNDS = 20

    def test_ends_as_a_serial_order(self, tmp_path: Path) -> None:
        """Update then decompose: the update answers OK with the added GPU, then the composition is gone.
        Decompose then update: the composition is gone and the update is NOT_FOUND, or FAILED_PRECONDITION
        (CONFLICT) when it arrived while the decompose was still releasing (the documented answer for a
        composition in the wrong state, or for an etag the decompose made stale). Either way the decompose answers
        OK, nothing of the composition stays bound, and no composition is left COMPOSING or DECOMPOSING.

        Each bind and unbind takes simulated time, and the decompose is sent at staggered offsets from the
        update, so that it lands before, during and after the update's bind; both orders must be seen.
        """
        seen: dict[str, int] = {}
        with small_rack(tmp_path, bind_delay_s=self.BIND_DELAY_S) as rack, clients(rack.served.address, 2) as two:
            updater, decomposer = two
            for n in rounds(self.ROUNDS):
                comp = rack.compose(f"pair-{n}")
                offset = self.OFFSETS_S[n % len(self.OFFSETS_S)]
                etag = comp.etag if n % 2 else ""  # half the rounds guard the update with the etag
                updated, decomposed = together(
                    later(
                        max(0.0, -offset),
                        updater.UpdateComposition,
                        fm.UpdateCompositionRequest(id=comp.id, add=[gpu()], etag=etag),
                    ),
                    later(max(0.0, offset), decomposer.Decompose, fm.DecomposeRequest(id=comp.id)),
                )
                where = (
                    f"round {n}, decompose {offset * 1000:+.0f} ms after the update, etag {etag!r}: "
                    f"update {brief(updated)}, decompose {brief(decomposed)}"
                )
                assert updated.code not in NEVER and decomposed.code not in NEVER, where
                assert decomposed.ok, where
                if updated.ok:
                    order = "update first"
                    grown = updated.reply.composition
                    assert grown.id == comp.id and grown.state == fm.COMPOSITION_STATE_COMPOSED, where
                    assert len(grown.devices) == 2 and devices_of(grown)[0] == devices_of(comp)[0], where
                elif updated.code is grpc.StatusCode.NOT_FOUND:
                    order = "decompose first"
                    assert updated.failure is not None and updated.failure.resource == ("composition", comp.id), where
                elif updated.code is grpc.StatusCode.FAILED_PRECONDITION:
                    order = "decompose first"
                    assert updated.failure is not None and updated.failure.reason == "CONFLICT", where
                    assert updated.failure.preconditions == (("CONFLICT", comp.id),), where
                else:
                    raise AssertionError(f"not an outcome of either serial order: {where}")
                seen[order] = seen.get(order, 0) + 1
                gone = outcome(rack.stub.GetComposition, fm.GetCompositionRequest(id=comp.id))
                assert gone.code is grpc.StatusCode.NOT_FOUND, f"{where}; then GetComposition: {brief(gone)}"
                left = [d for d, host in rack.bound() if host == comp.host]
                assert left == [], f"{where}; then still bound to {comp.host}: {left}"
                assert rack.check_consistent() == [], where
        assert set(seen) == {"update first", "decompose first"}, seen


class TestManyChangesOfOneComposition:
    """More changes of one composition than the server has worker threads: each waits for the one before it,
    and the one holding the composition still gets a thread for its driver calls."""

    def test_every_decompose_waiting_behind_an_update_ends(self, tmp_path: Path) -> None:
        """Waits for the composition took the threads its holder needed for its unbinds: nothing moved until
        they timed out, and they answered CONFLICT (or, with a client deadline, left devices bound)."""
        with (
            small_rack(tmp_path, bind_delay_s=0.3, workers=2, max_watches=1) as rack,
            clients(rack.served.address, 9) as nine,
        ):
            rack.served.composer.call_timeout_s = 3.0
            comp = rack.compose("busy")
            update = later(0.0, nine[0].UpdateComposition, fm.UpdateCompositionRequest(id=comp.id, add=[gpu()]))
            decomposes = [later(0.1, stub.Decompose, fm.DecomposeRequest(id=comp.id)) for stub in nine[1:]]
            updated, *decomposed = together(update, *decomposes)
            assert updated.ok, brief(updated)
            assert [brief(d) for d in decomposed if not d.ok] == []
            assert outcome(rack.stub.GetComposition, fm.GetCompositionRequest(id=comp.id)).code is (
                grpc.StatusCode.NOT_FOUND
            )
            assert rack.bound() == [] and rack.check_consistent() == []

    def test_updates_waiting_for_the_composition_hold_no_worker_thread(self, tmp_path: Path) -> None:
        """Each UpdateComposition waiting for the composition held one of the server's worker threads: with
        them all taken, a listing waited behind the updates for the composition, as if it were one of them.
        Updates wait on the event loop now, as Compose and Decompose do, and the listing answers meanwhile."""
        with (
            small_rack(tmp_path, bind_delay_s=0.5, workers=2, max_watches=1) as rack,
            clients(rack.served.address, 7) as seven,
        ):
            comp = rack.compose("busy")
            ended: dict[str, float] = {}

            def timed(name: str, wait_s: float, call: Callable[..., Any], request: Any) -> Callable[[], Outcome]:
                def run() -> Outcome:
                    done = later(wait_s, call, request)()
                    ended[name] = time.monotonic()
                    return done

                return run

            add = fm.UpdateCompositionRequest(id=comp.id, add=[gpu()])
            updates = [
                timed(f"update {n}", 0.1 * (n > 0), stub.UpdateComposition, add) for n, stub in enumerate(seven[1:])
            ]
            listing = timed("listing", 0.25, seven[0].ListCompositions, fm.ListCompositionsRequest())
            listed, *updated = together(listing, *updates)
            assert listed.ok, brief(listed)
            assert [u.code for u in updated].count(grpc.StatusCode.OK) == 2  # the rack's two free GPUs
            second = sorted(ended[f"update {n}"] for n in range(len(updates)))[1]
            assert ended["listing"] < second, "the listing waited for the updates' threads"
            assert [len(c.devices) for c in rack.check_consistent()] == [3]
