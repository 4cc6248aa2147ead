"""The hottest frozen model classes set their fields through their slots (`disagg.model._quick`): an object made
so is the object attrs' own ``__init__`` makes, field for field, defaults, factories and converters included, and
it is as frozen."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from disagg.composer.steps import Call, Done
from disagg.interfaces.composer import ComposeResult
from disagg.interfaces.context import CallContext
from disagg.interfaces.placement import DeviceGroup
from disagg.model import (
    Binding,
    ChangeKind,
    ComposeMode,
    Composition,
    CompositionRequest,
    CompositionState,
    DeviceKind,
    DevicePick,
    Event,
    EventType,
    PendingChange,
    Plan,
    ResourceRequest,
)
from disagg.model._quick import GENERATED, quick_init
from disagg.store.base import RequestRecord

PICK = DevicePick("sim/g0", "sim", 120)
PLAN = Plan("h1", (PICK,), ())
PENDING = PendingChange(ChangeKind.ADD, (PICK,), (), None, "r1", "fp")
COMP = Composition("c-1", "n", "h1", CompositionState.COMPOSING, (), (PICK,), pending=PENDING)

CASES: list[tuple[type, tuple[Any, ...], dict[str, Any]]] = [
    (DevicePick, ("sim/g0", "sim", 120), {}),
    (Plan, ("h1", (PICK,), ()), {}),
    (Plan, ("h1",), {}),
    (PendingChange, (ChangeKind.ADD, (PICK,), (), None, "r1", "fp"), {}),
    (PendingChange, (ChangeKind.REMOVE,), {"devices": (PICK,)}),
    (Composition, ("c-1", "n", "h1", CompositionState.COMPOSING, ()), {"devices": (PICK,), "pending": PENDING}),
    (Composition, ("c-1", "n", "h1", CompositionState.COMPOSED, ()), {"generation": 3, "message": "m"}),
    (Event, (5, EventType.COMPOSITION_CREATED, "c-1", "made", 1.5, {"host": "h1"}), {}),
    (Event, (5, EventType.COMPOSITION_CREATED, "c-1"), {}),
    (Event, (5, EventType.COMPOSITION_CREATED, "c-1"), {"data": None}),
    (ComposeResult, (ComposeMode.APPLY, PLAN), {"composition": COMP}),
    (ComposeResult, (ComposeMode.PREVIEW, PLAN), {}),
    (RequestRecord, ("r1", "fp", "{}", 2.5), {}),
    (Binding, ("sim/g0", "h1"), {}),
    (CompositionRequest, ("n", (ResourceRequest(DeviceKind.GPU, 1),)), {}),
    (DeviceGroup, (1, "sw1", 100, 3, {"rack": "r1"}), {}),
    (CallContext, (), {}),
    (CallContext, (4, 2.5, "r1"), {}),
    (Call, (print,), {}),
    (Call, (print, False), {}),
    (Done, (), {}),
    (Done, (None, ValueError("no")), {}),
]


def test_the_hot_classes_have_a_quick_init() -> None:
    assert {cls for cls, _, _ in CASES} <= set(GENERATED)


@pytest.mark.parametrize(("cls", "args", "kwargs"), CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_a_quick_init_makes_what_attrs_makes(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    quick = cls(*args, **kwargs)
    generated = cls.__new__(cls)
    GENERATED[cls](generated, *args, **kwargs)
    assert quick == generated
    for field in attrs.fields(cls):
        mine, theirs = getattr(quick, field.name), getattr(generated, field.name)
        assert type(mine) is type(theirs) and mine == theirs, field.name
        if field.converter is None:
            assert mine is theirs, field.name
    assert repr(quick) == repr(generated)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        quick.x = 1  # type: ignore[attr-defined]
    first = attrs.fields(cls)[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(quick, first, getattr(quick, first))
    assert attrs.evolve(quick) == quick


def test_a_post_init_still_checks() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        CompositionRequest("", (ResourceRequest(DeviceKind.GPU, 1),))


def test_a_missing_argument_is_refused_as_by_attrs() -> None:
    with pytest.raises(TypeError):
        Composition("c-1", "n", "h1", CompositionState.COMPOSING)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        GENERATED[Composition](Composition.__new__(Composition), "c-1", "n", "h1", CompositionState.COMPOSING)


def test_a_class_attrs_did_not_make_frozen_is_left_as_it_is() -> None:
    @attrs.define
    class Mutable:
        a: int

    init = Mutable.__init__
    assert quick_init(Mutable) is Mutable and Mutable.__init__ is init and Mutable not in GENERATED
