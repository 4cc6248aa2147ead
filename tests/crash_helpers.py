"""Crash tests' machinery: a `disagg serve` child that a failpoint kills, the bounded workload that drives it
there, and the invariants that must hold between the ledger and the simulated hardware afterwards.

One `CrashRig` is one case's files under its own directory: the configuration, the SQLite ledger, the sim's
state file (the hardware, which outlives every server process) and the socket. The fabric is generated: four
composable domains of four hosts, each with two GPU chassis of ten GPUs, NVMe drives, NICs and one CXL memory
pool, 116 devices in all, so a server starts in about a second.

The workload (`WORKLOAD`) repeats one cycle of seven calls, each with a request id where the protocol takes
one: compose ``a<i>`` (two GPUs and 4 GiB of CXL memory), add a GPU to it, remove its first GPU, compose
``b<i>`` (two GPUs and two memory lines), add 1 GiB of memory to it, remove its first allocation, decompose
it. So ``a<i>`` stays
composed and every crash after the first cycle finds live compositions beside the one interrupted. Each cycle
hits every failpoint at least once, and those hit per device or allocation several times (see `HITS_PER_CYCLE`).

The workload heals nothing (no device of it fails), so the heal failpoints have a setup of their own
(`prepare_heal`): two compositions of three GPUs are composed, the server stopped, two GPUs of each failed in
the sim's state file, and the server started again with auto-heal, which heals both compositions before it
serves, passing every heal failpoint at least twice (see `HEAL_HITS`).

Nor does anything of the workload fail, so a rollback (``rollback.during_release``) has setups of its own too
(`prepare_rollback`, `prepare_heal_rollback`): a compose, a recompose or a start-up heal that binds
`ROLLBACK_GPUS` devices, the last of which the sim's state file fails (`SimFabric.flaky_bind`), so that its
rollback unbinds the others. Recovery (``recovery.during_release``) is reached by restarting a server that a
workload failpoint killed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import grpc
from composer_helpers import compositions_on_disk
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.failpoints import ENV as FAILPOINTS_ENV
from disagg.model import Allocation, Composition, CompositionState, Health
from disagg.wire.fabric import composition_from_wire
from disagg_sim import SimFabric, create_fabric
from process_helpers import ChildOutput

READY = "serving on"
START_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 10.0
EXIT_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
GIB = 1 << 30

FABRIC = "sim0"
GENERATE = {"devices": 120, "hosts_per_domain": 4}
CYCLES = 4
"""Workload cycles before a failpoint counts as never reached: one more than the highest hit count tested needs."""

HITS_PER_CYCLE = {
    "compose.after_reserve": 2,
    "compose.after_bind": 4,
    "compose.after_allocate": 3,
    "compose.before_commit": 2,
    "compose.after_commit": 2,
    "recompose.after_bind": 1,
    "recompose.after_allocate": 1,
    "recompose.before_commit": 2,
    "recompose.during_release": 2,
    "recompose.after_commit": 4,
    "decompose.during_release": 4,
    "decompose.before_commit": 1,
}
"""How often one workload cycle passes each failpoint, at least. The composer also passes
recompose.before_commit on a removal, so it fires on all four recompositions of a cycle: hits 1, 2 and 3 are
"add a GPU to a0", "remove a GPU from a0" and "add memory to b0"."""

CONFIG = """\
[state]
ledger = "sqlite"
path = "{ledger}"

[composer]
auto_heal = {auto_heal}
call_timeout_s = 10.0

