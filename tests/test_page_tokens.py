"""Every page token the server issues is accepted back, whatever characters its key has (a composition's name may
be any text); a token too long to carry any key the server lists, or of another listing, is refused."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from disagg.errors import InvalidRequestError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.model import CompositionRequest
from disagg.requestlang import parse_resource
from disagg.wire import driver
from disagg.wire.fabric import MAX_PAGE_TOKEN, page_token_from_wire, page_token_to_wire
from hypothesis import given
from hypothesis import strategies as st
from server_helpers import fails, serving, socket_path

COLLECTIONS = ["devices", "compositions", "reservations"]
WIDE = ["g", "é", "設", "\U0001f600"]
"""Characters of one to four UTF-8 bytes."""

device_ids = st.text(
    st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp")), min_size=1, max_size=256
).filter(lambda text: text.isprintable() and not any(c.isspace() for c in text))


@pytest.mark.parametrize("collection", COLLECTIONS)
@pytest.mark.parametrize("char", WIDE)
def test_longest_id_round_trips(collection: str, char: str) -> None:
    key = driver.check_id("pcie0/" + char * (driver.MAX_ID - 6), "id")
    assert page_token_from_wire(page_token_to_wire(collection, key), collection) == key


@given(key=device_ids)
def test_every_device_id_round_trips(key: str) -> None:
    driver.check_id(key, "id")
    assert page_token_from_wire(page_token_to_wire("devices", key), "devices") == key


@pytest.mark.parametrize("char", WIDE)
def test_key_longer_than_any_id_is_refused(char: str) -> None:
    token = page_token_to_wire("devices", char * (driver.MAX_ID + 1))
    with pytest.raises(InvalidRequestError, match="not a page token of this listing") as info:
        page_token_from_wire(token, "devices")
    assert info.value.field == "page_token"


@pytest.mark.parametrize("length", [driver.MAX_ID * 4 + 1, driver.MAX_ID * 100])
def test_token_longer_than_any_token_is_refused(length: int) -> None:
    token = page_token_to_wire("reservations", "x" * length)
    assert len(token) > len(page_token_to_wire("reservations", WIDE[-1] * driver.MAX_ID))
    with pytest.raises(InvalidRequestError, match="not a page token of this listing"):
        page_token_from_wire(token, "reservations")


@pytest.mark.parametrize("token", ["é", "ZGV2aWNlczpn設", "\U0001f600"])
def test_a_token_beyond_ascii_is_refused(token: str) -> None:
    """base64 raised a plain ValueError for it, which reached a client as INTERNAL."""
    with pytest.raises(InvalidRequestError, match="not a page token of this listing") as info:
        page_token_from_wire(token, "devices")
    assert info.value.field == "page_token"


def test_a_token_beyond_ascii_is_invalid_argument_over_grpc(tmp_path: Path) -> None:
    with serving(socket_path(tmp_path)) as served:
        for call, request in (
            (served.stub.ListDevices, fm.ListDevicesRequest(page_token="é")),
            (served.stub.ListCompositions, fm.ListCompositionsRequest(page_token="é")),
            (served.stub.ListReservations, fm.ListReservationsRequest(page_token="é")),
        ):
            failure = fails(call, request, timeout=10)
            assert failure.code is grpc.StatusCode.INVALID_ARGUMENT
            assert failure.fields == ("page_token",) and "not a page token" in failure.message


names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=600)
"""Composition names as the model takes them: any non-empty text (a surrogate cannot be sent at all)."""


@given(name=names)
def test_every_composition_name_round_trips(name: str) -> None:
    """A name made through the Python API may be longer than the wire's, or hold a tab: its token was refused."""
    assert page_token_from_wire(page_token_to_wire("compositions", name), "compositions") == name


@pytest.mark.parametrize(("given", "asked"), [("compositions", "devices"), ("devices", "compositions")])
def test_a_token_of_another_listing_is_refused(given: str, asked: str) -> None:
    with pytest.raises(InvalidRequestError, match="not a page token of this listing"):
        page_token_from_wire(page_token_to_wire(given, "b" * 300), asked)


def test_a_compositions_token_longer_than_any_request_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="not a page token of this listing"):
        page_token_from_wire("A" * (MAX_PAGE_TOKEN + 1), "compositions")


def test_compositions_named_as_the_wire_would_not_are_listed_page_by_page(tmp_path: Path) -> None:
    """ListCompositions handed out a token past such a name, then refused it: the listing could not go on."""
    odd = ("b" * 300, "tab\there")  # the demo rack has four hosts
    with serving(socket_path(tmp_path)) as served:
        for name in ("a-first", *odd, "z-last"):
            served.composer.compose(CompositionRequest(name, (parse_resource("gpu x1"),)))
        listed, token = [], ""
        while True:
            page = served.stub.ListCompositions(fm.ListCompositionsRequest(page_size=1, page_token=token))
            listed += [c.name for c in page.compositions]
            token = page.next_page_token
            if not token:
                break
    assert listed == sorted(["a-first", *odd, "z-last"])
