"""The client's retries: as the server marks its errors, only calls safe to repeat, bounded; watch resumes."""

from __future__ import annotations

import contextlib
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import composer as build_composer
from composer_helpers import hardware_bindings
from disagg.client import MAX_TIMEOUT_S, NO_RETRY, FabricManagerClient, RetryPolicy
from disagg.client._retry import call_with_retry
from disagg.composer import FabricComposer
from disagg.errors import (
    CapacityExhaustedError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    LedgerNotFencedError,
    NoFitError,
    NotFoundError,
    OverloadedError,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.model import ComposeMode, EventType, ResourceRequest
from disagg.requestlang import parse_request, parse_resource
from disagg.wire.errors import to_status
from disagg.wire.fabric import (
    compose_mode_from_wire,
    compose_request_from_wire,
    composition_to_wire,
    event_to_wire,
    plan_to_wire,
    resources_from_wire,
)
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01)


class FakeRpcError(grpc.RpcError):
    """A call's failure that gRPC itself reports (no server's status): ``details`` is the code's name unless given."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(code.name)
        self._code = code
        self._details = details or code.name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class ServerRpcError(FakeRpcError):
    """A call's failure as a server answered it, with its status details (`disagg.wire.errors.to_status`)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...]) -> None:
        super().__init__(code, details)
        self._trailing = trailing

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:  # type: ignore[override]
        return self._trailing