[[fabric]]
name = "{fabric}"
driver = "sim"
options = {{ generate = {{ devices = {devices}, hosts_per_domain = {hosts_per_domain} }}, state_file = "{state}" }}
"""

HEAL_GPUS = 3
"""GPUs of each composition that `prepare_heal` composes."""
HEAL_FAILED = 2
"""GPUs of each of them that it fails: each heal binds and unbinds twice, and keeps a healthy GPU."""
HEAL_NAMES = ("h0", "h1")

HEAL_HITS = {
    "heal.after_bind": len(HEAL_NAMES) * HEAL_FAILED,
    "heal.before_commit": len(HEAL_NAMES),
    "heal.during_release": len(HEAL_NAMES) * HEAL_FAILED,
    "heal.after_commit": len(HEAL_NAMES),
}
"""How often the start-up heal of `prepare_heal`'s setup passes each heal failpoint: hit 2 of after_bind and
during_release is the second device of the first heal, hit 2 of before_commit and after_commit the second heal,
the first one committed (whichever composition it healed)."""

ROLLBACK_GPUS = 3
"""GPUs that the change of a rollback setup binds: the sim fails the last bind, so its rollback unbinds two."""
ROLLBACK_HITS = ROLLBACK_GPUS - 1
"""How often the rollback of a rollback setup's change passes rollback.during_release."""

RECOVERY_HITS = {"compose.after_bind@3": 4, "recompose.during_release@1": 1, "decompose.during_release@1": 1}
"""Workload failpoints (at a hit) that leave a change interrupted, and how often (at least) the recovery of it at
the next start passes recovery.during_release. At compose.after_bind@3 (the first bind of b0, with a0 composed,
grown and shrunk) recovery undoes b0: it releases both allocations and unbinds both GPUs, made or not. At
recompose.during_release@1 (the GPU removed from a0 unbound) it finishes the removal, unbinding the GPU again. At
decompose.during_release@1 (the first release of a decompose) it finishes the decompose, releasing again."""

QUARANTINE_EVENTS = ("BindingQuarantined", "AllocationQuarantined")
"""The ledger's event types for hardware that reconciliation found with no record and set aside."""


# ----------------------------------------------------------------------------------------------- processes


