"""Crash consistency: ``disagg serve`` is killed (SIGKILL) at every named failpoint of the compose, recompose,
decompose and heal paths, at its first, second and sometimes third hit, then restarted without failpoints.

After the restart the ledger (what ListCompositions answers, then the SQLite file once the server stopped) is
held against the hardware (the sim's state file, read into a fresh fabric in this process): nothing stuck
midway, no binding or allocation without a record nor a record without one, nothing in two compositions, no
composition the client saw completed lost. The restarted server composes and decomposes again, and the request
in flight at the crash, sent again with its request id, is applied once. See tests/crash_helpers.py for the
workload that reaches each failpoint.

The heal failpoints are reached by the heal at start-up of a server that finds devices failed while it was down
(`prepare_heal`): killed there, and restarted, every composition it was healing is healed, keeping its healthy
GPU, with nothing of the failed GPUs or of a replacement left bound outside a composition.
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
from crash_helpers import (
    CYCLES,
    GIB,
    HEAL_FAILED,
    HEAL_GPUS,
    HEAL_HITS,
    HEAL_NAMES,
    HITS_PER_CYCLE,
    Call,
    Crash,
    CrashRig,
    Hardware,
    HealSetup,
    Quarantine,
    ServeProcess,
    compose_request,
    cordoned_devices,
    describe_compositions,
    list_compositions,
    prepare_heal,
    quarantine_events,
    run_until_crash,
    violations,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.failpoints import FAILPOINTS
from disagg.model import (
    Allocation,
    Composition,
    CompositionState,
    DeviceKind,
    DevicePick,
    Extent,
    ResourceRequest,
)
from disagg.wire.fabric import composition_from_wire

pytestmark = pytest.mark.slow

THIRD_HITS = (
    "compose.after_bind",
    "compose.after_allocate",
    "recompose.before_commit",
    "recompose.during_release",
    "decompose.during_release",
)
"""Failpoints also killed at their third hit: those passed once per device or allocation, and
recompose.before_commit, whose first three hits are an added GPU, a removal and added memory."""

CASES = [(name, hit) for name in FAILPOINTS if name in HITS_PER_CYCLE for hit in (1, 2)]
CASES += [(name, 3) for name in THIRD_HITS]
HEAL_CASES = [(name, hit) for name in FAILPOINTS if name in HEAL_HITS for hit in (1, 2)]
"""The failpoints the workload never passes (nothing of it fails, so nothing heals), reached by a start-up heal."""
MIN_CYCLES = 20
LOG_TAIL = 40


def _ids(comp: Composition) -> tuple[str, frozenset[str], frozenset[str]]:
    return comp.host, frozenset(comp.device_ids), frozenset(a.id for a in comp.allocations)


def _grew_by_one(before: Composition, after: Composition, call: Call, kinds: dict[str, DeviceKind]) -> bool:
    """Whether ``after`` is ``before`` with exactly the one GPU or the one allocation ``call`` adds."""
    host, devices, allocs = _ids(before)
    new_host, new_devices, new_allocs = _ids(after)
    if new_host != host or not (devices <= new_devices and allocs <= new_allocs):
        return False
    added_devices, added_allocs = new_devices - devices, new_allocs - allocs
    if call.adds == "gpu":
        gpus = all(kinds.get(d) is DeviceKind.GPU for d in added_devices)
        return not added_allocs and len(added_devices) == 1 and gpus
    return not added_devices and len(added_allocs) == 1


def _without(before: Composition, removed: str) -> tuple[str, frozenset[str], frozenset[str]]:
    host, devices, allocs = _ids(before)
    return host, devices - {removed}, allocs - {removed}


def _device_kinds(server: ServeProcess) -> dict[str, DeviceKind]:
    kinds: dict[str, DeviceKind] = {}
    token = ""
    while True:
        page = server.call("ListDevices", fm.ListDevicesRequest(page_size=1000, page_token=token))
        for d in page.devices:
            if d.kind == pb.DEVICE_KIND_GPU:
                kinds[d.id] = DeviceKind.GPU
        token = page.next_page_token
        if not token:
            return kinds


def _durability(crash: Crash, comps: tuple[Composition, ...], kinds: dict[str, DeviceKind]) -> list[str]:
    """(g) Every composition the client saw completed is there as it was; the one in flight is as it was
    before the call or as the call would have left it."""
    out: list[str] = []
    by_name = {c.name: c for c in comps}
    call = crash.in_flight
    assert call is not None
    for name, seen in sorted(crash.known.items()):
        if name == call.target:
            continue
        now = by_name.get(name)
        if now is None:
            out.append(f"(g) {seen.id} {name!r}, composed before the crash, is gone after the restart")
        elif now.id != seen.id or _ids(now) != _ids(seen):
            out.append(f"(g) {name!r} changed across the restart: was {_ids(seen)}, is {_ids(now)}")
    before, now = crash.before, by_name.get(call.target)
    if call.method == "Compose" or before is None:
        return out
    if now is None:
        if call.method != "Decompose":
            out.append(f"(g) {before.id} {call.target!r} is gone after a crash in '{call.label}'")
        return out
    if call.method == "Decompose":
        if _ids(now) != _ids(before):
            out.append(f"(g) {call.target!r}, crashed while decomposing, came back changed: {_ids(now)}")
    elif call.adds:
        if _ids(now) != _ids(before) and not _grew_by_one(before, now, call, kinds):
            out.append(f"(g) '{call.label}' crashed and left {call.target!r} at {_ids(now)}, was {_ids(before)}")
    elif _ids(now) not in (_ids(before), _without(before, call.removes)):
        out.append(f"(g) '{call.label}' crashed and left {call.target!r} at {_ids(now)}, was {_ids(before)}")
    return out


def _retry(server: ServeProcess, crash: Crash, kinds: dict[str, DeviceKind]) -> list[str]:
    """(f) The call in flight at the crash, sent again unchanged, is answered and applied exactly once."""
    call = crash.in_flight
    assert call is not None
    out: list[str] = []
    try:
        reply = server.call(call.method, call.request)
    except grpc.RpcError as err:
        return [
            f"(f) the retry of '{call.label}' (request id {getattr(call.request, 'request_id', '') or 'none'}) "
            f"answered {err.code().name}: {err.details()}"
        ]
    named = [c for c in list_compositions(server) if c.name == call.target]
    if len(named) > 1:
        out.append(f"(f) after the retry of '{call.label}' {len(named)} compositions are named {call.target!r}")
    if call.method == "Decompose":
        if named:
            out.append(f"(f) the retried '{call.label}' answered OK but {named[0].id} is still there")
        return out
    got = composition_from_wire(reply.composition)
    if not any(c.id == got.id for c in named):
        out.append(f"(f) the retry of '{call.label}' answered {got.id}, which ListCompositions does not hold")
    if got.state is not CompositionState.COMPOSED:
        out.append(f"(f) the retry of '{call.label}' answered {got.id} {got.state.value}")
    before = crash.before
    if call.method == "UpdateComposition" and before is not None:
        if call.adds and not _grew_by_one(before, got, call, kinds):
            out.append(f"(f) the retried '{call.label}' left {_ids(got)}; before the crash it was {_ids(before)}")
        if call.removes and _ids(got) != _without(before, call.removes):
            out.append(f"(f) the retried '{call.label}' left {_ids(got)}; before the crash it was {_ids(before)}")
    return out


def _compose_again(server: ServeProcess) -> list[str]:
    """(e) A fresh composition with a GPU and CXL memory composes and decomposes on the restarted server."""
    request = compose_request(
        "fresh",
        [
            fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1),
            fm.ResourceRequest(kind=pb.DEVICE_KIND_CXL_MEMORY, amount_bytes=1 << 30),
        ],
        "fresh-after-restart",
    )
    try:
        comp = composition_from_wire(server.call("Compose", request).composition)
        if comp.state is not CompositionState.COMPOSED or not comp.devices or not comp.allocations:
            return [f"(e) a fresh compose after the restart answered {comp.state.value} {_ids(comp)}"]
        server.call("Decompose", fm.DecomposeRequest(id=comp.id))
    except grpc.RpcError as err:
        return [f"(e) a fresh compose or decompose after the restart answered {err.code().name}: {err.details()}"]
    if any(c.name == "fresh" for c in list_compositions(server)):
        return ["(e) the fresh composition is still listed after its decompose"]
    return []


def _healed(comps: tuple[Composition, ...], setup: HealSetup, hw: Hardware) -> list[str]:
    """(h) The compositions of the heal setup, and only they, are there as composed (id, host, no memory), each
    COMPOSED with its `HEAL_GPUS` GPUs all healthy: its healthy GPU kept, its failed ones replaced, none of those
    bound any longer. (The setup leaves free GPUs enough on every host: a DEGRADED one is a heal not finished.)"""
    out: list[str] = []
    by_name = {c.name: c for c in comps}
    if extra := sorted(set(by_name) - set(setup.composed)):
        out.append(f"(h) there are compositions the heal setup did not compose: {extra}")
    for name, before in sorted(setup.composed.items()):
        now = by_name.get(name)
        if now is None:
            out.append(f"(h) {before.id} {name!r}, composed before the heal, is gone")
            continue
        if (now.id, now.host, now.allocations) != (before.id, before.host, before.allocations):
            out.append(f"(h) {name!r} was {_ids(before)}, is {_ids(now)}")
        if now.state is not CompositionState.COMPOSED:
            out.append(f"(h) {now.id} {name!r} is {now.state.value}, not healed: {now.message}")
        if len(now.devices) != HEAL_GPUS:
            out.append(f"(h) {now.id} {name!r} has {len(now.devices)} devices, not {HEAL_GPUS}")
        if lost := sorted(set(before.device_ids) - setup.failed[name] - set(now.device_ids)):
            out.append(f"(h) {now.id} {name!r} lost its healthy {', '.join(lost)}")
        if sick := sorted(set(now.device_ids) & hw.unhealthy):
            out.append(f"(h) {now.id} {name!r} still lists the unhealthy {', '.join(sick)}")
    for device in sorted(set().union(*setup.failed.values()) & set(hw.bindings)):
        out.append(f"(h) the failed {device} is still bound to {hw.bindings[device]}")
    return out


def _tail(text: str) -> str:
    return "".join(text.splitlines(keepends=True)[-LOG_TAIL:])


def _label(call: Call | None) -> str:
    return call.label if call else "none"


class TestCrashAtEveryFailpoint:
    """Killed at a failpoint and restarted, the fabric manager agrees with the hardware, has nothing stuck,
    loses nothing, composes again and applies a retried request once."""

    @pytest.mark.parametrize(("failpoint", "hit"), CASES, ids=[f"{name}@{hit}" for name, hit in CASES])
    def test_kill_restart_and_check(self, tmp_path: Path, failpoint: str, hit: int) -> None:
        rig = CrashRig(tmp_path)
        armed = f"{failpoint}@{hit}"
        crash = run_until_crash(rig.start(armed))
        assert crash.in_flight is not None, (
            f"failpoint {armed} was never reached: the server answered all {len(crash.answered)} calls of "
            f"{CYCLES} workload cycles and never died; is failpoints.hit({failpoint!r}) in the code path?\n"
            f"{_tail(crash.output)}"
        )
        assert crash.exit_status == -signal.SIGKILL, (
            f"the server died in '{crash.in_flight.label}' with exit status {crash.exit_status}, not SIGKILL:\n"
            f"{_tail(crash.output)}"
        )
        assert f"failpoint {failpoint} hit" in crash.output, f"the server died, not at {armed}:\n{crash.output}"

        problems: list[str] = []
        server = rig.start()
        try:
            comps = list_compositions(server)
            quarantine = Quarantine(frozenset(cordoned_devices(server)), quarantine_events(rig.ledger_events()))
            restarted = violations(comps, rig.hardware(), quarantine)
            problems += [f"after the restart: {v}" for v in restarted]
            kinds = _device_kinds(server)
            problems += _durability(crash, comps, kinds)
            if not restarted:
                problems += _retry(server, crash, kinds)
                problems += _compose_again(server)
        finally:
            status = server.stop()
        ledger, hardware = rig.ledger(), rig.hardware()
        quarantine = Quarantine(quarantine.cordoned, quarantine_events(rig.ledger_events()))
        problems += [f"after the stop: {v}" for v in violations(ledger, hardware, quarantine)]
        if status != 0:
            problems.append(f"the restarted server exited with {status} on SIGTERM")
        assert not problems, (
            f"crash at {armed} in '{_label(crash.in_flight)}' ({crash.describe()}):\n"
            + "\n".join(problems)
            + f"\n\nlisted after the restart:\n{describe_compositions(comps)}"
            + f"\n\nledger after the stop:\n{describe_compositions(ledger)}"
            + f"\n\nhardware after the stop:\n{hardware.describe()}"
            + f"\n\nrestarted server's log:\n{_tail(server.output)}"
        )


@pytest.fixture(scope="module")
def heal_setup(tmp_path_factory: pytest.TempPathFactory) -> HealSetup:
    """One setup for every heal case, each of which crashes a copy of it (`CrashRig.copy_to`)."""
    return prepare_heal(CrashRig(tmp_path_factory.mktemp("heal-setup"), auto_heal=True))


class TestCrashInAStartUpHeal:
    """Killed at a heal failpoint while it heals at start-up the GPUs that failed while no server ran, and
    restarted, the fabric manager agrees with the hardware, has every composition healed and composes again."""

    @pytest.mark.parametrize(("failpoint", "hit"), HEAL_CASES, ids=[f"{name}@{hit}" for name, hit in HEAL_CASES])
    def test_kill_restart_and_check(self, tmp_path: Path, heal_setup: HealSetup, failpoint: str, hit: int) -> None:
        rig = heal_setup.rig.copy_to(tmp_path)
        armed = f"{failpoint}@{hit}"
        exit_status, output = rig.start_until_exit(armed)
        assert exit_status == -signal.SIGKILL, (
            f"the server armed with {armed} ended its start-up heal of {len(HEAL_NAMES)} compositions with "
            f"{HEAL_FAILED} failed GPUs each with exit status {exit_status} (None: it served, or still ran), "
            f"not SIGKILL; is failpoints.hit({failpoint!r}) in the heal?\n{_tail(output)}"
        )
        assert f"failpoint {failpoint} hit" in output, f"the server died, not at {armed}:\n{output}"

        problems: list[str] = []
        server = rig.start()
        try:
            comps = list_compositions(server)
            quarantine = Quarantine(frozenset(cordoned_devices(server)), quarantine_events(rig.ledger_events()))
            hardware = rig.hardware()
            restarted = violations(comps, hardware, quarantine)
            problems += [f"after the restart: {v}" for v in restarted + _healed(comps, heal_setup, hardware)]
            if not restarted:
                problems += _compose_again(server)
        finally:
            status = server.stop()
        ledger, hardware = rig.ledger(), rig.hardware()
        quarantine = Quarantine(quarantine.cordoned, quarantine_events(rig.ledger_events()))
        found = violations(ledger, hardware, quarantine) + _healed(ledger, heal_setup, hardware)
        problems += [f"after the stop: {v}" for v in found]
        if status != 0:
            problems.append(f"the restarted server exited with {status} on SIGTERM")
        assert not problems, (
            f"crash at {armed} in the start-up heal:\n"
            + "\n".join(problems)
            + f"\n\ncomposed before the heal:\n{describe_compositions(list(heal_setup.composed.values()))}"
            + f"\nfailed: {', '.join(sorted(set().union(*heal_setup.failed.values())))}"
            + f"\n\nlisted after the restart:\n{describe_compositions(comps)}"
            + f"\n\nledger after the stop:\n{describe_compositions(ledger)}"
            + f"\n\nhardware after the stop:\n{hardware.describe()}"
            + f"\n\ncrashed server's log:\n{_tail(output)}"
            + f"\n\nrestarted server's log:\n{_tail(server.output)}"
        )


class TestCrashCases:
    """The cases cover every failpoint, reach each within the workload or the start-up heal, and kill and
    restart at least 20 times."""

    def test_every_failpoint_is_tested(self) -> None:
        assert {name for name, _ in CASES + HEAL_CASES} == set(FAILPOINTS)
        assert set(HITS_PER_CYCLE) | set(HEAL_HITS) == set(FAILPOINTS)
        assert not set(HITS_PER_CYCLE) & set(HEAL_HITS)

    def test_every_hit_is_within_the_workload(self) -> None:
        short = [(n, h) for n, h in CASES if h > HITS_PER_CYCLE[n] * (CYCLES - 1)]
        assert not short, f"{short} need more than {CYCLES - 1} of the {CYCLES} workload cycles"

    def test_every_heal_hit_is_within_the_start_up_heal(self) -> None:
        short = [(n, h) for n, h in HEAL_CASES if h > HEAL_HITS[n]]
        assert not short, f"{short} are passed fewer times by the start-up heal of the heal setup"

    def test_at_least_twenty_cycles(self) -> None:
        assert len(CASES) + len(HEAL_CASES) >= MIN_CYCLES


def _comp(
    cid: str,
    host: str,
    devices: tuple[str, ...] = (),
    allocations: tuple[Allocation, ...] = (),
    state: CompositionState = CompositionState.COMPOSED,
) -> Composition:
    return Composition(
        id=cid,
        name=cid,
        host=host,
        state=state,
        resources=(ResourceRequest(DeviceKind.GPU, count=1),),
        devices=tuple(DevicePick(d, 0, 100) for d in devices),
        allocations=allocations,
    )


def _alloc(aid: str, host: str, offset: int, gib: int = 1, pool: str = "p") -> Allocation:
    return Allocation(aid, pool, host, gib * GIB, (Extent(offset * GIB, gib * GIB),))


class TestInvariantCheck:
    """The invariant check passes an agreeing ledger and hardware and names each way they can disagree."""

    def test_agreement_passes(self) -> None:
        alloc = _alloc("c1-m0", "h1", 0)
        comps = [_comp("c1", "h1", ("g1",), (alloc,))]
        assert violations(comps, Hardware({"g1": "h1"}, {("p", "c1-m0"): alloc})) == []

    def test_orphaned_binding_fails_even_when_quarantined(self) -> None:
        found = violations([], Hardware({"g1": "h1"}, {}), Quarantine(frozenset({"g1"})))
        assert len(found) == 1
        assert found[0].startswith("(b) orphaned binding: g1")
        assert "reported quarantined: cordoned" in found[0]

    def test_record_without_binding_and_wrong_host_fail(self) -> None:
        found = violations([_comp("c1", "h1", ("g1", "g2"))], Hardware({"g2": "h2"}, {}))
        assert any(v.startswith("(b) record without binding") and "g1" in v for v in found)
        assert any(v.startswith("(b) g2 is bound to h2") for v in found)

    def test_device_or_host_in_two_compositions_fails(self) -> None:
        comps = [_comp("c1", "h1", ("g1",)), _comp("c2", "h1", ("g1",))]
        found = violations(comps, Hardware({"g1": "h1"}, {}))
        assert any(v.startswith("(c) device g1 is in 2 compositions") for v in found)
        assert any(v.startswith("(c) host h1 is held by 2 compositions") for v in found)

    def test_stuck_failed_and_pending_fail(self) -> None:
        comps = [
            _comp("c1", "h1", state=CompositionState.COMPOSING),
            _comp("c2", "h2", state=CompositionState.DECOMPOSING),
            _comp("c3", "h3", state=CompositionState.FAILED),
        ]
        found = violations(comps, Hardware({}, {}))
        assert [v[:4] for v in found] == ["(a) "] * 3

    def test_allocations_leaked_missing_changed_or_overlapping_fail(self) -> None:
        recorded = _alloc("c1-m0", "h1", 0, gib=2)
        comps = [_comp("c1", "h1", allocations=(recorded, _alloc("c1-m1", "h1", 8)))]
        carved = {
            ("p", "c1-m0"): _alloc("c1-m0", "h1", 0, gib=3),
            ("p", "stray"): _alloc("stray", "h2", 1),
        }
        found = violations(comps, Hardware({}, carved))
        assert any(v.startswith("(d) leaked allocation: p:stray") for v in found)
        assert any(v.startswith("(d) record without allocation") and "c1-m1" in v for v in found)
        assert any(v.startswith("(d) allocation c1-m0: c1 records") for v in found)
        assert any(v.startswith("(d) hardware: allocations c1-m0 and stray overlap") for v in found)