class Flaky(fm_grpc.FabricManagerServiceServicer):
    """Fails each RPC with UNAVAILABLE the first ``failures`` times it is called, then answers.

    Compose runs on a real composer and, on a failing attempt, composes *before* failing, as a server whose
    answer is lost on the way back would.
    """

    def __init__(self, composer: FabricComposer, failures: int = 2) -> None:
        self.composer = composer
        self.failures = failures
        self.calls: dict[str, int] = {}
        self.request_ids: list[str] = []
        self.update_ids: list[str] = []
        self.watch_requests: list[int] = []
        self.watch_cancelled = threading.Event()
        self.watch_started = threading.Event()

    def _attempt(self, method: str, context: grpc.ServicerContext) -> None:
        n = self.calls[method] = self.calls.get(method, 0) + 1
        if n <= self.failures:
            context.abort_with_status(to_status(FabricUnavailableError(f"{method} attempt {n} lost")))

    def GetTopology(self, request: fm.GetTopologyRequest, context: grpc.ServicerContext) -> fm.GetTopologyResponse:  # noqa: N802
        self._attempt("GetTopology", context)
        return fm.GetTopologyResponse()

    def GetComposition(  # noqa: N802
        self, request: fm.GetCompositionRequest, context: grpc.ServicerContext
    ) -> fm.GetCompositionResponse:
        self.calls["GetComposition"] = self.calls.get("GetComposition", 0) + 1
        found = self.composer.find(request.id) if request.id in self._known() else None
        if found is None:
            context.abort_with_status(to_status(NotFoundError("composition", request.id)))
            raise AssertionError("abort returns never")
        return fm.GetCompositionResponse(composition=composition_to_wire(found))

    def _known(self) -> set[str]:
        return {key for c in self.composer.compositions() for key in (c.id, c.name)}

    def UpdateComposition(  # noqa: N802
        self, request: fm.UpdateCompositionRequest, context: grpc.ServicerContext
    ) -> fm.UpdateCompositionResponse:
        self.update_ids.append(request.request_id)
        comp = self.composer.recompose(
            request.id,
            add=resources_from_wire(request.add, "add", required=False),
            remove=tuple(request.remove),
            request_id=request.request_id or None,
        )
        self._attempt("UpdateComposition", context)
        return fm.UpdateCompositionResponse(composition=composition_to_wire(comp))

    def ReleaseReservation(  # noqa: N802
        self, request: fm.ReleaseReservationRequest, context: grpc.ServicerContext
    ) -> fm.ReleaseReservationResponse:
        self._attempt("ReleaseReservation", context)
        return fm.ReleaseReservationResponse()

    def ListReservations(  # noqa: N802
        self, request: fm.ListReservationsRequest, context: grpc.ServicerContext
    ) -> fm.ListReservationsResponse:
        self._attempt("ListReservations", context)
        return fm.ListReservationsResponse(revision=7)

    def Decompose(self, request: fm.DecomposeRequest, context: grpc.ServicerContext) -> fm.DecomposeResponse:  # noqa: N802
        self._attempt("Decompose", context)
        return fm.DecomposeResponse()

    def Compose(self, request: fm.ComposeRequest, context: grpc.ServicerContext) -> fm.ComposeResponse:  # noqa: N802
        self.request_ids.append(request.request_id)
        mode = compose_mode_from_wire(request.mode)
        result = self.composer.compose(compose_request_from_wire(request), mode, request_id=request.request_id or None)
        self._attempt("Compose", context)
        resp = fm.ComposeResponse(mode=request.mode, plan=plan_to_wire(result.plan))
        if result.composition is not None:
            resp.composition.CopyFrom(composition_to_wire(result.composition))
        return resp

    def WatchEvents(  # noqa: N802
        self, request: fm.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[fm.WatchEventsResponse]:
        self.watch_requests.append(request.after_revision)
        context.add_callback(self.watch_cancelled.set)
        events = self.composer.events(request.after_revision)
        first = len(self.watch_requests) == 1
        for n, event in enumerate(events):
            # The first stream also repeats an event, which the client must drop, then breaks after three.
            if first and n == 3:
                context.abort_with_status(to_status(FabricUnavailableError("stream lost")))
            yield fm.WatchEventsResponse(event=event_to_wire(event))
            if first and n == 1:
                yield fm.WatchEventsResponse(event=event_to_wire(event))
        self.watch_started.set()
        if self.failures < 0:  # a stream that stays open until the client cancels it (at most 10 s)
            self.watch_cancelled.wait(10)


class DecomposesThenLosesTheAnswer(Flaky):
    """Decomposes on the real composer, and loses the first answer on the way back."""

    def __init__(self, composer: FabricComposer) -> None:
        super().__init__(composer, failures=1)

    def Decompose(self, request: fm.DecomposeRequest, context: grpc.ServicerContext) -> fm.DecomposeResponse:  # noqa: N802
        self.composer.decompose(request.id)
        return super().Decompose(request, context)


@pytest.fixture
def composer() -> Iterator[FabricComposer]:
    comp = build_composer()
    yield comp
    comp.close()


@pytest.fixture
def serve(tmp_path: Path, composer: FabricComposer) -> Iterator[Any]:
    servers: list[grpc.Server] = []

    def start(servicer: Flaky | None = None) -> tuple[Flaky, str]:
        servicer = servicer or Flaky(composer)
        server = grpc.server(futures.ThreadPoolExecutor(4))
        fm_grpc.add_FabricManagerServiceServicer_to_server(servicer, server)
        address = f"unix:{tmp_path}/fm{len(servers)}.sock"
        server.add_insecure_port(address)
        server.start()
        servers.append(server)
        return servicer, address

    yield start
    for server in servers:
        server.stop(None)


class TestRetryPolicy:
    """Pauses grow exponentially up to a cap, are jittered below it, and nonsense settings are refused."""

    def test_caps(self) -> None:
        policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0)
        assert [policy.backoff_cap(n) for n in (1, 2, 3, 4, 5, 6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]

    def test_a_cap_past_a_floats_range_is_the_longest_backoff(self) -> None:
        """``multiplier ** (n - 1)`` raised OverflowError from attempt 1,025 on (2.0 by default): a watch given many
        attempts to outlive a long outage ended with it after some 17 minutes of failed reopens."""
        policy = RetryPolicy(max_attempts=10_000)
        assert [policy.backoff_cap(n) for n in (1_024, 1_025, 10_000)] == [2.0, 2.0, 2.0]

    def test_a_watch_and_a_call_past_a_floats_range_keep_retrying(self, tmp_path: Path) -> None:
        """The same, quickly: a multiplier whose third power overflows ended the call and the watch with a bare
        OverflowError at their third failure, rather than their last error once the attempts were spent."""
        retries = RetryPolicy(max_attempts=6, initial_backoff_s=0.001, max_backoff_s=0.01, multiplier=1e200)
        with FabricManagerClient(f"unix:{tmp_path}/nobody.sock", timeout_s=10, retries=retries) as client:
            with pytest.raises(FabricUnavailableError, match="cannot reach"):
                client.compositions()
            with pytest.raises(FabricUnavailableError, match="cannot reach"), client.watch() as events:
                next(events)

    def test_jitter_stays_below_the_cap(self) -> None:
        policy = RetryPolicy()
        rng = random.Random(7)
        pauses = [policy.backoff(3, rng) for _ in range(200)]
        assert all(0 <= p <= policy.backoff_cap(3) for p in pauses)
        assert len(set(pauses)) > 100

    @pytest.mark.parametrize(
        "kwargs", [{"max_attempts": 0}, {"initial_backoff_s": 0}, {"multiplier": -1}, {"max_retry_delay_s": -1}]
    )
    def test_refuses_nonsense(self, kwargs: dict[str, float]) -> None:
        with pytest.raises(InvalidRequestError):
            RetryPolicy(**kwargs)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"max_attempts": "3"},
            {"max_attempts": 2.5},
            {"max_attempts": True},
            {"max_attempts": None},
            {"initial_backoff_s": "0.1"},
            {"initial_backoff_s": math.nan},
            {"max_backoff_s": math.inf},
            {"max_backoff_s": False},
            {"multiplier": "2"},
            {"multiplier": math.nan},
            {"max_retry_delay_s": math.nan},
            {"max_retry_delay_s": math.inf},
            {"max_retry_delay_s": "10"},
        ],
    )
    def test_a_setting_of_the_wrong_type_or_no_number_is_refused_naming_it(self, kwargs: dict[str, object]) -> None:
        """A string, a fraction of an attempt, a bool or NaN was taken (NaN made every pause NaN, which
        ``time.sleep`` refuses mid-call), or refused with a bare TypeError from a comparison."""
        (name,) = kwargs
        with pytest.raises(InvalidRequestError) as info:
            RetryPolicy(**kwargs)  # type: ignore[arg-type]
        assert info.value.field == name and name in info.value.message


