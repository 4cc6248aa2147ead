"""A client given several replicas sends only to the one that reports SERVING, and follows the lead when it
moves; a list of replicas that gRPC cannot resolve is refused with a clear error."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from composer_helpers import rack
from disagg.client import NO_RETRY, FabricManagerClient, RetryPolicy
from disagg.client.replicas import SERVICE_CONFIG, replica_target
from disagg.composer import FabricComposer
from disagg.errors import (
    NOT_SERVING,
    SERVING,
    DeadlineExceededError,
    FabricUnavailableError,
    InvalidRequestError,
    answered_not_serving,
)
from disagg.requestlang import parse_request
from disagg.server import FabricManagerServer
from disagg.store import MemoryStore
from process_helpers import ChildOutput
from server_helpers import WAIT_S, replicas, set_serving, slow_rack


class TestReplicaTarget:
    """One address is used as it is; a list of IP:PORT becomes a health-checked round robin."""

    def test_one_address(self) -> None:
        assert replica_target("unix:/run/disagg.sock") == ("unix:/run/disagg.sock", ())
        assert replica_target("unix:///run/disagg.sock") == ("unix:///run/disagg.sock", ())
        assert replica_target("[::1]:50051") == ("[::1]:50051", ())
        assert replica_target("unix-abstract:disagg") == ("unix-abstract:disagg", ())  # was "a port is 0 to 65535"
        assert replica_target("127.0.0.1:50051") == ("127.0.0.1:50051", ())
        assert replica_target("dns:///fm.example:50051") == ("dns:///fm.example:50051", ())
        assert replica_target("DNS:///127.0.0.1:50051") == ("DNS:///127.0.0.1:50051", ())  # gRPC takes any case

    def test_a_list(self) -> None:
        assert replica_target("127.0.0.1:1, 127.0.0.2:2") == (
            "ipv4:127.0.0.1:1,127.0.0.2:2",
            (("grpc.service_config", SERVICE_CONFIG),),
        )
        assert replica_target("[::1]:1,[::1]:2")[0] == "ipv6:[::1]:1,[::1]:2"

    @pytest.mark.parametrize(
        ("address", "says"),
        [
            ("fm-a:50051,fm-b:50051", "literal addresses"),
            ("127.0.0.1:1,127.0.0.1", "literal addresses"),
            ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
            ("127.0.0.1:99999", "a port is 0 to 65535"),
            ("127.0.0.1:1,127.0.0.1:65536", "literal addresses"),
            ("unix://tmp/fm.sock", "unix:/absolute/path"),
            ("unix:", "unix:/absolute/path"),
            ("unix:/run/q?x=1.sock", "as URI syntax"),  # was "cannot reach" /run/q (exit 1)
            ("unix:/run/h#f.sock", "as URI syntax"),
            ("unix:/run/f%41.sock", "as URI syntax"),  # reached /run/fA.sock, another server's
            (":50051", "give HOST:PORT"),
            ("[::1", "IPv6 host in brackets"),
            ("h]:1", "IPv6 host in brackets"),
            ("::1:50051", "IPv6 host in brackets"),  # gRPC reads it as a misformatted name: "cannot reach"
            ("http://127.0.0.1:50051", "not a URL"),  # "cannot reach": gRPC looked the whole URL up as a name
            ("grpc://fm.example:50051", "not a URL"),
            ("tcp://10.0.0.1:50051", "not a URL"),
        ],
    )
    def test_mistakes(self, address: str, says: str) -> None:
        with pytest.raises(InvalidRequestError, match=says):
            FabricManagerClient(address)

    @pytest.mark.parametrize(
        "address", ["127.0.0.1:²", "127.0.0.1:١٢٣", "10.0.0.1:²,10.0.0.2:1", "10.0.0.1:١٢٣,10.0.0.2:1"]
    )
    def test_a_port_in_other_digits(self, address: str) -> None:
        """`str.isdigit` took them: ``²`` then failed ``int`` with a bare ValueError, and ``١٢٣`` passed as port
        123 while gRPC was given the characters as written."""
        with pytest.raises(InvalidRequestError) as info:
            FabricManagerClient(address)
        assert info.value.field == "address"


class TestFollowTheLead:
    """Calls go to the serving replica only, and to the other once it serves and the first does not."""

    def test_calls_follow_serving(self) -> None:
        with replicas() as (a, b):
            set_serving(a, False)
            b.composer.compose(parse_request("on-b", ["gpu x1"]))
            a.composer.compose(parse_request("on-a", ["gpu x1"]))
            with FabricManagerClient(f"{a.addresses[0]},{b.addresses[0]}", timeout_s=5) as client:
                assert {c.name for _ in range(6) for c in client.compositions()} == {"on-b"}
                set_serving(b, False)
                set_serving(a, True)
                deadline = time.monotonic() + 5
                names: set[str] = set()
                while time.monotonic() < deadline and names != {"on-a"}:
                    names = {c.name for c in client.compositions()}
                    time.sleep(0.05)
                assert names == {"on-a"}


class GrantedLead:
    """A lead the test grants, as an election on etcd would once the leader's lease ran out."""

    key = ""
    create_revision = 0

    def __init__(self) -> None:
        self.granted = threading.Event()
        self.lost = threading.Event()

    def campaign(self, stopping: threading.Event) -> int:
        while not self.granted.wait(0.05):
            if stopping.is_set():
                return 0
        return 2

    def leading(self) -> bool:
        return self.granted.is_set() and not self.lost.is_set()

    def deposed(self, why: str) -> None:
        self.lost.set()

    def resign(self) -> None:
        self.lost.set()