class CrashRig:
    """The files of one crash case (configuration, ledger, hardware state file, socket) under one directory."""

    def __init__(self, root: Path, *, auto_heal: bool = False) -> None:
        self.root = root
        self.auto_heal = auto_heal
        self.config = root / "disagg.toml"
        self.ledger_path = root / "ledger.db"
        self.state_file = root / "sim-state.json"
        self.state_dir = root / "state"
        self.address = f"unix:{root / 'fm.sock'}"
        self.config.write_text(
            CONFIG.format(
                ledger=self.ledger_path,
                fabric=FABRIC,
                state=self.state_file,
                auto_heal=str(auto_heal).lower(),
                **GENERATE,
            )
        )

    def fabric_options(self) -> dict[str, Any]:
        """The sim options of the configuration, to build the same hardware in the test process."""
        return {"generate": dict(GENERATE), "state_file": str(self.state_file)}

    def copy_to(self, root: Path) -> CrashRig:
        """A rig under ``root`` (an empty directory) with this one's ledger and hardware, copied (no server may
        run on this one) and its configuration."""
        rig = CrashRig(root, auto_heal=self.auto_heal)
        for path in self.root.iterdir():
            if path.name.startswith((self.ledger_path.name, self.state_file.name)):
                shutil.copy2(path, root / path.name)
        return rig

    @contextlib.contextmanager
    def sim(self) -> Iterator[SimFabric]:
        """The sim fabric built afresh from the state file, in this process; no server may run meanwhile if it
        changes anything (the server would overwrite the state file with its own)."""
        fabric = create_fabric(FABRIC, self.fabric_options())
        try:
            yield fabric
        finally:
            fabric.close()

    def fail_devices(self, devices: Iterable[str]) -> None:
        """Mark ``devices`` FAILED in the sim's state file, through the sim itself, while no server runs: a
        failure that no fabric manager heard of, found by the next one's discovery."""
        with self.sim() as fabric:
            for device in devices:
                fabric.fail_device(device, "failed by the crash test while no server ran")

    def fail_next_bind(self, device: str) -> None:
        """Make the next bind of ``device`` fail (`SimFabric.flaky_bind`) in the sim's state file, while no
        server runs: the server started next meets the fault, which its bind then uses up."""
        with self.sim() as fabric:
            fabric.flaky_bind(device, 1)

    def start(self, failpoints: str | None = None) -> ServeProcess:
        """Start ``disagg serve`` on this rig, armed with ``failpoints`` (``NAME@N``) or with none."""
        server = self._spawn(failpoints)
        try:
            server.wait_ready(START_TIMEOUT_S)
        except BaseException:
            server.kill()
            raise
        return server

    def start_until_exit(self, failpoints: str) -> tuple[int | None, str]:
        """Start ``disagg serve`` armed with ``failpoints`` that its start-up reaches, and wait for it to die:
        its exit status (None when it still ran after `START_TIMEOUT_S`, then killed) and its output. A server
        that reports serving is killed at once: its start-up passed no armed failpoint."""
        server = self._spawn(failpoints)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                status = server.wait_exit(0.1)
                if status is not None:
                    return status, server.output
                if READY in server.output:
                    break
            return None, server.output
        finally:
            server.kill()

    def _spawn(self, failpoints: str | None) -> ServeProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("DISAGG_CONFIG", "DISAGG_SERVER", FAILPOINTS_ENV)}
        env["DISAGG_STATE_DIR"] = str(self.state_dir)
        if failpoints:
            env[FAILPOINTS_ENV] = failpoints
        cmd = [sys.executable, "-m", "disagg.cli.main", "serve", "--config", str(self.config)]
        cmd += ["--listen", self.address]
        proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return ServeProcess(proc, self.address, armed=failpoints or "")

    def hardware(self) -> Hardware:
        """What the hardware holds now: the sim fabric built afresh from the state file, in this process."""
        with self.sim() as fabric:
            allocations: dict[tuple[str, str], Allocation] = {}
            for info in fabric.discover().pools:
                for alloc in fabric.pool(info.id).allocations():
                    allocations[(alloc.pool, alloc.id)] = alloc
            unhealthy = frozenset(d.id for d in fabric.discover().devices if d.health is not Health.OK)
            return Hardware({b.device: b.host for b in fabric.bindings()}, allocations, unhealthy)

    def ledger(self) -> tuple[Composition, ...]:
        """The compositions in the ledger file, as a restarted server would load them."""
        return tuple(sorted(compositions_on_disk(self.ledger_path), key=lambda c: (c.name, c.id)))

    def ledger_events(self) -> list[dict[str, Any]]:
        """Every event in the ledger file as stored (JSON), read without the model so no type is refused."""
        db = sqlite3.connect(self.ledger_path)
        try:
            rows = db.execute("SELECT doc FROM events ORDER BY revision").fetchall()
        finally:
            db.close()
        return [json.loads(doc) for (doc,) in rows]


class ServeProcess:
    """One ``disagg serve`` child: its merged output, its exit status, and a stub on a channel to its socket."""

    def __init__(self, proc: subprocess.Popen[str], address: str, *, armed: str = "") -> None:
        self.proc = proc
        self.address = address
        self.armed = armed
        self._output = ChildOutput(proc)
        self.channel: grpc.Channel | None = None
        self.stub: fm_grpc.FabricManagerServiceStub | None = None

    @property
    def output(self) -> str:
        return self._output.text

    def wait_ready(self, timeout: float) -> None:
        """Wait for the ``serving on`` line, then open the channel; raises AssertionError with the output."""
        deadline = time.monotonic() + timeout
        self._output.wait_ready(re.escape(READY), timeout, "disagg serve")
        self.channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(self.channel).result(timeout=max(0.1, deadline - time.monotonic()))
        self.stub = fm_grpc.FabricManagerServiceStub(self.channel)

    def call(self, method: str, request: Any) -> Any:
        """``method`` (Compose, UpdateComposition, ...) with ``request``, bounded by `RPC_TIMEOUT_S`."""
        assert self.stub is not None
        return getattr(self.stub, method)(request, timeout=RPC_TIMEOUT_S)

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> int | None:
        """The exit status once the process ends within ``timeout`` seconds, else None."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._output.wait_ended(STOP_TIMEOUT_S)  # all it said, the failpoint's last words included
        return code

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`; returns the exit status (0 after a clean shutdown)."""
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(STOP_TIMEOUT_S)
        else:
            code = self.proc.returncode
        self._output.wait_ended(STOP_TIMEOUT_S)
        return code

    def stop_cleanly(self, what: str) -> None:
        """`stop`, asserting a clean shutdown (exit status 0) of the server of ``what``."""
        status = self.stop()
        assert status == 0, f"{what}'s server exited with {status} on SIGTERM:\n{self.output}"

    def kill(self) -> None:
        """SIGKILL the process if it still runs (clean-up after a failed test)."""
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STOP_TIMEOUT_S)
        self._output.wait_ended(STOP_TIMEOUT_S)

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
            self.stub = None


