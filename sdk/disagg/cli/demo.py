"""``disagg demo``: the main job on the embedded default, self-contained (nothing is written to disk).

On the simulated demo rack it composes a training system (8 GPUs on one switch, little CPU) and an
inference system (2 GPUs and 512 GiB of CXL memory from another fabric), fails a GPU and shows the degraded
composition healed, recomposes inference to 4 GPUs, and decomposes everything.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from disagg.cli import render
from disagg.composer import FabricComposer, request_summary
from disagg.config import build_composer, demo_config
from disagg.errors import DisaggError
from disagg.interfaces import FaultInjection
from disagg.model import ComposeMode, Composition, Event, format_size
from disagg.requestlang import parse_request, parse_resource

TRAINING = ("training", ["host cores>=8", "gpu x8 model=H200 same-switch"])
INFERENCE = ("inference", ["host memory>=512GiB", "gpu x2 model=H200 latency<=600ns", "cxl-memory 512GiB"])
GROW = "gpu x2 model=H200 latency<=600ns"


def demo_composer() -> FabricComposer:
    """The embedded default with an in-memory ledger and simulated hardware that lives only in this process."""
    return build_composer(demo_config())


class _Story:
    def __init__(self, composer: FabricComposer, out: TextIO, json_output: bool) -> None:
        self.composer = composer
        self.out = out
        self.json = json_output
        self.steps: list[dict[str, Any]] = []
        self.seen_revision = composer.revision

    def step(self, title: str) -> None:
        if not self.json:
            self.out.write(f"\n== {title}\n")

    def say(self, text: str) -> None:
        if not self.json:
            self.out.write(f"  {text}\n")

    def new_events(self) -> list[Event]:
        events = list(self.composer.events(self.seen_revision))
        if events:
            self.seen_revision = events[-1].revision
        return events

    def show_events(self, events: list[Event]) -> None:
        if not self.json:
            render.table(
                ("REV", "EVENT", "SUBJECT", "DETAIL"),
                [[e.revision, e.type.value, e.subject, e.message or _data(e)] for e in events],
                self.out,
            )

    def show_state(self) -> None:
        kinds, pools = self.composer.usage()
        comps = self.composer.compositions()
        if self.json:
            return
        self.out.write("  compositions\n")
        render.show_compositions(comps, self.out)
        self.out.write("\n")
        render.show_usage(kinds, pools, self.out)

    def record(self, step: str, **data: Any) -> None:
        kinds, pools = self.composer.usage()
        self.steps.append(
            {"step": step, **data, "compositions": list(self.composer.compositions()), "kinds": kinds, "pools": pools}
        )


def _data(event: Event) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(event.data.items()))


def _fault_injector(composer: FabricComposer, device: str) -> FaultInjection:
    fabric = composer.fabrics[composer.device(device).fabric]
    if not isinstance(fabric, FaultInjection):
        raise DisaggError(f"fabric {fabric.name} cannot inject faults")
    return fabric


def run_demo(json_output: bool = False, out: TextIO | None = None) -> int:
    stream = out or sys.stdout
    with demo_composer() as composer:
        story = _Story(composer, stream, json_output)
        story.step("The demo rack")
        for topo in composer.topologies():
            story.say(
                f"fabric {topo.fabric}: {len(topo.hosts)} hosts, {len(topo.switches)} switches, "
                f"{len(topo.devices)} devices"
            )
        story.show_state()
        story.record("rack")
        story.new_events()

        composed: dict[str, Composition] = {}
        for name, clauses in (TRAINING, INFERENCE):
            request = parse_request(name, clauses)
            story.step(f"Compose {name}: {'; '.join(clauses)}")
            plan = composer.compose(request, ComposeMode.PREVIEW).plan
            story.say(f"preview: host {plan.host}, {request_summary(request)}")
            comp = composer.compose(request).composition
            assert comp is not None
            composed[name] = comp
            story.say(f"composed {comp.name} ({comp.id}) on host {comp.host}: {comp.state.value}")
            if not json_output:
                render.show_composition_devices(comp, stream)
            story.record(f"compose {name}", plan=plan)
        story.step("Compositions and pools in use")
        story.show_state()
        story.new_events()

        victim = composed["training"].devices[0].device
        story.step(f"Fail GPU {victim} of training")
        _fault_injector(composer, victim).fail_device(victim, "demo: uncorrectable ECC error")
        events = story.new_events()
        story.show_events(events)
        healed = composer.find("training")
        spare = [d for d in healed.device_ids if d not in composed["training"].device_ids]
        story.say(
            f"training went DEGRADED and was healed: {healed.state.value}, {victim} replaced by {', '.join(spare)}"
        )
        story.record("fail and heal", failed=victim, events=events)

        story.step(f"Recompose inference to 4 GPUs: add {GROW}")
        inference = composer.find("inference")
        grown = composer.recompose(inference.id, add=[parse_resource(GROW)], expected_etag=inference.etag)
        memory = format_size(sum(a.amount_bytes for a in grown.allocations))
        story.say(f"inference now has {len(grown.devices)} GPUs and {memory} of CXL memory ({grown.etag})")
        if not json_output:
            render.show_composition_devices(grown, stream)
        story.record("recompose inference", composition=grown)
        story.new_events()

        story.step("Decompose everything")
        for comp in composer.compositions():
            composer.decompose(comp.id)
            story.say(f"decomposed {comp.name}")
        story.show_state()
        story.record("decompose", events=story.new_events())
        if json_output:
            render.emit_json({"steps": story.steps}, stream)
        else:
            pools = composer.usage()[1]
            unhealthy = [d.id for d in composer.devices() if d.health.value != "OK"]
            but = f" but the failed {', '.join(unhealthy)}" if unhealthy else ""
            memory = "all free" if all(p.free_bytes == p.total_bytes for p in pools) else "NOT all free"
            stream.write(f"\nEverything is back in the free pools{but}; CXL memory {memory}.\n")
    return 0
