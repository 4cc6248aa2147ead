"""A Hypothesis state machine drives the composer against a simple model of what it must hold.

The model is the set of compositions the composer acknowledged, with their devices and memory. After every
step: no device is in two compositions; the hardware holds exactly what the ledger says (nothing half-bound);
pool capacity is conserved; a compose that raised changed nothing.

The machine runs on in-process sim fabrics, and again on the same fabrics served out of process (a unix
socket, and loopback TCP) through the `remote` driver, with fewer examples: each step costs a few RPCs.
"""

from __future__ import annotations

import contextlib
import itertools

from composer_helpers import (
    Served,
    composer,
    hardware_allocations,
    hardware_bindings,
    ledger_allocations,
    ledger_bindings,
    rack,
)
from disagg.errors import DisaggError, NoFitError
from disagg.model import ComposeMode, CompositionState, Health
from disagg.requestlang import parse_request, parse_resource
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

LINES = st.sampled_from(
    [
        "gpu x1",
        "gpu x2 model=H200",
        "gpu x4 same-switch",
        "gpu x3 spread=chassis",
        "gpu x2 latency<=500ns",
        "nvme x1",
        "nic x2",
        "cxl-memory 256GiB",
        "cxl-memory 1TiB",
        "cxl-memory 3TiB",
    ]
)
HOSTS = st.sampled_from(["", "host h1", "host h3", "host cores>=64", "host memory>=512GiB"])


class ComposerMachine(RuleBasedStateMachine):
    transport = "local"

    def __init__(self) -> None:
        super().__init__()
        self.served = Served(self.transport)
        self.fabrics = rack(via=self.served)
        ids = itertools.count(1)
        # Deterministic ids: Hypothesis replays draw from lists of them, which must not change between runs.
        self.composer = composer(self.fabrics, new_id=lambda prefix: f"{prefix}-{next(ids)}")
        self.model: dict[str, tuple[str, ...]] = {}
        self.counter = 0
        self.gpus = sorted(d.id for d in self.fabrics["pcie0"].discover().devices if d.kind.value == "gpu")

    def _name(self) -> str:
        self.counter += 1
        return f"c{self.counter}"

    @rule(host=HOSTS, lines=st.lists(LINES, min_size=1, max_size=3), flaky=st.integers(0, 3))
    def compose(self, host: str, lines: list[str], flaky: int) -> None:
        request = parse_request(self._name(), [host, *lines] if host else lines)
        before = (hardware_bindings(self.fabrics), hardware_allocations(self.fabrics), self.composer.usage())
        if flaky:
            self.fabrics["pcie0"].flaky_bind(None, flaky)
        try:
            result = self.composer.compose(request)
        except DisaggError:
            after = (hardware_bindings(self.fabrics), hardware_allocations(self.fabrics), self.composer.usage())
            assert after == before, "a failed compose changed something"
        else:
            c = result.composition
            assert c is not None and c.state is CompositionState.COMPOSED
            self.model[c.id] = c.device_ids
        finally:
            self.fabrics["pcie0"].flaky_bind(None, 0)

    @rule(lines=st.lists(LINES, min_size=1, max_size=2))
    def preview_changes_nothing(self, lines: list[str]) -> None:
        before = (hardware_bindings(self.fabrics), self.composer.usage())
        with contextlib.suppress(NoFitError):
            self.composer.compose(parse_request(self._name(), lines), ComposeMode.PREVIEW)
        assert (hardware_bindings(self.fabrics), self.composer.usage()) == before

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def decompose(self, data: st.DataObject) -> None:
        comp_id = data.draw(st.sampled_from(sorted(self.model)))
        self.composer.decompose(comp_id)
        self.composer.decompose(comp_id)
        del self.model[comp_id]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), line=LINES)
    def grow(self, data: st.DataObject, line: str) -> None:
        comp_id = data.draw(st.sampled_from(sorted(self.model)))
        try:
            c = self.composer.recompose(comp_id, add=[parse_resource(line)])
        except DisaggError:
            return
        self.model[comp_id] = c.device_ids

    @precondition(lambda self: any(len(v) > 1 for v in self.model.values()))
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        """Remove one device of a composition that keeps another (removing the last one is refused)."""
        comp_id = data.draw(st.sampled_from(sorted(k for k, v in self.model.items() if len(v) > 1)))
        device = data.draw(st.sampled_from(self.model[comp_id]))
        c = self.composer.recompose(comp_id, remove=[device])
        self.model[comp_id] = c.device_ids

    @rule(index=st.integers(0, 19))
    def fail_gpu(self, index: int) -> None:
        self.fabrics["pcie0"].fail_device(self.gpus[index])
        assert self.composer.wait_for_heals(30)  # beside the events when the driver is remote
        for comp_id in self.model:
            self.model[comp_id] = self.composer.get(comp_id).device_ids

    @rule(index=st.integers(0, 19))
    def repair_gpu(self, index: int) -> None:
        self.fabrics["pcie0"].repair_device(self.gpus[index])

    def teardown(self) -> None:
        self.composer.close()
        self.served.close()

    @invariant()
    def no_device_in_two_compositions(self) -> None:
        seen = [d for c in self.composer.compositions() for d in c.device_ids]
        assert len(seen) == len(set(seen))

    @invariant()
    def ledger_matches_hardware(self) -> None:
        assert ledger_bindings(self.composer) == hardware_bindings(self.fabrics)
        assert ledger_allocations(self.composer) == hardware_allocations(self.fabrics)
        assert {c.id: c.device_ids for c in self.composer.compositions()} == self.model

    @invariant()
    def capacity_conserved(self) -> None:
        kinds, pools = self.composer.usage()
        carved: dict[str, int] = {}
        for a in ledger_allocations(self.composer).values():
            carved[a.pool] = carved.get(a.pool, 0) + a.amount_bytes
        for p in pools:
            assert p.free_bytes + carved.get(p.pool, 0) == p.total_bytes
        used = len(ledger_bindings(self.composer))
        failed_free = sum(
            1
            for d in self.composer.devices()
            if d.health is not Health.OK and self.composer.owner_of(d.id) is None and d.kind.value != "cxl-memory"
        )
        assert sum(k.free for k in kinds) + used + failed_free == sum(k.total for k in kinds)

    @invariant()
    def states_are_settled(self) -> None:
        for c in self.composer.compositions():
            assert c.state in (CompositionState.COMPOSED, CompositionState.DEGRADED)


ComposerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestComposerStateMachine = ComposerMachine.TestCase


class UnixComposerMachine(ComposerMachine):
    transport = "unix"


class TcpComposerMachine(ComposerMachine):
    transport = "tcp"


REMOTE_SETTINGS = settings(
    max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
UnixComposerMachine.TestCase.settings = REMOTE_SETTINGS
TcpComposerMachine.TestCase.settings = REMOTE_SETTINGS
TestComposerStateMachineUnix = UnixComposerMachine.TestCase
TestComposerStateMachineTcp = TcpComposerMachine.TestCase