# ----------------------------------------------------------------------------------------------- the workload


def _gpus(count: int) -> fm.ResourceRequest:
    return fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=count)


def _memory(gib: int) -> fm.ResourceRequest:
    return fm.ResourceRequest(kind=pb.DEVICE_KIND_CXL_MEMORY, amount_bytes=gib * GIB)


def compose_request(name: str, resources: Sequence[fm.ResourceRequest], request_id: str) -> fm.ComposeRequest:
    return fm.ComposeRequest(
        name=name, host=fm.HostRequest(), resources=list(resources), mode=fm.COMPOSE_MODE_APPLY, request_id=request_id
    )


@attrs.frozen
class Call:
    """One workload RPC: a label, the method, the request, and the composition (by name) it changes."""

    label: str
    method: str
    request: Any
    target: str
    adds: str = ""
    """What an UpdateComposition adds: "gpu" (GPUs) or "memory" (one allocation)."""
    count: int = 1
    """How many GPUs it adds."""
    removes: str = ""


Step = Callable[[int, Mapping[str, Composition]], Call]
"""Makes cycle ``i``'s call from the compositions the client knows (by name), as last answered."""


def _compose_a(i: int, known: Mapping[str, Composition]) -> Call:
    name = f"a{i}"
    return Call(f"compose {name}", "Compose", compose_request(name, [_gpus(2), _memory(4)], f"compose-{name}"), name)


def _grow_a(i: int, known: Mapping[str, Composition]) -> Call:
    comp = known[f"a{i}"]
    request = fm.UpdateCompositionRequest(id=comp.id, add=[_gpus(1)], request_id=f"grow-a{i}")
    return Call(f"add a GPU to a{i}", "UpdateComposition", request, comp.name, adds="gpu")


def _shrink_a(i: int, known: Mapping[str, Composition]) -> Call:
    comp = known[f"a{i}"]
    device = comp.devices[0].device
    request = fm.UpdateCompositionRequest(id=comp.id, remove=[device], request_id=f"shrink-a{i}")
    return Call(f"remove {device} from a{i}", "UpdateComposition", request, comp.name, removes=device)


def _compose_b(i: int, known: Mapping[str, Composition]) -> Call:
    name = f"b{i}"
    resources = [_gpus(2), _memory(2), _memory(1)]
    return Call(f"compose {name}", "Compose", compose_request(name, resources, f"compose-{name}"), name)


def _grow_memory_b(i: int, known: Mapping[str, Composition]) -> Call:
    comp = known[f"b{i}"]
    request = fm.UpdateCompositionRequest(id=comp.id, add=[_memory(1)], request_id=f"grow-memory-b{i}")
    return Call(f"add 1 GiB of memory to b{i}", "UpdateComposition", request, comp.name, adds="memory")


def _drop_memory_b(i: int, known: Mapping[str, Composition]) -> Call:
    comp = known[f"b{i}"]
    alloc = comp.allocations[0].id
    request = fm.UpdateCompositionRequest(id=comp.id, remove=[alloc], request_id=f"drop-memory-b{i}")
    return Call(f"remove allocation {alloc} from b{i}", "UpdateComposition", request, comp.name, removes=alloc)


def _decompose_b(i: int, known: Mapping[str, Composition]) -> Call:
    comp = known[f"b{i}"]
    return Call(f"decompose b{i}", "Decompose", fm.DecomposeRequest(id=comp.id), comp.name)


