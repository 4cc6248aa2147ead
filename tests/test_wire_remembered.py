"""Resource lines and host requests read before are found by their bytes (`disagg.wire.fabric`).

A Compose reads its request's lines and host per call; clients send the same few again and again, so a valid one
read once is remembered by its encoding. What is remembered must read the same as a fresh read, stay bounded, and
never stand for a message that was refused: a refusal is found again each time, naming the field it was sent in.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from disagg.errors import InvalidRequestError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.model import DeviceKind
from disagg.wire import fabric as wire


@pytest.fixture(autouse=True)
def forgotten() -> Iterator[None]:
    """Each test starts and ends with nothing remembered."""
    _forget()
    yield
    _forget()


def _forget() -> None:
    wire._LINES_READ.clear()
    wire._HOSTS_READ.clear()
    wire._PARTS_READ.clear()


def _gpus(count: int) -> fm.ResourceRequest:
    return fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=count)


def test_a_line_read_again_is_the_value_read_first() -> None:
    first = wire.resource_from_wire(_gpus(2), "resources[0]")
    again = wire.resource_from_wire(_gpus(2), "resources[3]")
    assert again is first
    assert (again.kind, again.count) == (DeviceKind.GPU, 2)
    assert wire.resource_from_wire(_gpus(3), "resources[0]").count == 3


def test_a_host_read_again_is_the_value_read_first() -> None:
    first = wire.host_request_from_wire(fm.HostRequest(min_cores=32))
    assert wire.host_request_from_wire(fm.HostRequest(min_cores=32)) is first
    assert wire.host_request_from_wire(fm.HostRequest(min_cores=16)).min_cores == 16


def test_a_refused_line_is_refused_each_time_naming_where_it_was_sent() -> None:
    bad = fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1, spread=" ")
    for field in ("resources[0]", "add[2]"):
        with pytest.raises(InvalidRequestError) as refused:
            wire.resource_from_wire(bad, field)
        assert refused.value.field == f"{field}.spread"
    assert wire._LINES_READ == {}


def test_what_is_remembered_stays_bounded() -> None:
    for count in range(1, wire.MAX_REMEMBERED + 50):
        wire.resource_from_wire(_gpus(count), "resources[0]")
    assert 0 < len(wire._LINES_READ) <= wire.MAX_REMEMBERED
    long = fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)
    model = "x" * wire.MAX_REMEMBERED_BYTES
    long.selectors.add(key="model", op=fm.SELECTOR_OP_EQ, value=pb.AttributeValue(string_value=model))
    assert wire.resource_from_wire(long, "resources[0]").selectors[0].value == model
    assert long.SerializeToString() not in wire._LINES_READ


def _compose(name: str, host: fm.HostRequest, *lines: fm.ResourceRequest) -> fm.ComposeRequest:
    """A Compose as a client sends it: new messages each time, the same bytes for the same request."""
    return fm.ComposeRequest(name=name, host=host, resources=lines, mode=fm.COMPOSE_MODE_APPLY)


def test_a_compose_read_again_is_the_request_read_afresh() -> None:
    host = fm.HostRequest(min_cores=32)
    with_selector = fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)
    with_selector.selectors.add(key="model", op=fm.SELECTOR_OP_EQ, value=pb.AttributeValue(string_value="a100"))
    for line in (_gpus(1), with_selector):
        first = wire.compose_request_from_wire(_compose("first", host, line))
        resent = fm.ResourceRequest.FromString(line.SerializeToString())
        again = wire.compose_request_from_wire(_compose("again", fm.HostRequest(min_cores=32), resent))
        assert again.resources is first.resources and again.host is first.host
        assert again.name == "again"
        _forget()
        assert wire.compose_request_from_wire(_compose("again", host, line)) == again
    two = wire.compose_request_from_wire(_compose("two", host, _gpus(1), _gpus(2)))
    assert [line.count for line in two.resources] == [1, 2]


def test_a_refused_compose_is_refused_each_time() -> None:
    """A line and host each valid, whose selectors conflict together, are remembered alone but never together; a
    bad name is refused with parts that were remembered."""
    host = fm.HostRequest(min_cores=32)
    for op in (fm.SELECTOR_OP_GT, fm.SELECTOR_OP_LT):
        host.selectors.add(key="cores", op=op, value=pb.AttributeValue(int_value=8))
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as refused:
            wire.compose_request_from_wire(_compose("a", host, _gpus(1)))
        assert refused.value.field == "host.selectors[1]"
    assert wire._PARTS_READ == {} and wire._HOSTS_READ
    wire.compose_request_from_wire(_compose("a", fm.HostRequest(), _gpus(1)))
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as refused:
            wire.compose_request_from_wire(_compose("-a", fm.HostRequest(), _gpus(1)))
        assert refused.value.field == "name"
    with pytest.raises(InvalidRequestError) as refused:
        wire.compose_request_from_wire(_compose("a", fm.HostRequest()))
    assert refused.value.field == "resources"
