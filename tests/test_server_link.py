"""The front end's side of the link (`disagg.server.front_end.FrontLink`) on its own: which call each frame that
comes back reaches, and how a call whose client went away meanwhile ends."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
from disagg.server.front_end import METHODS, FrontLink
from disagg.server.link import END, REPLY, end_payload

WATCH = next(n for n, method in enumerate(METHODS) if method.server_streaming)
UNARY = next(n for n, method in enumerate(METHODS) if not method.server_streaming)


class Context:
    """What a forwarding handler asks of grpcio's context."""

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


class Gone(Context):
    """A call whose client went away, or whose deadline passed, while its answer was on its way: grpcio cannot
    send its status (a batch that fails), and has not cancelled its handler yet."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise grpc.aio.InternalError("Failed execute_batch")


def test_a_call_id_that_wraps_around_skips_a_call_still_open() -> None:
    """Ids are 32 bits: after 2**32 calls the count comes back to a watch open all that while (a controller's, for
    weeks). The call given its id took the watch's answers, and the composer's process its place."""

    async def scenario() -> None:
        link = FrontLink(asyncio.get_running_loop())
        watch = asyncio.create_task(link.stream(WATCH)(b"", Context()))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        (watch_id,) = link._streams
        link._next = watch_id - 1  # 2**32 calls later
        unary = asyncio.create_task(link.unary(UNARY)(b"", Context()))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        (unary_id,) = link._unary
        assert unary_id != watch_id
        link.frame(REPLY, unary_id, b"answer")
        link.frame(END, watch_id, end_payload(0, "", ()))
        assert await asyncio.wait_for(unary, 5) == b"answer"
        await asyncio.wait_for(watch, 5)
        assert not link._unary and not link._streams

    asyncio.run(scenario())


def test_a_refusal_for_a_client_gone_ends_as_cancelled() -> None:
    """As `disagg.server.errors` ends such a call on one process: cancelled, which grpcio logs at debug level, not
    with the error, which it logged with a traceback for an ordinary client that gave up."""

    async def scenario() -> None:
        link = FrontLink(asyncio.get_running_loop())
        unary = asyncio.create_task(link.unary(UNARY)(b"", Gone()))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        (call,) = link._unary
        link.frame(END, call, end_payload(grpc.StatusCode.NOT_FOUND.value[0], "no such thing", ()))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(unary, 5)

    asyncio.run(scenario())