WORKLOAD: tuple[Step, ...] = (
    _compose_a,
    _grow_a,
    _shrink_a,
    _compose_b,
    _grow_memory_b,
    _drop_memory_b,
    _decompose_b,
)


@attrs.frozen
class Crash:
    """How a crash run ended: the calls answered, the call in flight when the server died (None when it never
    died), what the client knew of the in-flight call's composition before it, and the exit status."""

    answered: tuple[Call, ...]
    in_flight: Call | None
    known: Mapping[str, Composition]
    before: Composition | None
    exit_status: int | None
    output: str

    def describe(self) -> str:
        last = self.in_flight.label if self.in_flight else "none"
        return f"{len(self.answered)} calls answered, in flight: {last}, exit status {self.exit_status}"


def run_until_crash(
    server: ServeProcess,
    cycles: int = CYCLES,
    workload: Sequence[Step] = WORKLOAD,
    known: Mapping[str, Composition] | None = None,
) -> Crash:
    """Drive ``workload`` for at most ``cycles`` cycles until the server dies in a call; the client knows
    ``known`` (by name) before the first.

    A call that fails while the server lives is a broken workload (AssertionError). The server must die by
    SIGKILL (exit status -9) within `EXIT_TIMEOUT_S` of the failed call.
    """
    known = dict(known or {})
    answered: list[Call] = []
    for i in range(cycles):
        for step in workload:
            call = step(i, known)
            before = known.get(call.target)
            try:
                reply = server.call(call.method, call.request)
            except grpc.RpcError as err:
                code = err.code()
                status = server.wait_exit(EXIT_TIMEOUT_S if code is grpc.StatusCode.UNAVAILABLE else 1.0)
                if status is None:
                    raise AssertionError(
                        f"{call.label} failed with {code.name}: {err.details()} and the server still runs "
                        f"(armed: {server.armed}):\n{server.output}"
                    ) from None
                server.kill()
                return Crash(tuple(answered), call, dict(known), before, status, server.output)
            answered.append(call)
            if call.method == "Decompose":
                known.pop(call.target, None)
            else:
                known[call.target] = composition_from_wire(reply.composition)
    server.kill()
    return Crash(tuple(answered), None, dict(known), None, None, server.output)


@attrs.frozen
class HealSetup:
    """The hardware and ledger that a start-up heal works on: compositions of ``gpus`` GPUs each, as composed,
    and the devices of each failed while no server ran. The rig's server is stopped: copy the rig
    (`CrashRig.copy_to`) to crash on it."""

    rig: CrashRig
    composed: Mapping[str, Composition]
    failed: Mapping[str, frozenset[str]]
    gpus: int = HEAL_GPUS


def prepare_heal(
    rig: CrashRig, names: Sequence[str] = HEAL_NAMES, gpus: int = HEAL_GPUS, failing: int = HEAL_FAILED
) -> HealSetup:
    """Compose ``names`` on ``rig`` (auto-heal on), each of ``gpus`` GPUs, stop the server cleanly, then fail
    ``failing`` GPUs of each in the sim's state file (its last ones, so a healthy first one is kept)."""
    assert rig.auto_heal, "a start-up heal needs [composer] auto_heal"
    composed: dict[str, Composition] = {}
    server = rig.start()
    try:
        for name in names:
            request = compose_request(name, [_gpus(gpus)], f"compose-{name}")
            composed[name] = composition_from_wire(server.call("Compose", request).composition)
    finally:
        server.stop_cleanly("the heal setup")
    for comp in composed.values():
        assert comp.state is CompositionState.COMPOSED and len(comp.devices) == gpus, comp
    failed = {name: frozenset(comp.device_ids[-failing:]) for name, comp in composed.items()}
    rig.fail_devices(sorted(d for devices in failed.values() for d in devices))
    return HealSetup(rig, composed, failed, gpus)


