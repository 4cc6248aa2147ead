"""A request's digest never changes, however it is written: the ledger keeps it, and a retry after an upgrade is
compared by it. orjson writes it where its text is the standard encoder's (`disagg.composer.requests.digest`);
these are the values where the two encoders differ, and the digest must be the one `codec.dumps` gives."""

from __future__ import annotations

import hashlib
import math

import pytest
from disagg import codec
from disagg.composer import requests
from disagg.interfaces import ComposeResult
from disagg.model import (
    ComposeMode,
    CompositionRequest,
    DeviceKind,
    HostRequest,
    Plan,
    Reservation,
    ResourceRequest,
    Selector,
    SelectorOp,
)
from disagg.requestlang import parse_request


def _with(*selectors: Selector, name: str = "job") -> CompositionRequest:
    line = ResourceRequest(DeviceKind.GPU, count=2, selectors=selectors)
    return CompositionRequest(name, (line,), HostRequest(min_cores=32, selectors=selectors[:1]))


SELECTED = [
    ("plain", parse_request("job", ["host cores>=32", "gpu x2 model=H200", "cxl-memory 512GiB"])),
    ("a float", _with(Selector("bandwidth", SelectorOp.GE, 0.5))),
    ("a float with an exponent", _with(Selector("bandwidth", SelectorOp.GE, 1e16))),
    ("a small float", _with(Selector("bandwidth", SelectorOp.GE, 1e-5))),
    ("an infinity", _with(Selector("bandwidth", SelectorOp.LE, math.inf))),
    ("an integer past 64 bits", _with(Selector("serial", SelectorOp.EQ, 2**70))),
    ("a string beyond ASCII", _with(Selector("rack", SelectorOp.EQ, "Zürich-β"))),
    ("quotes, a backslash and a control", _with(Selector("label", SelectorOp.EQ, 'a"b\\c\x01\x7f\n'))),
    ("a string that looks like an exponent", _with(Selector("model", SelectorOp.EQ, "H100e5"))),
    ("a boolean", _with(Selector("nvlink", SelectorOp.EQ, True))),
]


def _standard(fingerprint: object) -> str:
    return hashlib.sha256(codec.dumps(fingerprint).encode()).hexdigest()


@pytest.mark.parametrize("request_", [r for _, r in SELECTED], ids=[n for n, _ in SELECTED])
@pytest.mark.parametrize(
    "tail", [(ComposeMode.APPLY, 60.0), (ComposeMode.RESERVE, 1e-3), (ComposeMode.RESERVE, 86400.0)], ids=str
)
def test_the_digest_is_the_standard_encoder_s(request_: CompositionRequest, tail: tuple[ComposeMode, float]) -> None:
    fingerprint = (request_, *tail)
    assert requests.digest(fingerprint) == _standard(fingerprint)


def test_an_update_s_fingerprint_too() -> None:
    """An UpdateComposition's: its id, the lines it adds and the ids it removes, and its etag (or None)."""
    add = parse_request("x", ["gpu x1 model=H200", "nic"]).resources
    for fingerprint in [("recompose", "c-1", add, ("pcie0/gpu-a0",), None), ("recompose", "job", (), (), "e-3")]:
        assert requests.digest(fingerprint) == _standard(fingerprint)


@pytest.mark.parametrize("request_", [r for _, r in SELECTED], ids=[n for n, _ in SELECTED])
def test_an_answer_reads_back_as_it_was(request_: CompositionRequest) -> None:
    answer = ComposeResult(ComposeMode.PREVIEW, Plan("h1"))
    assert requests.decode(requests.encode(answer)) == answer
    reserved = ComposeResult(ComposeMode.RESERVE, Plan("h1"), reservation=Reservation("r-1", request_, Plan("h1"), 1e3))
    assert requests.decode(requests.encode(reserved)) == reserved
