"""A change addressed by a name that names nothing as it begins, while a compose takes that name.

A change holds its composition against every other change of it (`FabricComposer._holding`), found by its key as
the change begins. A name that named nothing was not held, and the change looked it up again as it started: a
compose that had taken the name in between was found there, and changed while its binds were under way. A
decompose then released the new composition and forgot it; the compose, resuming, failed with a KeyError after
its bind, which stayed bound with no record of it. A serial order gives one of two outcomes: the change first
(it finds nothing) or the compose first (the change waits for it, then acts on the composed composition).

Each test pauses the change between the two lookups (its first step, replaced by one that waits before it
runs) while a compose takes the name and binds, behind a gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import composer as make_composer
from disagg.composer import FabricComposer
from disagg.errors import NotFoundError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.model import CompositionState
from disagg.requestlang import parse_request
from disagg.store import MemoryStore
from disagg_sim import load_topology
from server_helpers import WAIT_S, GatedBind, compose_request, serving, socket_path


class WritesThatWait(MemoryStore):
    """An in-memory ledger that says its writes may wait, as etcd's do: the server runs each change in a thread
    of its own (`Store.writes_block`), where the changes of the Python API run too."""

    @property
    def writes_block(self) -> bool:
        return True


def gated_pcie() -> GatedBind:
    gated = GatedBind(load_topology("pcie0", "demo-pcie"))
    gated.entered, gated.gate = threading.Event(), threading.Event()
    return gated


def pause_first(
    composer: FabricComposer, step: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Make the first call of the composer's ``step`` wait, once it is reached, until the second event is set."""
    reached, go = threading.Event(), threading.Event()
    original = getattr(composer, step)

    def paused(*args: Any) -> Any:
        if not reached.is_set():
            reached.set()
            go.wait(WAIT_S)
        return original(*args)

    monkeypatch.setattr(composer, step, paused)
    return reached, go


def in_thread(call: Callable[[], Any], outcomes: dict[str, Any], key: str) -> threading.Thread:
    def run() -> None:
        try:
            outcomes[key] = call()
        except Exception as exc:
            outcomes[key] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.fixture
def gated() -> Iterator[GatedBind]:
    pcie = gated_pcie()
    yield pcie
    pcie.gate.set()


class TestThroughThePythonApi:
    def test_a_decompose_waits_for_the_compose_it_finds(
        self, gated: GatedBind, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        composer = make_composer({"pcie0": gated}, store=MemoryStore())
        try:
            reached, go = pause_first(composer, "_decompose", monkeypatch)
            outcomes: dict[str, Any] = {}
            decompose = in_thread(lambda: composer.decompose("job"), outcomes, "decompose")
            assert reached.wait(WAIT_S)  # "job" named nothing: nothing is held
            compose = in_thread(lambda: composer.compose(parse_request("job", ["gpu x1"])), outcomes, "compose")
            assert gated.entered.wait(WAIT_S)  # the compose took the name and binds, holding its composition
            go.set()
            decompose.join(0.5)
            assert decompose.is_alive(), f"the decompose did not wait for the compose: {outcomes}"
            gated.gate.set()
            compose.join(WAIT_S)
            decompose.join(WAIT_S)
            assert outcomes["compose"].composition.name == "job"
            assert outcomes["decompose"] is None
            assert list(composer.compositions()) == [] and list(gated.bindings()) == []
            assert composer.reconcile() == 0
        finally:
            composer.close()

    def test_an_update_waits_for_the_compose_it_finds(self, gated: GatedBind, monkeypatch: pytest.MonkeyPatch) -> None:
        """Before, it found the composition COMPOSING and was refused as a conflict: no serial order gives that."""
        composer = make_composer({"pcie0": gated}, store=MemoryStore())
        try:
            reached, go = pause_first(composer, "_recompose", monkeypatch)
            outcomes: dict[str, Any] = {}
            add = parse_request("job", ["gpu x1"]).resources
            update = in_thread(lambda: composer.recompose("job", add=add), outcomes, "update")
            assert reached.wait(WAIT_S)
            compose = in_thread(lambda: composer.compose(parse_request("job", ["gpu x1"])), outcomes, "compose")
            assert gated.entered.wait(WAIT_S)
            go.set()
            gated.gate.set()
            compose.join(WAIT_S)
            update.join(WAIT_S)
            assert not isinstance(outcomes["update"], Exception), outcomes
            job = composer.find("job")
            assert job.state is CompositionState.COMPOSED and len(job.devices) == 2
            assert {b.device for b in gated.bindings()} == set(job.device_ids)
        finally:
            composer.close()

    def test_a_name_that_stays_free_is_not_found(self, monkeypatch: pytest.MonkeyPatch) -> None:
        composer = make_composer({"pcie0": gated_pcie()}, store=MemoryStore())
        try:
            assert composer.decompose("nothing") is None
            with pytest.raises(NotFoundError):
                composer.recompose("nothing", add=parse_request("x", ["gpu x1"]).resources)
            with pytest.raises(NotFoundError):
                composer.heal("nothing")
        finally:
            composer.close()


class TestOverGrpc:
    def test_a_decompose_leaves_no_binding_unrecorded(
        self, tmp_path: Path, gated: GatedBind, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Before, the Compose failed with INTERNAL after its bind, the Decompose answered OK, and the GPU stayed
        bound with no composition recording it."""
        with serving(socket_path(tmp_path), {"pcie0": gated}, store=WritesThatWait()) as served:
            reached, go = pause_first(served.composer, "_decompose", monkeypatch)
            raw = grpc.insecure_channel(served.address)  # not the guarded channel, which waits on each call
            try:
                stub = fm_grpc.FabricManagerServiceStub(raw)
                decompose = stub.Decompose.future(fm.DecomposeRequest(id="job"), timeout=WAIT_S)
                assert reached.wait(WAIT_S)
                compose = stub.Compose.future(compose_request("job"), timeout=WAIT_S)
                assert gated.entered.wait(WAIT_S)
                go.set()
                with pytest.raises(grpc.FutureTimeoutError):
                    decompose.result(timeout=0.5)  # it waits for the compose, as a serial decompose would
                gated.gate.set()
                composed = compose.result(timeout=WAIT_S).composition
                decompose.result(timeout=WAIT_S)
                assert composed.name == "job"
                listed = stub.ListCompositions(fm.ListCompositionsRequest(), timeout=WAIT_S).compositions
                assert list(listed) == [] and list(gated.bindings()) == []
            finally:
                raw.close()