def prepare_heal_rollback(rig: CrashRig, scratch: Path) -> HealSetup:
    """A heal setup (`prepare_heal`) whose start-up heal fails at its last bind and rolls back: one composition
    of `ROLLBACK_GPUS` + 1 GPUs, all but the first failed, and the bind of the last of their replacements failed
    in the sim's state file too. That replacement is found by healing a copy of the setup under ``scratch`` (an
    empty directory): placement is deterministic for a given inventory, and a heal binds its replacements in
    the order the healed composition lists them."""
    setup = prepare_heal(rig, ("h0",), ROLLBACK_GPUS + 1, ROLLBACK_GPUS)
    server = rig.copy_to(scratch).start()
    try:
        (healed,) = list_compositions(server)
    finally:
        server.stop_cleanly("the heal rollback setup's trial heal")
    before = setup.composed["h0"]
    assert healed.state is CompositionState.COMPOSED and healed.id == before.id, healed
    replacements = [d for d in healed.device_ids if d not in before.device_ids]
    assert len(replacements) == ROLLBACK_GPUS, healed
    rig.fail_next_bind(replacements[-1])
    return setup


@attrs.frozen
class RollbackSetup:
    """A change that fails at its last bind and is rolled back: cycle 0 of ``step``, sent by a client that knows
    ``known`` (by name), on a rig whose sim fails the bind of ``failing``. The rig's server is stopped: copy the
    rig (`CrashRig.copy_to`) to crash on it."""

    rig: CrashRig
    step: Step
    known: Mapping[str, Composition]
    failing: str


def _compose_r(i: int, known: Mapping[str, Composition]) -> Call:
    name = f"r{i}"
    request = compose_request(name, [_gpus(ROLLBACK_GPUS)], f"compose-{name}")
    return Call(f"compose {name} of {ROLLBACK_GPUS} GPUs", "Compose", request, name)


def _grow_r(i: int, known: Mapping[str, Composition]) -> Call:
    comp = known[f"r{i}"]
    request = fm.UpdateCompositionRequest(id=comp.id, add=[_gpus(ROLLBACK_GPUS)], request_id=f"grow-r{i}")
    label = f"add {ROLLBACK_GPUS} GPUs to r{i}"
    return Call(label, "UpdateComposition", request, comp.name, adds="gpu", count=ROLLBACK_GPUS)


ROLLBACK_CHANGES: Mapping[str, Step] = {"compose": _compose_r, "recompose": _grow_r}
"""The changes of `prepare_rollback`: compose ``r0`` of `ROLLBACK_GPUS` GPUs, or add as many to an ``r0`` of one."""


def prepare_rollback(rig: CrashRig, scratch: Path, change: str) -> RollbackSetup:
    """Set up the change ``change`` (of `ROLLBACK_CHANGES`) on ``rig`` to fail at its last bind: compose what it
    changes, apply it on a copy of the rig under ``scratch`` (an empty directory) to learn the device of that
    bind (placement is deterministic for a given inventory), then fail that device's next bind in the sim's
    state file."""
    known: dict[str, Composition] = {}
    if change == "recompose":
        server = rig.start()
        try:
            reply = server.call("Compose", compose_request("r0", [_gpus(1)], "compose-r0"))
            known["r0"] = composition_from_wire(reply.composition)
        finally:
            server.stop_cleanly("the recompose rollback setup")
    step = ROLLBACK_CHANGES[change]
    binds = _binds_of(rig.copy_to(scratch), step(0, known), known)
    rig.fail_next_bind(binds[-1])
    return RollbackSetup(rig, step, known, binds[-1])


def _binds_of(rig: CrashRig, call: Call, known: Mapping[str, Composition]) -> list[str]:
    """The devices that ``call`` binds on ``rig``, in the order it binds them: the order its composition lists
    them in, the new ones after the old."""
    server = rig.start()
    try:
        got = composition_from_wire(server.call(call.method, call.request).composition)
    finally:
        server.stop_cleanly(f"the trial of '{call.label}'")
    before = known.get(call.target)
    binds = [d for d in got.device_ids if before is None or d not in before.device_ids]
    assert got.state is CompositionState.COMPOSED and len(binds) == ROLLBACK_GPUS, got
    return binds