PINGS_NOTICE_S = 6.0
"""Longer than a ping's interval and its timeout together (`KEEPALIVE_S` and `PING_TIMEOUT_S`: 2 s and 2 s)."""


class TestTakeover:
    """While no replica serves (the leader died and the standby waits for its lease to run out), a call waits
    for one up to its deadline instead of failing at once."""

    def test_a_list_spaced_after_its_commas(self, replicas: list[FabricManagerServer]) -> None:
        """`replica_target` takes it, and the CLI checks ``--server`` with it; the client refused it first, "is not a
        server address", not saying why."""
        with FabricManagerClient(f"{replicas[0].addresses[0]}, {replicas[1].addresses[0]}", timeout_s=5) as client:
            assert client.compositions() == []

    def test_a_call_waits_for_a_replica_to_serve(self, replicas: list[FabricManagerServer]) -> None:
        a, _ = replicas
        a.composer.compose(parse_request("on-a", ["gpu x1"]))
        for server in replicas:
            set_serving(server, False)
        # Longer than the default retries' pauses add up to (at most 1.5 s), as a takeover is.
        takeover = threading.Timer(3.0, set_serving, (a, True))
        with FabricManagerClient(",".join(s.addresses[0] for s in replicas), timeout_s=20) as client:
            started = time.monotonic()
            takeover.start()
            assert {c.name for c in client.compositions()} == {"on-a"}
            assert time.monotonic() - started >= 2.5

    def test_a_watch_follows_the_lead(self) -> None:
        """The standby takes the lead on the leader's ledger (here one in-memory ledger both are given, as two
        replicas share one etcd cluster): the watch resumes there with the next revisions, no gap and no
        duplicate (a ledger of its own would hold other events under the same revisions, and refuse it)."""
        ledger = MemoryStore()
        lead = GrantedLead()
        a = FabricManagerServer(FabricComposer(rack(), store=ledger), ["127.0.0.1:0"])
        b = FabricManagerServer(FabricComposer(rack(), store=ledger), ["127.0.0.1:0"], leadership=lead)
        a.start()
        b.start()
        try:
            a.composer.compose(parse_request("on-a", ["gpu x1"]))

            def takeover() -> None:
                a.stop(0)
                time.sleep(3.0)  # as long as a lease runs out, well past the default retries
                lead.granted.set()
                deadline = time.monotonic() + WAIT_S
                while not b.composer.compositions() and time.monotonic() < deadline:
                    time.sleep(0.05)  # started: it loaded the ledger
                for n in range(2):
                    b.composer.compose(parse_request(f"on-b-{n}", ["gpu x1"]))

            with FabricManagerClient(f"{a.addresses[0]},{b.addresses[0]}") as client, client.watch(0) as events:
                give_up = threading.Timer(30.0, events.close)  # a watch has no deadline: end it if it hangs
                give_up.start()
                try:
                    assert [e.revision for e in itertools.islice(events, 2)] == [1, 2]
                    threading.Thread(target=takeover, daemon=True).start()
                    after = [e.subject for e in itertools.islice(events, 4)]
                    assert [e.revision for e in ledger.events_after(2)][:4] == list(range(3, 7))
                    assert after == [e.subject for e in ledger.events_after(2)][:4]
                finally:
                    give_up.cancel()
        finally:
            a.stop(0)
            b.stop(0)

    def test_a_paused_replica_is_dropped(self, replicas: list[FabricManagerServer], tmp_path: Path) -> None:
        """A replica that stops answering without closing its connections (SIGSTOP, a hung host) still looked
        SERVING to the channel: every other call waited out its deadline there while another replica led. The
        client's pings drop it within a few seconds."""
        standby = replicas[0]
        set_serving(standby, False)
        paused = subprocess.Popen(
            [sys.executable, "-m", "disagg.cli.main", "serve", "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state"), "DISAGG_CONFIG": ""},
        )
        output = ChildOutput(paused)
        try:
            address = output.wait_ready(r"^serving on (\S+)", 60, "disagg serve").group(1)
            with FabricManagerClient(f"{address},{standby.addresses[0]}", timeout_s=3) as client:
                client.compositions()
                paused.send_signal(signal.SIGSTOP)
                set_serving(standby, True)
                time.sleep(PINGS_NOTICE_S)
                for _ in range(4):  # round robin would send every other one to the paused replica
                    client.compositions()
        finally:
            paused.send_signal(signal.SIGCONT)
            paused.kill()
            paused.wait(10)

    def test_no_replica_serves_within_the_deadline(self, replicas: list[FabricManagerServer]) -> None:
        set_serving(replicas[0], False)
        down = "127.0.0.1:1"  # nothing listens there
        client = FabricManagerClient(f"{replicas[0].addresses[0]},{down}", timeout_s=1.5)
        with client, pytest.raises(FabricUnavailableError, match=r"no replica .* served within 1.5s"):
            client.compositions()

    @pytest.mark.parametrize("replicas_are", ["down", "standbys"])
    def test_a_change_no_replica_took_says_it_was_not_made(
        self, replicas: list[FabricManagerServer], replicas_are: str
    ) -> None:
        """A change over several replicas waits for one that serves: one none served until its deadline never
        left the client, yet it said "an attempt got no answer, so the change may have been made"."""
        for server in replicas:
            set_serving(server, False)
        address = "127.0.0.1:1,127.0.0.1:2" if replicas_are == "down" else ",".join(s.addresses[0] for s in replicas)
        client = FabricManagerClient(address, timeout_s=1.0)
        with client, pytest.raises(FabricUnavailableError, match=r"no replica .* served within 1s") as refused:
            client.compose(parse_request("job", ["gpu x1"]), request_id="r1")
        assert "nothing was sent, so the change was not made" in refused.value.message
        assert refused.value.metadata["request_id"] == "r1"
        assert all(s.composer.compositions() == [] for s in replicas)

    @staticmethod
    def _drivers_unreachable(replicas: list[FabricManagerServer], monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """Every replica's ListCompositions answers that a driver cannot be reached; returns the calls made."""
        calls: list[str] = []

        def unreachable(request: object, context: object) -> None:
            calls.append("ListCompositions")
            raise FabricUnavailableError("the switch of pcie0 does not answer")

        for server in replicas:
            monkeypatch.setattr(server.servicer, "ListCompositions", unreachable)
        return calls

    def test_retries_turned_off_are_off(
        self, replicas: list[FabricManagerServer], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """`NO_RETRY` over several replicas repeated the call until its whole deadline had passed."""
        calls = self._drivers_unreachable(replicas, monkeypatch)
        address = ",".join(s.addresses[0] for s in replicas)
        client = FabricManagerClient(address, timeout_s=3.0, retries=NO_RETRY)
        with client, pytest.raises(FabricUnavailableError, match="does not answer"):
            client.compositions()
        assert calls == ["ListCompositions"]

    def test_a_driver_that_cannot_be_reached_is_retried_as_the_policy_says(
        self, replicas: list[FabricManagerServer], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The leader's own answer, which another replica would give too, was retried until the whole deadline
        (30 s by default) had passed, as a standby's is; with one address the policy's five attempts."""
        calls = self._drivers_unreachable(replicas, monkeypatch)
        policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
        address = ",".join(s.addresses[0] for s in replicas)
        client = FabricManagerClient(address, timeout_s=20.0, retries=policy)
        with client, pytest.raises(FabricUnavailableError, match="does not answer"):
            client.compositions()
        assert calls == ["ListCompositions"] * 3

    def test_a_replica_that_does_not_serve_says_so(self, replicas: list[FabricManagerServer]) -> None:
        set_serving(replicas[0], False)
        client = FabricManagerClient(replicas[0].addresses[0], retries=NO_RETRY)
        with client, pytest.raises(FabricUnavailableError) as refused:
            client.compositions()
        assert refused.value.metadata[SERVING] == NOT_SERVING and answered_not_serving(refused.value)

    def test_a_decompose_keeps_to_one_deadline(self, unserved: tuple[FabricManagerServer, FabricManagerServer]) -> None:
        """`decompose` is two calls, a lookup and the Decompose by id, and each took the whole `timeout_s`: a lookup
        that rode through most of a takeover was followed by a Decompose with a deadline of its own."""
        slow, other = unserved
        comp = slow.composer.compose(parse_request("job", ["gpu x1"])).composition
        assert comp is not None
        with _taken_over_late(slow, other) as client:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                client.decompose(comp.id)  # its unbind takes 1.5 s
            took = time.monotonic() - started
        assert took < 3.0 + 0.5, f"decompose took {took:.1f}s with timeout_s=3"

    def test_a_change_keeps_to_its_deadline_after_waiting_for_a_replica(
        self, unserved: tuple[FabricManagerServer, FabricManagerServer]
    ) -> None:
        """A change with a request id waits for a serving replica before it is sent, and was then sent with the
        whole time left before that wait: a takeover 2.4 s into a 3 s deadline gave the Compose 3 s more."""
        slow, other = unserved
        with _taken_over_late(slow, other) as client:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError) as refused:
                client.compose(parse_request("job", ["gpu x1"]), request_id="r1")  # its bind takes 1.5 s
            took = time.monotonic() - started
        assert took < 3.0 + 0.5, f"compose took {took:.1f}s with timeout_s=3"
        assert refused.value.metadata["request_id"] == "r1"
        assert slow.composer.compositions() == []

    def test_a_change_waiting_for_a_replica_ends_when_the_client_closes(
        self, replicas: list[FabricManagerServer]
    ) -> None:
        """Closed from another thread while a change waited for a serving replica, the call said that no replica
        served within its whole deadline, 20 s, of which it had waited half a second."""
        for server in replicas:
            set_serving(server, False)
        client = FabricManagerClient(",".join(s.addresses[0] for s in replicas), timeout_s=20)
        closer = threading.Timer(0.5, client.close)
        closer.start()
        started = time.monotonic()
        with client, pytest.raises(FabricUnavailableError, match="is closed") as refused:
            client.compose(parse_request("job", ["gpu x1"]), request_id="r1")
        assert time.monotonic() - started < 5
        assert "no replica" not in refused.value.message
        assert "nothing was sent, so the change was not made" in refused.value.message
        assert refused.value.metadata["request_id"] == "r1"

    def test_a_slow_answer_is_not_taken_for_no_replica(
        self, replicas: list[FabricManagerServer], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(replicas[0].servicer, "ListCompositions", lambda request, context: time.sleep(3))
        client = FabricManagerClient(f"{replicas[0].addresses[0]},127.0.0.1:1", timeout_s=1)
        with client, pytest.raises(DeadlineExceededError):
            client.compositions()

    def test_a_call_rides_through_a_leader_whose_ledger_failed(self) -> None:
        """Such a leader answers UNAVAILABLE at once while its health still says SERVING, until its next tick (up
        to `TICK_S`): the client's attempts were all spent on it, about 0.75 s of pauses in all, and the call
        failed with most of its deadline left instead of following the lead to the next replica."""
        store = _FailingStore()
        standby = FabricManagerServer(FabricComposer(rack(), store=MemoryStore()), ["127.0.0.1:0"])
        leader = FabricManagerServer(
            FabricComposer(rack(), store=store),
            ["127.0.0.1:0"],
            on_failed=lambda _: threading.Timer(0.5, set_serving, (standby, True)).start(),
        )
        ticked = threading.Event()
        tick = leader.composer.tick
        leader.composer.tick = lambda: (tick(), ticked.set())  # type: ignore[method-assign]
        leader.start()
        standby.start()
        set_serving(standby, False)
        try:
            with FabricManagerClient(f"{leader.addresses[0]},{standby.addresses[0]}", timeout_s=20) as client:
                client._rng = random.Random(3)  # pauses that add up to well under a second in five attempts
                client.compositions()
                ticked.clear()
                assert ticked.wait(WAIT_S)
                store.failed = "the disk went away"  # just after a tick: SERVING for about a second more
                assert client.compositions() == []
        finally:
            leader.stop(0)
            standby.stop(0)


class _FailingStore(MemoryStore):
    """A ledger that fails as a test says."""

    failed = ""

    @property
    def failure(self) -> str:
        return self.failed


@pytest.fixture(name="unserved")
def _unserved() -> Iterator[tuple[FabricManagerServer, FabricManagerServer]]:
    """Two fabric managers on loopback, both serving: the first binds in 1.5 s."""
    slow = FabricManagerServer(FabricComposer(slow_rack(1.5), store=MemoryStore()), ["127.0.0.1:0"])
    other = FabricManagerServer(FabricComposer(rack(), store=MemoryStore()), ["127.0.0.1:0"])
    slow.start()
    other.start()
    try:
        yield slow, other
    finally:
        slow.stop(0)
        other.stop(0)


@contextlib.contextmanager
def _taken_over_late(slow: FabricManagerServer, other: FabricManagerServer) -> Iterator[FabricManagerClient]:
    """A client of both, with a deadline of 3 s, while neither serves until ``slow`` takes over 2.4 s in."""
    set_serving(slow, False)
    set_serving(other, False)
    takeover = threading.Timer(2.4, set_serving, (slow, True))
    try:
        with FabricManagerClient(f"{slow.addresses[0]},{other.addresses[0]}", timeout_s=3.0) as client:
            takeover.start()
            yield client
    finally:
        takeover.cancel()


@pytest.fixture(name="replicas")
def _replicas() -> Iterator[list[FabricManagerServer]]:
    """Two fabric managers on loopback, both serving."""
    with replicas() as servers:
        yield servers


class TestADroppedClient:
    """A client of several replicas dropped without `close` is collected: its subscription to the channel's
    state held the client (a bound method of it), and gRPC's polling thread held the subscription, so the client,
    its channel and that thread lived as long as the process."""

    def test_is_collected(self, replicas: list[FabricManagerServer]) -> None:
        client = FabricManagerClient(f"{replicas[0].addresses[0]},127.0.0.1:1", timeout_s=5)
        client.compositions()
        dropped = weakref.ref(client)
        del client
        for _ in range(10):
            gc.collect()
            if dropped() is None:
                break
            time.sleep(0.1)
        assert dropped() is None