class TestCallWithRetry:
    """`call_with_retry` repeats only what may be retried, only when allowed, and never sleeps past the deadline."""

    def _run(self, errors: list[grpc.StatusCode], **kwargs: Any) -> tuple[int, list[float]]:
        attempts: list[float] = []
        sleeps: list[float] = []

        def attempt(remaining: float) -> str:
            attempts.append(remaining)
            if len(attempts) <= len(errors):
                raise FakeRpcError(errors[len(attempts) - 1])
            return "ok"

        options: dict[str, Any] = {"policy": FAST, "retryable": True, "timeout_s": 5.0, "sleep": sleeps.append}
        options.update(kwargs)
        with contextlib.suppress(FakeRpcError):
            call_with_retry(attempt, **options)
        return len(attempts), sleeps

    def test_unavailable_is_retried(self) -> None:
        attempts, sleeps = self._run([grpc.StatusCode.UNAVAILABLE] * 2)
        assert attempts == 3 and len(sleeps) == 2

    def test_attempts_are_bounded(self) -> None:
        attempts, sleeps = self._run([grpc.StatusCode.UNAVAILABLE] * 10)
        assert attempts == FAST.max_attempts and len(sleeps) == FAST.max_attempts - 1

    def test_until_the_deadline_the_attempts_are_not_counted(self) -> None:
        """A client of several replicas: one that just lost the lead answers UNAVAILABLE at once for a while."""
        attempts, sleeps = self._run([grpc.StatusCode.UNAVAILABLE] * 10, until_deadline=lambda exc: True)
        assert attempts == 11 and len(sleeps) == 10

    def test_only_the_failures_said_so_are_not_counted(self) -> None:
        """A driver that cannot be reached is the leader's own answer, which another replica would give too: it
        counts as an attempt, where a replica that does not serve does not."""
        failures = [grpc.StatusCode.UNAVAILABLE] * 10
        elsewhere = iter([True, True, True, False, False, False, False, False, False, False])
        attempts, _ = self._run(failures, until_deadline=lambda exc: next(elsewhere))
        assert attempts == 3 + FAST.max_attempts

    @pytest.mark.parametrize(
        "code",
        [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL],
    )
    def test_other_codes_are_not(self, code: grpc.StatusCode) -> None:
        assert self._run([code]) == (1, [])

    def test_unsafe_calls_get_one_attempt(self) -> None:
        assert self._run([grpc.StatusCode.UNAVAILABLE], retryable=False) == (1, [])

    def test_no_pause_runs_past_the_deadline(self) -> None:
        now = [0.0]
        slow = RetryPolicy(max_attempts=100, initial_backoff_s=0.5, max_backoff_s=0.5)

        def sleep(s: float) -> None:
            now[0] += s

        attempts, _ = self._run(
            [grpc.StatusCode.UNAVAILABLE] * 100,
            policy=slow,
            timeout_s=2.0,
            clock=lambda: now[0],
            sleep=sleep,
            rng=random.Random(1),
        )
        assert 1 < attempts < 100 and now[0] < 2.0


