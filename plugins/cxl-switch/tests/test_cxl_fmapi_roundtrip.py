"""Any payload survives encode then decode unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from cxl_switch_strategies import PAYLOADS, vcs_infos
from disagg_cxl_switch.fmapi import REQUESTS, RESPONSES, EmptyPayload, GetVirtualCxlSwitchInfoResponse, VCSInfo
from hypothesis import given
from hypothesis import strategies as st


class TestRoundTrip:
    """decode(encode(x)) == x for every payload class."""

    @pytest.mark.parametrize("cls", list(PAYLOADS), ids=lambda cls: cls.__name__)
    def test_round_trip(self, cls: type[Any]) -> None:
        @given(PAYLOADS[cls])
        def check(payload: Any) -> None:
            assert cls.decode(payload.encode()) == payload

        check()

    @given(st.lists(vcs_infos(), max_size=4).map(tuple))
    def test_virtual_switch_info(self, vcss: tuple[VCSInfo, ...]) -> None:
        info = GetVirtualCxlSwitchInfoResponse(vcss)
        assert GetVirtualCxlSwitchInfoResponse.decode(info.encode()) == info

    def test_every_class_is_covered(self) -> None:
        classes = set(REQUESTS.values()) | set(RESPONSES.values())
        empty = {cls for cls in classes if issubclass(cls, EmptyPayload)}
        assert classes - empty == set(PAYLOADS) | {GetVirtualCxlSwitchInfoResponse}
        for cls in empty:
            assert cls.decode(cls().encode()) == cls()