# ----------------------------------------------------------------------------------------------- reading state


def list_compositions(server: ServeProcess) -> tuple[Composition, ...]:
    out: list[Composition] = []
    token = ""
    while True:
        page = server.call("ListCompositions", fm.ListCompositionsRequest(page_size=1000, page_token=token))
        out.extend(composition_from_wire(c) for c in page.compositions)
        token = page.next_page_token
        if not token:
            return tuple(sorted(out, key=lambda c: (c.name, c.id)))


def cordoned_devices(server: ServeProcess) -> set[str]:
    out: set[str] = set()
    token = ""
    while True:
        page = server.call("ListDevices", fm.ListDevicesRequest(page_size=1000, page_token=token))
        out.update(d.id for d in page.devices if d.cordoned)
        token = page.next_page_token
        if not token:
            return out


@attrs.frozen
class Hardware:
    """What the simulated fabric holds: device to bound host, and (pool, allocation id) to the allocation."""

    bindings: Mapping[str, str]
    allocations: Mapping[tuple[str, str], Allocation]
    unhealthy: frozenset[str] = frozenset()
    """The devices whose health is not OK."""

    def describe(self) -> str:
        lines = [f"  bound {d} -> {h}" for d, h in sorted(self.bindings.items())]
        lines += [f"  unhealthy {d}" for d in sorted(self.unhealthy)]
        lines += [
            f"  carved {pool}:{aid} for {a.host} {a.amount_bytes // GIB} GiB at {_extents(a)}"
            for (pool, aid), a in sorted(self.allocations.items())
        ]
        return "\n".join(lines) or "  nothing bound or carved"


def _extents(alloc: Allocation) -> str:
    return ",".join(f"{e.offset // GIB}+{e.length // GIB}GiB" for e in alloc.extents) or "-"


def describe_compositions(comps: Sequence[Composition]) -> str:
    lines = []
    for c in comps:
        lines.append(f"  {c.id} {c.name!r} on {c.host} {c.state.value} gen {c.generation} {c.message!r}")
        lines += [f"    device {p.device} (line {p.resource})" for p in c.devices]
        lines += [f"    allocation {a.pool}:{a.id} {a.amount_bytes // GIB} GiB at {_extents(a)}" for a in c.allocations]
        pending = getattr(c, "pending", None)
        if pending is not None:
            lines.append(f"    pending {pending!r}")
    return "\n".join(lines) or "  no compositions"


# ----------------------------------------------------------------------------------------------- invariants


@attrs.frozen
class Quarantine:
    """What the fabric manager reports it set aside as unexplained: cordoned devices, quarantine events."""

    cordoned: frozenset[str] = frozenset()
    events: tuple[Mapping[str, Any], ...] = ()

    def note(self, subject: str) -> str:
        """Why ``subject`` (a device or allocation id) is known to the fabric manager as quarantined, if it is."""
        why = [e["type"] for e in self.events if e.get("subject") == subject]
        if subject in self.cordoned:
            why.append("cordoned")
        if not why:
            return ""
        return f" [reported quarantined: {', '.join(why)}; still a failure: a crash must leave nothing unexplained]"


