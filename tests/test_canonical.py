"""`disagg.canonical.text` is `codec.dumps`'s text, character for character: a request's digest hashes it, the
ledger keeps the digest, and a retry after an upgrade is compared by it. Every model type, and requests of every
shape with values where encoders commonly differ (floats with exponents, infinities, NaN, integers past 64 bits,
strings beyond ASCII, control characters, lone surrogates)."""

from __future__ import annotations

import enum
import hashlib
import math
from typing import Any

import attrs
import pytest
from disagg import canonical, codec
from disagg.composer import requests
from disagg.model import (
    ComposeMode,
    CompositionRequest,
    DeviceKind,
    HostRequest,
    Plan,
    ResourceRequest,
    Selector,
    SelectorOp,
)
from hypothesis import given
from hypothesis import strategies as st
from test_codec import EXAMPLES, composition_requests, devices

awkward_scalars = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.sampled_from([1e-05, 1e16, 1e22, -0.0, 0.1 + 0.2, 5e-324, math.inf, -math.inf, math.nan, 2**64, -(2**70)]),
)


@st.composite
def awkward_requests(draw: st.DrawFn) -> CompositionRequest:
    """A request from `test_codec`'s strategy with its selectors' values replaced by awkward ones."""
    request = draw(composition_requests)

    def awkward(line: Any) -> Any:
        values = [draw(awkward_scalars) for _ in line.selectors]
        chosen = tuple(Selector(s.key, s.op, v) for s, v in zip(line.selectors, values, strict=True))
        return attrs.evolve(line, selectors=chosen)

    resources = tuple(awkward(line) for line in request.resources)
    return CompositionRequest(request.name, resources, awkward(request.host))


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
def test_every_model_type(value: Any) -> None:
    assert canonical.text(value) == codec.dumps(value)


@given(awkward_requests(), st.sampled_from(ComposeMode), awkward_scalars)
def test_a_compose_fingerprint(request: CompositionRequest, mode: ComposeMode, ttl: Any) -> None:
    fingerprint = (request, mode, ttl)
    assert canonical.text(fingerprint) == codec.dumps(fingerprint)


@given(devices)
def test_a_device(device: Any) -> None:
    assert canonical.text(device) == codec.dumps(device)


@given(st.lists(st.one_of(awkward_scalars, st.none()), max_size=5), st.none() | st.text(max_size=5))
def test_an_update_fingerprint(removed: list[Any], etag: str | None) -> None:
    """An UpdateComposition's: its id, the lines it adds, the ids it removes (here any plain values) and its
    etag; a list is written as a tuple is."""
    add = (ResourceRequest(DeviceKind.GPU, count=1),)
    for fingerprint in [("recompose", "c-1", add, tuple(removed), etag), ["apply", "r-1"], []]:
        assert canonical.text(fingerprint) == codec.dumps(fingerprint)


def test_a_value_it_cannot_write_is_refused_and_digested_by_codec() -> None:
    """A selector whose value is a model value (no such request is valid; the digest still must not fail):
    `canonical.text` refuses it as the standard encoder would, and the digest is `codec.dumps`'s."""
    line = ResourceRequest(DeviceKind.GPU, count=1, selectors=(Selector("k", SelectorOp.EQ, Plan("h1")),))  # type: ignore[arg-type]
    request = CompositionRequest("job", (line,))
    with pytest.raises(TypeError):
        canonical.text(request)
    assert requests.digest(request) == hashlib.sha256(codec.dumps(request).encode()).hexdigest()


class _Plain(enum.Enum):
    TEXT = "text"
    NUMBER = 2


class _Bits(enum.Flag):
    READ = 1
    WRITE = 2


@pytest.mark.parametrize("value", [ComposeMode.APPLY, _Plain.TEXT, _Plain.NUMBER, _Bits.READ, _Bits.READ | _Bits.WRITE])
def test_an_enum_is_its_value_each_time(value: enum.Enum) -> None:
    """An enum is written as its value, the first time and once its members' texts are kept (a Flag's
    combination of members, which is no member, too)."""
    assert [canonical.text(value), canonical.text(value)] == [codec.dumps(value)] * 2


def test_lines_and_hosts_sent_again_are_written_as_they_are() -> None:
    """The wire layer reads the same bytes as the same line and host, whose text is then remembered: requests
    that share them, alternate with others, or differ from them only in a field are each written as they are."""
    gpu, memory = ResourceRequest(DeviceKind.GPU, count=1), ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=1 << 30)
    host = HostRequest(min_cores=32)
    sent = [
        CompositionRequest("a", (gpu,), host),
        CompositionRequest("b", (gpu,), host),
        CompositionRequest("c", (memory, gpu), HostRequest(min_cores=16)),
        CompositionRequest("d", (attrs.evolve(gpu, count=2),), host),
        CompositionRequest("e", (gpu,), host),
    ]
    for request in sent:
        assert canonical.text((request, ComposeMode.APPLY, 86400.0)) == codec.dumps(
            (request, ComposeMode.APPLY, 86400.0)
        )
