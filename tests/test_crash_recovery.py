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

The rollback of a failed change (``rollback.during_release``) is reached by a compose, a recompose and a start-up
heal whose last bind the sim fails (`prepare_rollback`, `prepare_heal_rollback`), and recovery
(``recovery.during_release``) by restarting, armed, a server that a workload failpoint killed: killed again in
the recovery, and restarted unarmed, the server is held to the same checks.
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
from crash_helpers import (
    CYCLES,
    GIB,
    HEAL_HITS,
    HITS_PER_CYCLE,
    RECOVERY_HITS,
    ROLLBACK_CHANGES,
    ROLLBACK_HITS,
    Call,
    Crash,
    CrashRig,
    Hardware,
    HealSetup,
    Quarantine,
    RollbackSetup,
    ServeProcess,
    compose_request,
    cordoned_devices,
    describe_compositions,
    list_compositions,
    prepare_heal,
    prepare_heal_rollback,
    prepare_rollback,
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
ROLLBACK = "rollback.during_release"
RECOVERY = "recovery.during_release"
ROLLBACK_CASES = [(change, hit) for change in ROLLBACK_CHANGES for hit in range(1, ROLLBACK_HITS + 1)]
"""A change of `prepare_rollback` and the hit of its rollback at which it is killed."""
HEAL_ROLLBACK_CASES = list(range(1, ROLLBACK_HITS + 1))
"""The hits of the rollback of `prepare_heal_rollback`'s start-up heal at which it is killed."""
RECOVERY_CASES = [(interrupted, hit) for interrupted, hits in RECOVERY_HITS.items() for hit in (1, 2) if hit <= hits]
"""A workload failpoint that interrupts a change, and the hit of recovery's at which the next start is killed."""
MIN_CYCLES = 20
LOG_TAIL = 40


def _ids(comp: Composition) -> tuple[str, frozenset[str], frozenset[str]]:
    return comp.host, frozenset(comp.device_ids), frozenset(a.id for a in comp.allocations)


def _grew_as_asked(before: Composition, after: Composition, call: Call, kinds: dict[str, DeviceKind]) -> bool:
    """Whether ``after`` is ``before`` with exactly the GPUs or the one allocation ``call`` adds."""
    host, devices, allocs = _ids(before)
    new_host, new_devices, new_allocs = _ids(after)
    if new_host != host or not (devices <= new_devices and allocs <= new_allocs):
        return False
    added_devices, added_allocs = new_devices - devices, new_allocs - allocs
    if call.adds == "gpu":
        gpus = all(kinds.get(d) is DeviceKind.GPU for d in added_devices)
        return not added_allocs and len(added_devices) == call.count and gpus
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
        if _ids(now) != _ids(before) and not _grew_as_asked(before, now, call, kinds):
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
        if call.adds and not _grew_as_asked(before, got, call, kinds):
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
    COMPOSED with as many GPUs as composed, all healthy: its healthy GPU kept, its failed ones replaced, none of
    those bound any longer. (The setup leaves free GPUs enough on every host: a DEGRADED one is a heal not
    finished.)"""
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
        if len(now.devices) != setup.gpus:
            out.append(f"(h) {now.id} {name!r} has {len(now.devices)} devices, not {setup.gpus}")
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


def _assert_killed_at(crash: Crash, failpoint: str, hit: int, cycles: int = CYCLES) -> None:
    """The server driven to ``crash`` died in a call, by SIGKILL, at the failpoint it was armed with."""
    armed = f"{failpoint}@{hit}"
    assert crash.in_flight is not None, (
        f"failpoint {armed} was never reached: the server answered all {len(crash.answered)} calls of "
        f"{cycles} workload cycles and never died; is failpoints.hit({failpoint!r}) in the code path?\n"
        f"{_tail(crash.output)}"
    )
    assert crash.exit_status == -signal.SIGKILL, (
        f"the server died in '{crash.in_flight.label}' with exit status {crash.exit_status}, not SIGKILL:\n"
        f"{_tail(crash.output)}"
    )
    assert f"failpoint {failpoint} hit" in crash.output, f"the server died, not at {armed}:\n{crash.output}"


def _assert_start_up_killed_at(status: int | None, output: str, failpoint: str, hit: int, what: str) -> None:
    """A server armed with ``failpoint`` at ``hit`` died by SIGKILL at it during its start-up (``what``)."""
    armed = f"{failpoint}@{hit}"
    assert status == -signal.SIGKILL, (
        f"the server armed with {armed} ended {what} with exit status {status} (None: it served, or still "
        f"ran), not SIGKILL; is failpoints.hit({failpoint!r}) in its code path?\n{_tail(output)}"
    )
    assert f"failpoint {failpoint} hit" in output, f"the server died, not at {armed}:\n{output}"


def _restart_and_check(rig: CrashRig, crash: Crash, armed: str) -> None:
    """Restart the server that ``crash`` killed (armed with ``armed``) without failpoints and hold it to every
    invariant: (a) to (d) against the hardware, through the API and then in the ledger file once stopped,
    (g) nothing lost, (f) the call in flight applied once when retried, (e) a fresh compose."""
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


class TestCrashAtEveryFailpoint:
    """Killed at a failpoint and restarted, the fabric manager agrees with the hardware, has nothing stuck,
    loses nothing, composes again and applies a retried request once."""

    @pytest.mark.parametrize(("failpoint", "hit"), CASES, ids=[f"{name}@{hit}" for name, hit in CASES])
    def test_kill_restart_and_check(self, tmp_path: Path, failpoint: str, hit: int) -> None:
        rig = CrashRig(tmp_path)
        crash = run_until_crash(rig.start(f"{failpoint}@{hit}"))
        _assert_killed_at(crash, failpoint, hit)
        _restart_and_check(rig, crash, f"{failpoint}@{hit}")


@pytest.fixture(scope="module")
def heal_setup(tmp_path_factory: pytest.TempPathFactory) -> HealSetup:
    """One setup for every heal case, each of which crashes a copy of it (`CrashRig.copy_to`)."""
    return prepare_heal(CrashRig(tmp_path_factory.mktemp("heal-setup"), auto_heal=True))


def _crash_the_start_up_heal(tmp_path: Path, setup: HealSetup, failpoint: str, hit: int) -> None:
    """Kill a server at ``failpoint`` (its ``hit``) in the start-up heal of a copy of ``setup``, restart it
    without failpoints, and hold it to the invariants and to (h) every composition healed."""
    rig = setup.rig.copy_to(tmp_path)
    armed = f"{failpoint}@{hit}"
    exit_status, output = rig.start_until_exit(armed)
    heal = f"its start-up heal of {len(setup.composed)} compositions of {setup.gpus} GPUs with failed ones"
    _assert_start_up_killed_at(exit_status, output, failpoint, hit, heal)

    problems: list[str] = []
    server = rig.start()
    try:
        comps = list_compositions(server)
        quarantine = Quarantine(frozenset(cordoned_devices(server)), quarantine_events(rig.ledger_events()))
        hardware = rig.hardware()
        restarted = violations(comps, hardware, quarantine)
        problems += [f"after the restart: {v}" for v in restarted + _healed(comps, setup, hardware)]
        if not restarted:
            problems += _compose_again(server)
    finally:
        status = server.stop()
    ledger, hardware = rig.ledger(), rig.hardware()
    quarantine = Quarantine(quarantine.cordoned, quarantine_events(rig.ledger_events()))
    found = violations(ledger, hardware, quarantine) + _healed(ledger, setup, hardware)
    problems += [f"after the stop: {v}" for v in found]
    if status != 0:
        problems.append(f"the restarted server exited with {status} on SIGTERM")
    assert not problems, (
        f"crash at {armed} in the start-up heal:\n"
        + "\n".join(problems)
        + f"\n\ncomposed before the heal:\n{describe_compositions(list(setup.composed.values()))}"
        + f"\nfailed: {', '.join(sorted(set().union(*setup.failed.values())))}"
        + f"\n\nlisted after the restart:\n{describe_compositions(comps)}"
        + f"\n\nledger after the stop:\n{describe_compositions(ledger)}"
        + f"\n\nhardware after the stop:\n{hardware.describe()}"
        + f"\n\ncrashed server's log:\n{_tail(output)}"
        + f"\n\nrestarted server's log:\n{_tail(server.output)}"
    )


class TestCrashInAStartUpHeal:
    """Killed at a heal failpoint while it heals at start-up the GPUs that failed while no server ran, and
    restarted, the fabric manager agrees with the hardware, has every composition healed and composes again."""

    @pytest.mark.parametrize(("failpoint", "hit"), HEAL_CASES, ids=[f"{name}@{hit}" for name, hit in HEAL_CASES])
    def test_kill_restart_and_check(self, tmp_path: Path, heal_setup: HealSetup, failpoint: str, hit: int) -> None:
        _crash_the_start_up_heal(tmp_path, heal_setup, failpoint, hit)


@pytest.fixture(scope="module")
def rollback_setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RollbackSetup]:
    """One setup for each change of `ROLLBACK_CHANGES`, each case crashing a copy of it (`CrashRig.copy_to`)."""
    return {
        change: prepare_rollback(
            CrashRig(tmp_path_factory.mktemp(f"{change}-rollback-setup")),
            tmp_path_factory.mktemp(f"{change}-rollback-trial"),
            change,
        )
        for change in ROLLBACK_CHANGES
    }


@pytest.fixture(scope="module")
def heal_rollback_setup(tmp_path_factory: pytest.TempPathFactory) -> HealSetup:
    """One setup for the cases of a heal's rollback (`prepare_heal_rollback`)."""
    rig = CrashRig(tmp_path_factory.mktemp("heal-rollback-setup"), auto_heal=True)
    return prepare_heal_rollback(rig, tmp_path_factory.mktemp("heal-rollback-trial"))


class TestCrashInARollback:
    """Killed while it rolls back a change whose last bind failed (a fault the sim injects), and restarted, the
    fabric manager agrees with the hardware, has the change undone, applies it once when retried (the fault
    used up) and composes again; a heal rolled back at start-up is healed after the restart."""

    @pytest.mark.parametrize(("change", "hit"), ROLLBACK_CASES, ids=[f"{c}-{ROLLBACK}@{h}" for c, h in ROLLBACK_CASES])
    def test_of_a_change(
        self, tmp_path: Path, rollback_setups: dict[str, RollbackSetup], change: str, hit: int
    ) -> None:
        setup = rollback_setups[change]
        rig = setup.rig.copy_to(tmp_path)
        crash = run_until_crash(rig.start(f"{ROLLBACK}@{hit}"), cycles=1, workload=(setup.step,), known=setup.known)
        _assert_killed_at(crash, ROLLBACK, hit, cycles=1)
        _restart_and_check(rig, crash, f"{ROLLBACK}@{hit}")

    @pytest.mark.parametrize("hit", HEAL_ROLLBACK_CASES, ids=[f"heal-{ROLLBACK}@{h}" for h in HEAL_ROLLBACK_CASES])
    def test_of_a_start_up_heal(self, tmp_path: Path, heal_rollback_setup: HealSetup, hit: int) -> None:
        _crash_the_start_up_heal(tmp_path, heal_rollback_setup, ROLLBACK, hit)


class TestCrashInRecovery:
    """Killed at a workload failpoint, then killed again while the restarted server's recovery settles the
    change that the first crash interrupted, and restarted once more, the fabric manager agrees with the
    hardware, has nothing stuck, loses nothing, composes again and applies the interrupted request once."""

    @pytest.mark.parametrize(
        ("interrupted", "hit"), RECOVERY_CASES, ids=[f"{i}-{RECOVERY}@{h}" for i, h in RECOVERY_CASES]
    )
    def test_kill_twice_restart_and_check(self, tmp_path: Path, interrupted: str, hit: int) -> None:
        rig = CrashRig(tmp_path)
        failpoint, _, first = interrupted.partition("@")
        crash = run_until_crash(rig.start(interrupted))
        _assert_killed_at(crash, failpoint, int(first))
        status, output = rig.start_until_exit(f"{RECOVERY}@{hit}")
        _assert_start_up_killed_at(status, output, RECOVERY, hit, f"its recovery of '{_label(crash.in_flight)}'")
        _restart_and_check(rig, crash, f"{interrupted}, then {RECOVERY}@{hit} in the recovery")


class TestCrashCases:
    """The cases cover every failpoint, reach each within the workload, the start-up heal, a rollback or a
    recovery, and kill and restart at least 20 times."""

    def test_every_failpoint_is_tested(self) -> None:
        undoing = {ROLLBACK} if ROLLBACK_CASES and HEAL_ROLLBACK_CASES else set()
        undoing |= {RECOVERY} if RECOVERY_CASES else set()
        assert {name for name, _ in CASES + HEAL_CASES} | undoing == set(FAILPOINTS)
        assert set(HITS_PER_CYCLE) | set(HEAL_HITS) | {ROLLBACK, RECOVERY} == set(FAILPOINTS)
        assert not set(HITS_PER_CYCLE) & set(HEAL_HITS)
        assert not (set(HITS_PER_CYCLE) | set(HEAL_HITS)) & {ROLLBACK, RECOVERY}
        assert {change for change, _ in ROLLBACK_CASES} == set(ROLLBACK_CHANGES)

    def test_every_hit_is_within_the_workload(self) -> None:
        short = [(n, h) for n, h in CASES if h > HITS_PER_CYCLE[n] * (CYCLES - 1)]
        assert not short, f"{short} need more than {CYCLES - 1} of the {CYCLES} workload cycles"

    def test_every_heal_hit_is_within_the_start_up_heal(self) -> None:
        short = [(n, h) for n, h in HEAL_CASES if h > HEAL_HITS[n]]
        assert not short, f"{short} are passed fewer times by the start-up heal of the heal setup"

    def test_every_undo_hit_is_within_its_setup(self) -> None:
        short = [h for _, h in ROLLBACK_CASES] + HEAL_ROLLBACK_CASES
        assert all(h <= ROLLBACK_HITS for h in short), f"a rollback passes {ROLLBACK} {ROLLBACK_HITS} times"
        short_recovery = [(i, h) for i, h in RECOVERY_CASES if h > RECOVERY_HITS[i]]
        assert not short_recovery, f"{short_recovery}: the recovery passes {RECOVERY} fewer times"
        interrupted = [i.partition("@") for i, _ in RECOVERY_CASES]
        assert all(int(h) <= HITS_PER_CYCLE[n] * (CYCLES - 1) for n, _, h in interrupted)

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