class TestRetriesOverGrpc:
    """Against a server that loses the first answers: safe calls succeed on a later attempt, others fail."""

    def test_reads_are_retried(self, serve: Any) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client:
            assert client.topologies() == []
        assert servicer.calls["GetTopology"] == 3

    def test_attempts_are_bounded(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Flaky(composer, failures=100))
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(FabricUnavailableError):
            client.topologies()
        assert servicer.calls["GetTopology"] == FAST.max_attempts

    def test_decompose_is_retried(self, serve: Any, composer: FabricComposer) -> None:
        comp = composer.compose(parse_request("job", ["gpu x1"])).composition
        assert comp is not None
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client:
            client.decompose(comp.id)
        assert servicer.calls["Decompose"] == 3

    def test_decompose_of_an_unknown_composition_sends_none(self, serve: Any) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client:
            client.decompose("c-1")
        assert "Decompose" not in servicer.calls

    def test_a_decompose_by_name_retried_decomposes_only_the_composition_named_at_the_call(
        self, serve: Any, composer: FabricComposer
    ) -> None:
        """Its first answer lost, the retry went by name again: had another client composed a new composition
        under that name meanwhile, the retry decomposed that one too."""
        asked = composer.compose(parse_request("job", ["gpu x1"])).composition
        assert asked is not None
        servicer, address = serve(DecomposesThenLosesTheAnswer(composer))
        remade = []
        with FabricManagerClient(address, retries=FAST) as client:
            client._sleep = lambda _: remade.append(composer.compose(parse_request("job", ["gpu x1"])).composition)
            client.decompose("job")
        assert servicer.calls["Decompose"] == 2 and len(remade) == 1
        assert [c.id for c in composer.compositions()] == [remade[0].id]

    def test_reservation_calls_are_retried(self, serve: Any) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client:
            client.release_reservation("r-1")
            assert client.reservations_at() == ([], 7)
        assert servicer.calls["ReleaseReservation"] == 3 and servicer.calls["ListReservations"] == 3

    def test_recompose_gets_a_request_id_and_changes_once(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve()
        comp = composer.compose(parse_request("job", ["gpu x1"])).composition
        assert comp is not None
        with FabricManagerClient(address, retries=FAST) as client:
            grown = client.recompose("job", add=[parse_resource("gpu x1")])
        assert servicer.calls["UpdateComposition"] == 3
        assert len(set(servicer.update_ids)) == 1 and len(servicer.update_ids[0]) >= 16
        assert grown == composer.get(comp.id) and len(grown.devices) == 2
        assert len(hardware_bindings(composer.fabrics)) == 2
        updated = [e for e in composer.events() if e.type is EventType.COMPOSITION_UPDATED]
        assert len(updated) == 1

    def test_given_recompose_request_id_is_sent(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve()
        composer.compose(parse_request("job", ["gpu x1"]))
        with FabricManagerClient(address, retries=FAST) as client:
            client.recompose("job", add=[parse_resource("gpu x1")], request_id="grow-1")
        assert servicer.update_ids == ["grow-1"] * 3

    def test_recompose_without_request_id_is_not_retried(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve()
        comp = composer.compose(parse_request("job", ["gpu x1"])).composition
        assert comp is not None
        add = [ResourceRequest(parse_request("x", ["gpu"]).resources[0].kind, count=1)]
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(FabricUnavailableError):
            client.recompose("job", add=add, request_id="")
        assert servicer.calls["UpdateComposition"] == 1 and servicer.update_ids == [""]
        assert len(composer.get(comp.id).devices) == 2  # the lost answer's change: exactly once, never twice

    def test_errors_other_than_unavailable_are_not(self, serve: Any) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(NotFoundError):
            client.get("nothing")
        assert servicer.calls["GetComposition"] == 1

    def test_apply_gets_a_request_id_and_binds_once(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve()
        request = parse_request("job", ["gpu x2 model=H200"])
        with FabricManagerClient(address, retries=FAST) as client:
            result = client.compose(request)
        assert servicer.calls["Compose"] == 3
        assert len(set(servicer.request_ids)) == 1 and len(servicer.request_ids[0]) >= 16
        assert result.composition is not None and result.composition.name == "job"
        assert [c.id for c in composer.compositions()] == [result.composition.id]
        assert len(hardware_bindings(composer.fabrics)) == 2
        created = [e for e in composer.events() if e.type is EventType.COMPOSITION_CREATED]
        assert len(created) == 1

    def test_given_request_id_is_sent(self, serve: Any) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client:
            client.compose(parse_request("job", ["gpu"]), ComposeMode.APPLY, request_id="job-attempt-1")
        assert servicer.request_ids == ["job-attempt-1"] * 3

    def test_apply_without_request_id_is_not_retried(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(FabricUnavailableError):
            client.compose(parse_request("job", ["gpu"]), request_id="")
        assert servicer.request_ids == [""]
        assert len(composer.compositions()) == 1  # the lost answer's composition: exactly one, never two

    def test_preview_is_retried_without_request_id(self, serve: Any) -> None:
        servicer, address = serve()
        with FabricManagerClient(address, retries=FAST) as client:
            result = client.compose(parse_request("job", ["gpu"]), ComposeMode.PREVIEW)
        assert result.composition is None and result.plan.devices
        assert servicer.request_ids == ["", "", ""]


class TestNotSent:
    """A change no attempt of which left the client (no connection to the server could be made) was not made, and
    the error says so; it said an attempt got no answer, so the change may have been made."""

    NOT_MADE = "nothing was sent, so the change was not made"

    def changes(self, client: FabricManagerClient) -> list[Callable[[], object]]:
        """A reservation and its apply, each with a request id, so retried."""
        return [
            lambda: client.compose(parse_request("job", ["gpu"]), ComposeMode.RESERVE, request_id="job-1"),
            lambda: client.apply_reservation("r-000000000000", request_id="apply-1"),
        ]

    def test_no_socket_file(self, tmp_path: Path) -> None:
        client = FabricManagerClient(f"unix:{tmp_path}/nobody.sock", timeout_s=5, retries=FAST)
        with client:
            for change in self.changes(client):
                with pytest.raises(FabricUnavailableError) as info:
                    change()
                assert "may have been made" not in info.value.message
                assert info.value.message.endswith(self.NOT_MADE) and "cannot reach" in info.value.message
                assert info.value.metadata["request_id"] in ("job-1", "apply-1")

    def test_a_socket_nobody_listens_on(self, tmp_path: Path) -> None:
        """The socket file is left by a server that is gone: the connection is refused."""
        path = tmp_path / "gone.sock"
        with socket.socket(socket.AF_UNIX) as left:
            left.bind(str(path))
        client = FabricManagerClient(f"unix:{path}", timeout_s=5, retries=FAST)
        with client, pytest.raises(FabricUnavailableError, match=self.NOT_MADE):
            self.changes(client)[0]()

    def test_an_attempt_that_was_sent_keeps_the_outcome_unknown(self, tmp_path: Path) -> None:
        """The first attempt lost its connection after it was sent; the retries could not connect. The first
        may have been made."""
        client = FabricManagerClient(f"unix:{tmp_path}/nobody.sock", timeout_s=5, retries=FAST)
        errors = iter(
            [
                FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"),
                *[FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: ...")]
                * 10,
            ]
        )

        def rpc(timeout: float) -> None:
            raise next(errors)

        with client, pytest.raises(FabricUnavailableError) as info:
            client._call(rpc, idempotent=True, request_id="K1")
        assert "may have been made" in info.value.message and self.NOT_MADE not in info.value.message

    def test_a_refusal_that_settles_nothing_keeps_the_outcome_unknown(self, tmp_path: Path) -> None:
        """The first attempt lost its connection after it was sent; the retries were refused as OVERLOADED, which a
        server answers before it looks the request id up: the first may have been made all the same. The error
        keeps what it carries: rebuilt from its class, message and metadata, its retry_delay_s was None."""
        client = FabricManagerClient(f"unix:{tmp_path}/nobody.sock", timeout_s=5, retries=FAST)
        overloaded = to_status(
            OverloadedError("the fabric manager is at its limit of concurrent work; retry later", retry_delay_s=0.01)
        )
        errors = iter(
            [
                FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"),
                *[ServerRpcError(overloaded.code, overloaded.details, overloaded.trailing_metadata)] * 10,
            ]
        )

        def rpc(timeout: float) -> None:
            raise next(errors)

        with client, pytest.raises(OverloadedError) as info:
            client._call(rpc, idempotent=True, request_id="K1")
        assert "may have been made" in info.value.message and info.value.metadata["request_id"] == "K1"
        assert info.value.retry_delay_s == 0.01

    def test_a_channel_passed_in_is_not_judged(self, tmp_path: Path) -> None:
        """A channel passed in may carry a service config whose retries fail a sent call with the same message:
        then the outcome stays unknown."""
        address = f"unix:{tmp_path}/nobody.sock"
        client = FabricManagerClient(address, timeout_s=5, retries=FAST, channel=grpc.insecure_channel(address))
        with client, pytest.raises(FabricUnavailableError, match="may have been made"):
            self.changes(client)[0]()


class TestWatchResumption:
    """A watch broken by UNAVAILABLE reopens from the last revision seen: nothing lost, nothing repeated."""

    def test_resumes(self, serve: Any, composer: FabricComposer) -> None:
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
            composer.decompose(f"j{n}")
        total = len(composer.events())
        assert total >= 6
        servicer, address = serve(Flaky(composer, failures=0))
        with FabricManagerClient(address, retries=FAST) as client:
            stream = client.watch()
            revisions = [next(stream).revision for _ in range(total)]
            stream.close()
        assert revisions == list(range(1, total + 1))
        assert servicer.watch_requests == [0, 3]

    def test_close_ends_the_pause_before_a_reopen(self, serve: Any, composer: FabricComposer) -> None:
        """`EventStream.close` from another thread, while the watch paused to reopen, ended iteration only once
        the pause was over: up to ``max_backoff_s``, here 20 s."""
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
        _, address = serve(Flaky(composer, failures=0))  # its first stream breaks after three events
        patient = RetryPolicy(max_attempts=3, initial_backoff_s=20.0, max_backoff_s=20.0)
        with FabricManagerClient(address, retries=patient) as client:
            client._rng = Longest()
            stream = client.watch()
            assert [next(stream).revision for _ in range(3)] == [1, 2, 3]
            closer = threading.Timer(0.5, stream.close)
            closer.start()
            started = time.monotonic()
            assert list(stream) == []
            assert time.monotonic() - started < 5.0

    def test_the_pause_before_a_reopen_is_the_clients(self, serve: Any, composer: FabricComposer) -> None:
        """The pause before a reopen goes through the client's pause (``_sleep``), as a call's pause between
        attempts does: it bypassed it, so a test that replaced the pause waited the real one."""
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
        _, address = serve(Flaky(composer, failures=0))  # its first stream breaks after three events
        patient = RetryPolicy(max_attempts=3, initial_backoff_s=20.0, max_backoff_s=20.0)
        paused: list[float] = []
        with FabricManagerClient(address, retries=patient) as client:
            client._rng = Longest()
            client._sleep = lambda seconds, **_: paused.append(seconds)
            stream = client.watch()
            started = time.monotonic()
            assert [next(stream).revision for _ in range(4)] == [1, 2, 3, 4]
            stream.close()
            assert time.monotonic() - started < 5.0
        assert paused == [20.0]

    def test_close_cancels_the_stream(self, serve: Any, composer: FabricComposer) -> None:
        composer.compose(parse_request("j", ["gpu"]))
        total = len(composer.events())
        servicer, address = serve(Flaky(composer, failures=-1))
        with FabricManagerClient(address, retries=FAST) as client:
            stream = client.watch(after_revision=total - 1)
            seen: list[int] = []
            first = threading.Event()

            def consume() -> None:
                for event in stream:
                    seen.append(event.revision)
                    first.set()

            reader = threading.Thread(target=consume)
            reader.start()
            assert first.wait(10) and servicer.watch_started.wait(10)
            stream.close()
            reader.join(10)
            assert not reader.is_alive()
        assert seen == [total]
        assert servicer.watch_cancelled.wait(10)


class Longest(random.Random):
    """Pauses as long as the policy allows, every time."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Stalling(Flaky):
    """Holds each GetTopology and Compose until released (at most 10 s), so that a test can close the client
    meanwhile."""

    def __init__(self, composer: FabricComposer) -> None:
        super().__init__(composer, failures=0)
        self.arrived = threading.Event()
        self.release = threading.Event()

    def GetTopology(self, request: fm.GetTopologyRequest, context: grpc.ServicerContext) -> fm.GetTopologyResponse:  # noqa: N802
        self.arrived.set()
        self.release.wait(10)
        return fm.GetTopologyResponse()

    def Compose(self, request: fm.ComposeRequest, context: grpc.ServicerContext) -> fm.ComposeResponse:  # noqa: N802
        self.arrived.set()
        self.release.wait(10)
        return super().Compose(request, context)


class TestCloseDuringACall:
    """A client closed from another thread while a call pauses between attempts or waits for an answer refuses
    the call with `FabricUnavailableError` (as a call on a closed client is), never gRPC's ``ValueError``."""

    @staticmethod
    def close_in_the_pause(client: FabricManagerClient) -> None:
        """Make the client's first pause between attempts close it from another thread."""

        def pause(seconds: float) -> None:
            closer = threading.Thread(target=client.close)
            closer.start()
            closer.join(10)

        client._sleep = pause

    def test_read_closed_during_a_pause(self, tmp_path: Path) -> None:
        client = FabricManagerClient(f"unix:{tmp_path}/nobody.sock", retries=FAST)
        self.close_in_the_pause(client)
        with pytest.raises(FabricUnavailableError, match="is closed"):
            client.compositions()

    def test_change_closed_during_a_pause_names_its_request_id(self, serve: Any) -> None:
        servicer, address = serve(Flaky(build_composer(), failures=1))
        client = FabricManagerClient(address, retries=FAST)
        self.close_in_the_pause(client)
        with pytest.raises(FabricUnavailableError, match="is closed") as info:
            client.compose(parse_request("job", ["gpu"]), request_id="job-1")
        assert info.value.metadata["request_id"] == "job-1"
        assert servicer.request_ids == ["job-1"]

    def test_call_in_flight(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Stalling(composer))
        client = FabricManagerClient(address, retries=FAST)
        with futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.topologies)
            assert servicer.arrived.wait(10)
            client.close()
            servicer.release.set()
            with pytest.raises(FabricUnavailableError, match="is closed"):
                call.result(10)

    def test_change_in_flight_may_have_been_made(self, serve: Any, composer: FabricComposer) -> None:
        """The server may have taken the change before the close cancelled it: the error says how to learn its
        outcome."""
        servicer, address = serve(Stalling(composer))
        client = FabricManagerClient(address, retries=FAST)
        with futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.compose, parse_request("job", ["gpu"]), request_id="job-1")
            assert servicer.arrived.wait(10)
            client.close()
            servicer.release.set()
            with pytest.raises(FabricUnavailableError, match=r"is closed.*may have been made") as info:
                call.result(10)
        assert info.value.metadata["request_id"] == "job-1"

    def test_watch_opened_as_the_client_closes(self, serve: Any) -> None:
        _, address = serve()
        client = FabricManagerClient(address, retries=FAST)
        open_stream = client._stub.WatchEvents

        def closing(request: fm.WatchEventsRequest) -> Any:
            client.close()  # after the client's check that it is open, before the call
            return open_stream(request)

        client._stub.WatchEvents = closing  # type: ignore[method-assign]
        with pytest.raises(FabricUnavailableError, match="is closed"):
            client.watch()


def refusal(error: DisaggError, retry_delay_s: float | None = None) -> grpc.Status:
    """The status a server ends a call with for ``error``, with a ``google.rpc.RetryInfo`` when given a delay."""
    status = to_status(error)
    if retry_delay_s is None:
        return status
    rich = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromTimedelta(timedelta(seconds=retry_delay_s))
    rich.details.add().Pack(info)
    with_delay: grpc.Status = rpc_status.to_status(rich)
    return with_delay


class Refusing(Flaky):
    """Answers GetTopology with each of ``refusals`` in turn, then answers; the first WatchEvents breaks off
    (`Flaky`), the second is refused with each of ``watch_refusals`` in turn."""

    def __init__(
        self, composer: FabricComposer, refusals: list[grpc.Status], watch_refusals: list[grpc.Status] = ()
    ) -> None:
        super().__init__(composer, failures=0)
        self.refusals = list(refusals)
        self.watch_refusals = list(watch_refusals)
        self.times: list[float] = []

    def GetTopology(self, request: fm.GetTopologyRequest, context: grpc.ServicerContext) -> fm.GetTopologyResponse:  # noqa: N802
        self.times.append(time.monotonic())
        if self.refusals:
            context.abort_with_status(self.refusals.pop(0))
        return fm.GetTopologyResponse()

    def WatchEvents(  # noqa: N802
        self, request: fm.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[fm.WatchEventsResponse]:
        if self.watch_requests and self.watch_refusals:
            self.watch_requests.append(request.after_revision)
            context.abort_with_status(self.watch_refusals.pop(0))
        yield from super().WatchEvents(request, context)


class TestTheServersRetryableMark:
    """The client retries what the server marks retryable (its reason's ``retryable``), not every UNAVAILABLE,
    and a refusal for load (OVERLOADED) too, within the call's deadline; never a refusal no retry can change."""

    def test_an_unavailable_marked_not_retryable_gets_one_attempt(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Refusing(composer, [refusal(LedgerNotFencedError("never fenced"))] * 10))
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(LedgerNotFencedError):
            client.topologies()
        assert len(servicer.times) == 1

    def test_overloaded_is_retried(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Refusing(composer, [refusal(OverloadedError("too many watches"))] * 2))
        with FabricManagerClient(address, retries=FAST) as client:
            assert client.topologies() == []
        assert len(servicer.times) == 3

    def test_overloaded_attempts_are_bounded(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Refusing(composer, [refusal(OverloadedError("too many watches"))] * 10))
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(OverloadedError):
            client.topologies()
        assert len(servicer.times) == FAST.max_attempts

    @pytest.mark.parametrize("error", [CapacityExhaustedError("the last free device"), NoFitError("no host")])
    def test_exhausted_capacity_is_not_retried(self, serve: Any, composer: FabricComposer, error: DisaggError) -> None:
        servicer, address = serve(Refusing(composer, [refusal(error)] * 10))
        with FabricManagerClient(address, retries=FAST) as client, pytest.raises(type(error)):
            client.topologies()
        assert len(servicer.times) == 1

    def test_the_servers_retry_delay_is_waited(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Refusing(composer, [refusal(OverloadedError("busy"), retry_delay_s=0.3)]))
        with FabricManagerClient(address, retries=FAST) as client:
            assert client.topologies() == []
        assert len(servicer.times) == 2 and servicer.times[1] - servicer.times[0] >= 0.3

    def test_a_retry_delay_past_the_deadline_ends_the_call_at_once(self, serve: Any, composer: FabricComposer) -> None:
        servicer, address = serve(Refusing(composer, [refusal(OverloadedError("busy"), retry_delay_s=60)]))
        started = time.monotonic()
        with FabricManagerClient(address, timeout_s=5, retries=FAST) as client, pytest.raises(OverloadedError):
            client.topologies()
        assert len(servicer.times) == 1 and time.monotonic() - started < 2.5

    def test_a_watch_reopen_that_meets_the_limit_of_watches_tries_again(
        self, serve: Any, composer: FabricComposer
    ) -> None:
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
            composer.decompose(f"j{n}")
        total = len(composer.events())
        overloaded = refusal(OverloadedError("at most 16 watches are served at once"))
        servicer, address = serve(Refusing(composer, [], watch_refusals=[overloaded, overloaded]))
        with FabricManagerClient(address, retries=FAST) as client:
            stream = client.watch()
            revisions = [next(stream).revision for _ in range(total)]
            stream.close()
        assert revisions == list(range(1, total + 1))
        assert servicer.watch_requests == [0, 3, 3, 3]


def delayed(error: DisaggError, seconds: int, nanos: int = 0) -> grpc.Status:
    """``error``'s status with a ``google.rpc.RetryInfo`` of ``seconds`` and ``nanos`` as given, even ones no valid
    duration holds (negative, nanos out of range, seconds past what a ``timedelta`` holds)."""
    status = to_status(error)
    rich = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    info.retry_delay.seconds, info.retry_delay.nanos = seconds, nanos
    rich.details.add().Pack(info)
    with_delay: grpc.Status = rpc_status.to_status(rich)
    return with_delay


THREE_DAYS = 3 * 24 * 3600
MALFORMED_DELAYS = [
    pytest.param(-5, 0, id="negative"),
    pytest.param(0, -1, id="negative-nanos"),
    pytest.param(1, 2_000_000_000, id="nanos-out-of-range"),
    pytest.param(1 << 62, 0, id="past-a-duration"),
]


class TestTheServersRetryDelayIsBounded:
    """The delay a server's ``RetryInfo`` asks for is waited at most the policy's ``max_retry_delay_s``: a server
    (or a bug, or a man in the middle) that said "retry in 3 days" stalled a watch's reopen for 3 days, and a call
    whose deadline is further off as long. One that is no delay (negative, out of range) is not taken: the policy's
    own backoff is."""

    def test_a_watch_reopen_waits_at_most_the_policys_bound(self, serve: Any, composer: FabricComposer) -> None:
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
        total = len(composer.events())
        three_days = refusal(OverloadedError("busy"), retry_delay_s=THREE_DAYS)
        servicer, address = serve(Refusing(composer, [], watch_refusals=[three_days]))
        bounded = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01, max_retry_delay_s=0.3)
        started = time.monotonic()
        with FabricManagerClient(address, retries=bounded) as client:
            stream = client.watch()
            revisions = [next(stream).revision for _ in range(total)]
            stream.close()
        assert revisions == list(range(1, total + 1))
        assert servicer.watch_requests == [0, 3, 3]
        assert 0.3 <= time.monotonic() - started < 5.0

    def test_by_default_a_watch_reopen_waits_at_most_10_s(self, serve: Any, composer: FabricComposer) -> None:
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
        total = len(composer.events())
        three_days = refusal(OverloadedError("busy"), retry_delay_s=THREE_DAYS)
        _, address = serve(Refusing(composer, [], watch_refusals=[three_days]))
        paused: list[float] = []
        with FabricManagerClient(address) as client:
            client._rng = Longest()
            client._sleep = lambda seconds, **_: paused.append(seconds)
            stream = client.watch()
            assert [next(stream).revision for _ in range(total)] == list(range(1, total + 1))
            stream.close()
        assert RetryPolicy().max_retry_delay_s == 10.0
        assert paused == [RetryPolicy().backoff_cap(1), 10.0]  # the break (UNAVAILABLE), then the refusal

    def test_a_call_whose_deadline_is_a_year_off_waits_at_most_the_policys_bound(
        self, serve: Any, composer: FabricComposer
    ) -> None:
        servicer, address = serve(Refusing(composer, [refusal(OverloadedError("busy"), retry_delay_s=THREE_DAYS)]))
        bounded = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01, max_retry_delay_s=0.3)
        with FabricManagerClient(address, timeout_s=MAX_TIMEOUT_S, retries=bounded) as client:
            assert client.topologies() == []
        assert len(servicer.times) == 2 and 0.3 <= servicer.times[1] - servicer.times[0] < 5.0

    @pytest.mark.parametrize(("seconds", "nanos"), MALFORMED_DELAYS)
    def test_a_delay_that_is_none_gets_the_policys_backoff(
        self, serve: Any, composer: FabricComposer, seconds: int, nanos: int
    ) -> None:
        """A negative delay was taken as 0 (an attempt at once), and one past what a ``timedelta`` holds raised a
        bare OverflowError out of the call."""
        servicer, address = serve(Refusing(composer, [delayed(OverloadedError("busy"), seconds, nanos)]))
        paused: list[float] = []
        with FabricManagerClient(address, retries=FAST) as client:
            client._rng = Longest()
            client._sleep = lambda seconds, **_: paused.append(seconds)
            assert client.topologies() == []
        assert len(servicer.times) == 2 and paused == [FAST.backoff_cap(1)]

    @pytest.mark.parametrize(("seconds", "nanos"), MALFORMED_DELAYS)
    def test_a_refusal_whose_delay_is_none_says_it_asked_none(
        self, serve: Any, composer: FabricComposer, seconds: int, nanos: int
    ) -> None:
        _, address = serve(Refusing(composer, [delayed(OverloadedError("busy"), seconds, nanos)]))
        with FabricManagerClient(address, retries=NO_RETRY) as client, pytest.raises(OverloadedError) as info:
            client.topologies()
        assert info.value.retry_delay_s is None

    def test_a_watch_reopen_refused_with_a_delay_past_a_duration_gets_the_policys_backoff(
        self, serve: Any, composer: FabricComposer
    ) -> None:
        for n in range(3):
            composer.compose(parse_request(f"j{n}", ["gpu"]))
        total = len(composer.events())
        servicer, address = serve(Refusing(composer, [], watch_refusals=[delayed(OverloadedError("busy"), 1 << 62)]))
        with FabricManagerClient(address, retries=FAST) as client:
            stream = client.watch()
            assert [next(stream).revision for _ in range(total)] == list(range(1, total + 1))
            stream.close()
        assert servicer.watch_requests == [0, 3, 3]


class Peers(Flaky):
    """Records the peer (the client's end of the connection) of each GetTopology."""

    def __init__(self, composer: FabricComposer) -> None:
        super().__init__(composer, failures=-1)
        self.peers: list[str] = []

    def GetTopology(self, request: fm.GetTopologyRequest, context: grpc.ServicerContext) -> fm.GetTopologyResponse:  # noqa: N802
        self.peers.append(context.peer())
        return fm.GetTopologyResponse()


@contextlib.contextmanager
def default_policy_server(servicer: Flaky) -> Iterator[str]:
    """A grpcio server with gRPC's default ping policy (pings 5 minutes apart, none without a call, two strikes),
    as a server or proxy not set up for the fabric manager has, on TCP so that each connection has its own peer."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    fm_grpc.add_FabricManagerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


STRIKES_S = 7.5
"""Longer than three of the client's pings 2 s apart: a default-policy server closes the connection at the third
(GOAWAY too_many_pings)."""


class TestPingsAgainstAServerOfDefaultPolicy:
    """The client pings only while a call is open, and ``keepalive_s=None`` not at all: a server or proxy of gRPC's
    default ping policy closed the connection of a client that pinged every 2 s with nothing open."""

    def test_an_idle_connection_is_kept(self, composer: FabricComposer) -> None:
        servicer = Peers(composer)
        with default_policy_server(servicer) as address, FabricManagerClient(address, retries=FAST) as client:
            client.topologies()
            time.sleep(STRIKES_S)
            client.topologies()
        assert len(servicer.peers) == 2 and servicer.peers[0] == servicer.peers[1]

    def test_without_pings_a_silent_watch_is_kept(self, composer: FabricComposer) -> None:
        servicer = Peers(composer)
        with (
            default_policy_server(servicer) as address,
            FabricManagerClient(address, retries=FAST, keepalive_s=None) as client,
            client.watch(),
        ):
            assert servicer.watch_started.wait(10)
            time.sleep(STRIKES_S)
            assert not servicer.watch_cancelled.is_set()