def violations(comps: Sequence[Composition], hw: Hardware, quarantine: Quarantine = Quarantine()) -> list[str]:
    """Every broken invariant between the compositions (the ledger or the API) and the hardware, one a line.

    (a) nothing stuck: no composition COMPOSING, DECOMPOSING or FAILED, none with a change pending;
    (b) every binding belongs to the composition of its host and every recorded device is bound to its host;
    (c) no device, allocation or host in two compositions;
    (d) every carved allocation is a composition's, on its host, of its amount and extents, and vice versa,
        with no two overlapping in a pool.
    """
    out: list[str] = []
    stuck = (CompositionState.COMPOSING, CompositionState.DECOMPOSING)
    for c in comps:
        if c.state in stuck:
            out.append(f"(a) {c.id} {c.name!r} is stuck {c.state.value}")
        elif c.state is CompositionState.FAILED:
            out.append(f"(a) {c.id} {c.name!r} was left FAILED: {c.message}")
        if getattr(c, "pending", None) is not None:
            out.append(f"(a) {c.id} {c.name!r} still has a pending change {c.pending!r}")

    owners: dict[str, list[Composition]] = {}
    for c in comps:
        for p in c.devices:
            owners.setdefault(p.device, []).append(c)
    for device, holders in sorted(owners.items()):
        if len(holders) > 1:
            out.append(f"(c) device {device} is in {len(holders)} compositions: {', '.join(h.id for h in holders)}")
    hosts: dict[str, list[str]] = {}
    for c in comps:
        hosts.setdefault(c.host, []).append(c.id)
    for host, ids in sorted(hosts.items()):
        if len(ids) > 1:
            out.append(f"(c) host {host} is held by {len(ids)} compositions: {', '.join(ids)}")
    alloc_owners: dict[tuple[str, str], list[tuple[Composition, Allocation]]] = {}
    for c in comps:
        for a in c.allocations:
            alloc_owners.setdefault((a.pool, a.id), []).append((c, a))
    for (pool, aid), holders in sorted(alloc_owners.items()):
        if len(holders) > 1:
            out.append(f"(c) allocation {pool}:{aid} is in {len(holders)} compositions")

    for device, host in sorted(hw.bindings.items()):
        holders = owners.get(device, [])
        if not holders:
            out.append(
                f"(b) orphaned binding: {device} is bound to {host} on the hardware and no composition records it"
                + quarantine.note(device)
            )
        elif all(h.host != host for h in holders):
            out.append(f"(b) {device} is bound to {host} but recorded in {holders[0].id} on {holders[0].host}")
    for device, holders in sorted(owners.items()):
        bound = hw.bindings.get(device)
        for c in holders:
            if bound is None:
                out.append(f"(b) record without binding: {c.id} {c.name!r} lists {device}, which is not bound")
            elif bound != c.host:
                out.append(f"(b) {c.id} lists {device} for {c.host}, but it is bound to {bound}")

    for key, alloc in sorted(hw.allocations.items()):
        if key not in alloc_owners:
            out.append(
                f"(d) leaked allocation: {key[0]}:{key[1]} ({alloc.amount_bytes // GIB} GiB for {alloc.host}) is carved"
                " on the hardware and no composition records it" + quarantine.note(key[1])
            )
            continue
        for c, rec in alloc_owners[key]:
            if alloc.host != c.host:
                out.append(f"(d) allocation {key[1]} is carved for {alloc.host} but {c.id} is on {c.host}")
            if (rec.amount_bytes, rec.extents) != (alloc.amount_bytes, alloc.extents):
                out.append(
                    f"(d) allocation {key[1]}: {c.id} records {rec.amount_bytes} bytes at {_extents(rec)}, "
                    f"the hardware holds {alloc.amount_bytes} bytes at {_extents(alloc)}"
                )
    for key, holders in sorted(alloc_owners.items()):
        if key not in hw.allocations:
            out.extend(
                f"(d) record without allocation: {c.id} {c.name!r} lists {key[0]}:{key[1]}, which is not carved"
                for c, _ in holders
            )
    out.extend(f"(d) hardware: {o}" for o in _overlaps(hw.allocations.values()))
    out.extend(f"(d) ledger: {o}" for o in _overlaps([a for c in comps for a in c.allocations]))
    return out


def _overlaps(allocations: Iterable[Allocation]) -> list[str]:
    by_pool: dict[str, list[tuple[int, int, str]]] = {}
    for a in allocations:
        for e in a.extents:
            by_pool.setdefault(a.pool, []).append((e.offset, e.offset + e.length, a.id))
    out = []
    for pool, spans in sorted(by_pool.items()):
        spans.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end and first != second:
                out.append(f"allocations {first} and {second} overlap in pool {pool}")
    return out


def quarantine_events(events: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    return tuple(e for e in events if e.get("type") in QUARANTINE_EVENTS)
