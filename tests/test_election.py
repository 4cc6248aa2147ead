"""Leader election on a real etcd (`disagg.ha.Leadership`): the lead is kept as long as etcd can refresh it.

A standby that campaigned for longer than the lease's time to live wins with a lease as fresh as a leader's,
a member that stops answering costs the leader a member, not the lead, and a leader that another replica
replaced between two refreshes stops serving at its first refused ledger write.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import etcd3gw
import grpc
import pytest
from composer_helpers import composer, rack
from disagg.client import NO_RETRY, FabricManagerClient
from disagg.composer import FabricComposer
from disagg.errors import ConfigError, FabricUnavailableError, StaleEpochError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.fabric.v1.fabric_manager_pb2_grpc import FabricManagerServiceStub
from disagg.ha import Leadership, election, timeouts
from disagg.interfaces import CallContext
from disagg.model import Binding, CompositionState, Topology
from disagg.requestlang import parse_request
from disagg.server import FabricManagerServer, FabricManagerServicer, runtime
from disagg.store.etcd import EtcdStore, request_timeout, write_patience
from etcd3gw.exceptions import ConnectionTimeoutError
from etcd_helpers import EtcdCluster, etcd_binary, free_ports, fresh_prefix, start_etcd_cluster
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub
from server_helpers import OPEN_CALL, FakeContext

TTL_S = 2
WAIT_S = 10.0


def _stopped_at_the_end(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """Yield ``cluster``, then stop it, its members that a test paused (SIGSTOP) woken first."""
    try:
        yield cluster
    finally:
        for member in cluster.members:
            if member.process is not None and member.process.poll() is None:
                member.process.send_signal(signal.SIGCONT)
        cluster.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    etcd_binary()
    cluster = start_etcd_cluster(tmp_path, members=3)
    yield from _stopped_at_the_end(cluster)


def campaign_in_thread(leadership: Leadership) -> tuple[threading.Thread, list[int]]:
    won: list[int] = []
    thread = threading.Thread(target=lambda: won.append(leadership.campaign()), daemon=True)
    thread.start()
    return thread, won


def etcd_client(etcd: EtcdCluster) -> etcd3gw.Etcd3Client:
    """A plain client of the cluster's first member, to read or write keys as a test's outside hand."""
    host, port = etcd.endpoints[0].rsplit(":", 1)
    return etcd3gw.client(host=host, port=int(port))


def wait_for_records(caplog: pytest.LogCaptureFixture, level: int, count: int) -> list[logging.LogRecord]:
    """The ``disagg.ha`` records of ``level`` once there are ``count`` of them, waiting `WAIT_S` at most."""
    deadline = time.monotonic() + WAIT_S
    while True:
        records = [r for r in caplog.records if r.name == "disagg.ha" and r.levelno == level]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.02)


def leading_server(
    etcd: EtcdCluster, leadership: Leadership, prefix: str
) -> tuple[FabricManagerServer, threading.Event]:
    """A started server on the demo rack and an etcd ledger under ``prefix``, campaigning with ``leadership``;
    the event is set once it serves."""
    return leading_server_of(etcd, leadership, prefix, rack())


def leading_server_of(
    etcd: EtcdCluster, leadership: Leadership, prefix: str, fabrics: dict[str, Any]
) -> tuple[FabricManagerServer, threading.Event]:
    """`leading_server` on ``fabrics``."""
    serving = threading.Event()
    server = FabricManagerServer(
        FabricComposer(fabrics, store=EtcdStore(etcd.endpoints, prefix=prefix)),
        ["127.0.0.1:0"],
        leadership=leadership,
        on_serving=lambda addresses: serving.set(),
    )
    server.start()
    return server, serving


class TestLeadership:
    def test_a_standby_that_waited_keeps_the_lead_it_wins(self, etcd: EtcdCluster) -> None:
        """The lead frees up when the standby's first lease is most of its time to live old: the standby
        refreshes its lease before it creates the key, so it does not lose the lead a moment after winning."""
        first = Leadership(etcd.endpoints, "first", ttl_s=TTL_S)
        assert first.campaign() > 0
        standby = Leadership(etcd.endpoints, "standby", ttl_s=TTL_S)
        thread, won = campaign_in_thread(standby)
        time.sleep(0.7 * TTL_S)
        first.resign()
        thread.join(WAIT_S)
        assert won and won[0] > first.epoch
        assert not standby.lost.wait(2.5 * TTL_S), "the new leader lost the lead with nothing wrong"
        standby.resign()

    def test_a_member_that_stops_answering_costs_no_lead(self, etcd: EtcdCluster) -> None:
        """The member the leader talks to stops (SIGSTOP: it holds its connections and answers nothing); the
        leader's refresh times out within a sixth of the time to live and goes to the next member at once."""
        leader = Leadership(etcd.endpoints, "leader", ttl_s=TTL_S)
        assert leader.campaign() > 0
        stalled = etcd.members[0].process
        assert stalled is not None
        stalled.send_signal(signal.SIGSTOP)
        try:
            assert not leader.lost.wait(3 * TTL_S), "one stalled member of three cost the lead"
        finally:
            stalled.send_signal(signal.SIGCONT)
        leader.resign()

    def test_a_campaign_whose_answer_was_lost_leads_with_its_lease(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The create landed but the read after it got no answer: the campaign threw its lease away, and the
        leader key, bound to it, shut every replica out until it ran out (30 s here). The campaign keeps its
        lease, finds the key bound to it and leads, with the epoch of that key's create revision (plus the
        base), as if it had seen the create answered."""
        get = etcd3gw.Etcd3Client.get
        lost_answers: list[str] = []

        def answer_lost_once(client: etcd3gw.Etcd3Client, key: str, *args: object, **kwargs: object) -> object:
            if not lost_answers and kwargs.get("metadata"):
                lost_answers.append(key)
                raise ConnectionTimeoutError("read timed out (the answer was lost)")
            return get(client, key, *args, **kwargs)  # type: ignore[call-overload]

        monkeypatch.setattr(etcd3gw.Etcd3Client, "get", answer_lost_once)
        leadership = Leadership(etcd.endpoints, "unanswered", ttl_s=30, epoch_base=1000)
        stop = threading.Event()
        won: list[int] = []
        thread = threading.Thread(target=lambda: won.append(leadership.campaign(stop)), daemon=True)
        thread.start()
        try:
            thread.join(WAIT_S)
            assert lost_answers == [leadership.key]
            assert won and won[0] > 0, "no lead within 10 s: the campaign waits out the lease its key is bound to"
            held = etcd_client(etcd).get(leadership.key, metadata=True)
            assert leadership._lease is not None and int(held[0][1]["lease"]) == leadership._lease.id
            assert won[0] == 1000 + int(held[0][1]["create_revision"]) == 1000 + leadership.create_revision
        finally:
            stop.set()
            thread.join(WAIT_S)
            leadership.resign()

    def test_an_unexpected_failure_of_the_keeper_ends_the_lead(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A refresh that raises other than a connection error (a gateway's error body has no "result") ended the
        keeper's thread and nothing else: the lease ran out while the replica went on leading. It ends the lead,
        saying why once."""
        leadership = Leadership(etcd.endpoints, "keeper", ttl_s=TTL_S)
        try:
            assert leadership.campaign() > 0
            assert leadership._lease is not None

            def unreadable_answer() -> int:
                raise KeyError("result")

            monkeypatch.setattr(leadership._lease, "refresh", unreadable_answer)
            assert leadership.lost.wait(WAIT_S), "the keeper failed and the replica still leads"
            assert not leadership.leading()
            said = [r.getMessage() for r in wait_for_records(caplog, logging.CRITICAL, 1)]
            assert len(said) == 1 and "the lease keeper failed (KeyError: 'result')" in said[0], said
        finally:
            leadership.resign()


class TestUnanswered:
    """What a replica that etcd does not answer logs: which member and why, and, once a campaign has had no
    answer from any member for several times to live, one error that a mistyped endpoint stands out by."""

    def test_a_campaign_names_the_member_and_the_cause(self, caplog: pytest.LogCaptureFixture) -> None:
        """The warnings said "etcd did not answer ()": etcd3gw's exceptions keep their text apart from str()."""
        endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
        leadership = Leadership(endpoints, "nowhere", ttl_s=TTL_S)
        stop = threading.Event()
        thread = threading.Thread(target=leadership.campaign, args=(stop,), daemon=True)
        thread.start()
        try:
            warned = [r.getMessage() for r in wait_for_records(caplog, logging.WARNING, 2)][:2]
        finally:
            stop.set()
            thread.join(WAIT_S)
        assert len(warned) == 2, warned
        for endpoint, message in zip(endpoints, warned, strict=True):
            assert message.startswith(f"campaign: etcd at {endpoint} did not answer (") and "refused" in message

    def test_a_campaign_no_member_answers_says_so_once(
        self, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(election, "SILENT_TTLS", 1, raising=False)
        monkeypatch.setattr(election, "CAMPAIGN_POLL_S", 0.05)
        endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
        leadership = Leadership(endpoints, "mistyped", ttl_s=TTL_S)
        stop = threading.Event()
        thread = threading.Thread(target=leadership.campaign, args=(stop,), daemon=True)
        thread.start()
        try:
            errors = [r.getMessage() for r in wait_for_records(caplog, logging.ERROR, 1)]
            attempts = len(wait_for_records(caplog, logging.WARNING, 0))
            wait_for_records(caplog, logging.WARNING, attempts + 10)  # ten more attempts, none answered
        finally:
            stop.set()
            thread.join(WAIT_S)
        assert len(errors) == 1, "no error for a campaign that no member answered for a time to live"
        assert "no etcd member has answered" in errors[0] and ", ".join(endpoints) in errors[0]
        assert len(wait_for_records(caplog, logging.ERROR, 1)) == 1, "said more than once"

    def test_a_resign_names_the_member_and_the_cause(self, caplog: pytest.LogCaptureFixture) -> None:
        endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
        leadership = Leadership(endpoints, "leaving", ttl_s=TTL_S)
        leadership._lease = etcd3gw.Lease(7, leadership._client())  # a lease it holds, as if it had won
        leadership.resign()
        warned = [r.getMessage() for r in wait_for_records(caplog, logging.WARNING, 2)]
        for endpoint, message in zip(endpoints, warned[:2], strict=True):
            assert message.startswith(f"could not revoke the lease at {endpoint} (") and "refused" in message


class TestReadLease:
    """Reads are answered from memory, which etcd does not fence: a replica answers them only while no other can
    lead, by its own clock (`Leadership.leading`)."""

    def test_a_leader_whose_lease_ran_out_unrefreshed_answers_no_read(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Its keeper has not refreshed the lease for the time to live (a paused process whose keeper has not
        run again yet): a standby may lead and have changed the ledger since, so a listing from this replica's
        memory could miss that. It was answered until the keeper found the lead lost; now it is UNAVAILABLE
        from the moment the lease may have run out, though the lead is not yet known lost."""
        leadership = Leadership(etcd.endpoints, "paused", ttl_s=TTL_S)
        server, serving = leading_server(etcd, leadership, "/read-lease/")
        try:
            assert serving.wait(WAIT_S)
            client = FabricManagerClient(server.addresses[0], retries=NO_RETRY)
            with client:
                assert client.compositions() == []
                assert leadership._lease is not None
                hung = threading.Event()
                monkeypatch.setattr(leadership._lease, "refresh", lambda: hung.wait(WAIT_S) and 0)
                # The step-down that follows within half a second (the next test) is held off: the read lease alone
                # is tested here.
                monkeypatch.setattr(leadership, "deposed", lambda why: None)
                time.sleep(TTL_S + 0.5)
                assert not leadership.lost.is_set(), "the keeper found the lead lost: this tests the gap before"
                with pytest.raises(FabricUnavailableError, match="lost the lead"):
                    client.compositions()
                with pytest.raises(FabricUnavailableError, match="lost the lead"):
                    client.compose(parse_request("late", ["gpu x1"]))
                hung.set()
        finally:
            server.stop(0)

    def test_a_leader_whose_keeper_hangs_steps_down_when_its_lease_runs_out(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The keeper's refresh hangs (a resolver that does not answer in a partition: a request's timeout does not
        bound it): only the keeper set the lead lost, so the replica refused every call but reported SERVING, kept
        its timer calling the drivers with its replaced epoch, and never exited to come back as a standby, for as
        long as the keeper hung. It steps down once its lease has run out by its own clock, and its timer does
        nothing from that moment."""
        monkeypatch.setattr(runtime, "RETRY_UNREACHABLE_S", 0.05)
        leadership = Leadership(etcd.endpoints, "hung", ttl_s=TTL_S)
        serving, lost = threading.Event(), threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/hung-keeper/")),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_serving=lambda addresses: serving.set(),
            on_lost=lost.set,
            tick_s=0.05,
        )
        server.start()
        hung = threading.Event()
        try:
            assert serving.wait(WAIT_S)
            unled: list[str] = []
            for name in ("tick", "retry_unreachable", "reconcile"):
                acting = getattr(server.composer, name)

                def checked(*args: object, name: str = name, acting: object = acting) -> object:
                    if not leadership.leading():
                        unled.append(name)
                    return acting(*args)  # type: ignore[operator]

                monkeypatch.setattr(server.composer, name, checked)
            deposed = leadership.deposed

            def slow_to_step_down(why: str) -> None:
                time.sleep(0.3)  # the timer ticks meanwhile, every 0.05 s
                deposed(why)

            monkeypatch.setattr(leadership, "deposed", slow_to_step_down)
            assert leadership._lease is not None
            monkeypatch.setattr(leadership._lease, "refresh", lambda: hung.wait(4 * WAIT_S) and 0)
            assert lost.wait(TTL_S + 2.0), "the replica whose lease ran out never stepped down"
            assert not hung.is_set()
            health = HealthStub(grpc.insecure_channel(server.addresses[0]))
            assert health.Check(HealthCheckRequest(), timeout=1).status == HealthCheckResponse.NOT_SERVING
            assert unled == [], f"the timer acted after the lease ran out: {sorted(set(unled))}"
        finally:
            hung.set()
            server.stop(0)

    def test_a_heal_does_not_start_once_the_lease_may_have_run_out(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A device fails in the half second before the step-down, when by this replica's clock its lease may
        have run out (its keeper hung): the heal its event started bound a replacement, with an epoch a new leader
        may have replaced, which a driver without FENCING takes. The heal does not start, saying why; the
        composition stays DEGRADED for the leader to heal."""
        fabrics = rack()
        leadership = Leadership(etcd.endpoints, "hung", ttl_s=30)
        server, serving = leading_server_of(etcd, leadership, "/late-heal/", fabrics)
        hung = threading.Event()
        try:
            assert serving.wait(WAIT_S)
            made = server.composer.compose(parse_request("job", ["gpu x1"])).composition
            assert made is not None
            assert leadership._lease is not None
            monkeypatch.setattr(leadership._lease, "refresh", lambda: hung.wait(4 * WAIT_S) and 0)
            monkeypatch.setattr(leadership, "deposed", lambda why: None)  # the step-down held off: the window before
            ran_out = election.lease_clock() + 31
            monkeypatch.setattr(election, "lease_clock", lambda: ran_out)
            assert not leadership.leading()
            binds: list[str] = []
            pcie = fabrics["pcie0"]
            bind = pcie.bind
            monkeypatch.setattr(pcie, "bind", lambda device, *args: (binds.append(device), bind(device, *args))[1])
            caplog.set_level(logging.WARNING, logger="disagg.composer")
            pcie.fail_device(made.devices[0].device, "ECC storm")
            assert server.composer.wait_for_heals(WAIT_S)
            assert binds == [], "a heal started after the lease may have run out"
            assert server.composer.get(made.id).state is CompositionState.DEGRADED
            said = [r.getMessage() for r in caplog.records if r.name == "disagg.composer"]
            assert any(f"not healing {made.id}" in m and "lease" in m for m in said), said
        finally:
            hung.set()
            server.stop(0)

    def test_the_timer_starts_nothing_once_the_lease_may_have_run_out(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The lease runs out, by this replica's clock, while the timer tries the unreachable fabrics (a driver's
        connect timeout): the reconcile due in the same tick started all the same, its heals and releases calling
        the drivers with a replaced epoch. Each of the timer's steps is checked as it starts."""
        monkeypatch.setattr(runtime, "RETRY_UNREACHABLE_S", 0.05)
        leadership = Leadership(etcd.endpoints, "slow-tick", ttl_s=30)
        serving = threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/slow-tick/")),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_serving=lambda addresses: serving.set(),
            tick_s=0.05,
            reconcile_s=0.05,
        )
        server.start()
        hung = threading.Event()
        try:
            assert serving.wait(WAIT_S)
            assert leadership._lease is not None
            monkeypatch.setattr(leadership._lease, "refresh", lambda: hung.wait(4 * WAIT_S) and 0)
            monkeypatch.setattr(leadership, "deposed", lambda why: None)  # the step-down held off: the window before
            ran_out: list[float] = []
            clock = election.lease_clock
            monkeypatch.setattr(election, "lease_clock", lambda: clock() + (31 if ran_out else 0))
            unled: list[str] = []
            retried = threading.Event()
            for name in ("tick", "poll_unheard", "reconcile", "retry_unreachable"):
                acting = getattr(server.composer, name)

                def checked(*args: object, name: str = name, acting: object = acting) -> object:
                    if not leadership.leading():
                        unled.append(name)
                    answer = acting(*args)  # type: ignore[operator]
                    if name == "retry_unreachable":
                        ran_out.append(clock())  # the lease runs out as it returns
                        retried.set()
                    return answer

                monkeypatch.setattr(server.composer, name, checked)
            assert retried.wait(WAIT_S)
            time.sleep(0.3)  # six ticks
            assert unled == [], f"the timer started work after the lease may have run out: {sorted(set(unled))}"
        finally:
            hung.set()
            server.stop(0)

    def test_a_leader_answers_reads_while_its_lease_is_refreshed(self, etcd: EtcdCluster) -> None:
        """The check costs the living leader nothing: reads go on across many refreshes."""
        leadership = Leadership(etcd.endpoints, "alive", ttl_s=TTL_S)
        server, serving = leading_server(etcd, leadership, "/read-lease-ok/")
        try:
            assert serving.wait(WAIT_S)
            with FabricManagerClient(server.addresses[0], retries=NO_RETRY) as client:
                ends = time.monotonic() + 2 * TTL_S
                while time.monotonic() < ends:
                    assert client.compositions() == []
                    time.sleep(0.05)
            assert leadership.leading()
        finally:
            server.stop(0)

    def test_a_machine_resumed_after_its_lease_ran_out_is_not_leading(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A suspended machine's monotonic clock stands still while etcd's lease runs out; resumed, the lease
        still looked valid by it. The read lease counts on a clock that goes on through a suspend."""
        leadership = Leadership(etcd.endpoints, "suspended", ttl_s=30)
        try:
            assert leadership.campaign() > 0 and leadership.leading()
            slept = election.lease_clock() + 60  # a minute of suspend: the boot clock moved on, not the other
            monkeypatch.setattr(election, "lease_clock", lambda: slept)
            assert not leadership.leading()
        finally:
            leadership.resign()

    def test_a_change_that_took_effect_is_answered(self) -> None:
        """The read lease was checked after a cordon, a fenced write, too: a lease that ran out meanwhile answered
        UNAVAILABLE for a device that was cordoned. Only reads, answered from memory, are checked after."""
        servicer = FabricManagerServicer(composer(rack()))
        servicer.mark_ready()
        checks = iter([True, False])
        servicer.lead = lambda: next(checks)  # the lease runs out as the cordon is made
        servicer.CordonDevice(fm.CordonDeviceRequest(id="pcie0/gpu-a0"), FakeContext())
        assert servicer.composer.is_cordoned("pcie0/gpu-a0")
        checks = iter([True, False])
        with pytest.raises(FabricUnavailableError, match="lost the lead"):
            servicer.ListCompositions(fm.ListCompositionsRequest(), FakeContext())

    def test_a_preview_is_a_read(self) -> None:
        """A PREVIEW places from memory and changes nothing: it was answered with the plan although the lease ran
        out as it placed (another replica may have taken the devices it names since). An APPLY is a change."""
        servicer = FabricManagerServicer(composer(rack()))
        servicer.mark_ready()
        request = fm.ComposeRequest(
            name="job", resources=[fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)], mode=fm.COMPOSE_MODE_PREVIEW
        )
        checks = iter([True, False])
        servicer.lead = lambda: next(checks)
        with pytest.raises(FabricUnavailableError, match="lost the lead"):
            servicer.Compose(request, OPEN_CALL)
        request.mode = fm.COMPOSE_MODE_APPLY
        checks = iter([True, False])
        assert servicer.Compose(request, OPEN_CALL).composition.name == "job"


class TestResign:
    def test_a_resign_goes_to_the_next_member_when_one_does_not_answer(self, etcd: EtcdCluster) -> None:
        """The member the leader talked to stopped: the revoke went only there, failed, and the standby waited
        out the whole lease (30 s here). Each member is now asked in turn, and the standby takes over at once."""
        leader = Leadership(etcd.endpoints, "leaving", ttl_s=30)
        assert leader.campaign() > 0
        standby = Leadership(etcd.endpoints, "standby", ttl_s=30)
        thread, won = campaign_in_thread(standby)
        stalled = etcd.members[leader._next % len(etcd.members)].process
        assert stalled is not None
        stalled.send_signal(signal.SIGSTOP)
        try:
            leader.resign()
            thread.join(WAIT_S)
            assert won and won[0] > leader.epoch, "the standby did not take over within 10 s of the resignation"
        finally:
            stalled.send_signal(signal.SIGCONT)
            standby.resign()

    def test_a_resign_during_a_campaign_leaves_no_leader_key(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The stop landed between a campaign's refresh of its lease and its create of the leader key: the create
        went out on no lease, a key that never ran out, and no replica could lead again."""
        standby = Leadership(etcd.endpoints, "stopping", ttl_s=TTL_S)
        client = etcd_client(etcd)
        client.put(standby.key, "another")
        assert standby._attempt() == 0  # another leads: the standby keeps its lease for the next try
        client.delete(standby.key)  # the leader is gone
        refresh = etcd3gw.Lease.refresh

        def refreshed_then_stopped(lease: etcd3gw.Lease) -> int:
            ttl: int = refresh(lease)
            standby.resign()  # SIGTERM, as the refresh's answer came back
            return ttl

        monkeypatch.setattr(etcd3gw.Lease, "refresh", refreshed_then_stopped)
        assert standby.campaign() == 0
        monkeypatch.undo()
        assert client.get(standby.key) == []
        winner = Leadership(etcd.endpoints, "next", ttl_s=TTL_S)
        thread, won = campaign_in_thread(winner)
        thread.join(WAIT_S)
        assert won and won[0] > 0, "no replica could lead after the resign"
        winner.resign()

    def test_a_lease_that_ran_out_is_not_revoked_on_every_member(
        self, etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        """etcd answers a revoke of a lease that has run out with "requested lease not found": that was taken for
        a member that did not answer, each member was asked in turn, and the log said the lease would expire."""
        leader = Leadership(etcd.endpoints, "leaving", ttl_s=30)
        assert leader.campaign() > 0
        lease = leader._lease
        assert lease is not None
        etcd3gw.Lease(lease.id, etcd_client(etcd)).revoke()  # as if it had run out
        with caplog.at_level(logging.INFO, logger="disagg.ha"):
            leader.resign()
        said = [r.getMessage() for r in caplog.records if r.name == "disagg.ha"]
        assert "the lease had already run out; nothing to revoke" in said
        assert not [m for m in said if "could not revoke" in m or "no member revoked" in m], said


class TestDeposed:
    def test_a_refused_write_after_resigning_is_no_lost_lead(self) -> None:
        """Writes still in flight when the replica resigned (it is stopping) are refused by etcd: no news, and
        no cause to report a lost lead or to exit as if one were lost."""
        leadership = Leadership(["127.0.0.1:1"], "stopping", ttl_s=30)
        leadership.resign()
        leadership.deposed("the ledger refused a write: another leads")
        assert not leadership.lost.is_set()

    def test_a_refused_ledger_write_ends_the_lead_at_once(self, etcd: EtcdCluster) -> None:
        """Another replica took the leader key between two of this one's refreshes (10 s apart here): the first
        ledger write that etcd refuses for it steps this replica down then, not at its next refresh."""
        leadership = Leadership(etcd.endpoints, "old", ttl_s=30)
        server, serving = leading_server(etcd, leadership, "/deposed/")
        usurper = Leadership(etcd.endpoints, "new", ttl_s=30)
        try:
            assert serving.wait(WAIT_S)
            host, port = etcd.endpoints[0].rsplit(":", 1)
            etcd3gw.client(host=host, port=int(port)).delete(leadership.key)  # as if its lease had run out
            assert usurper.campaign() > leadership.epoch
            client = FabricManagerClient(server.addresses[0], retries=NO_RETRY)
            with client, pytest.raises(FabricUnavailableError, match="another replica leads"):
                client.compose(parse_request("late", ["gpu x1"]))
            assert leadership.lost.wait(2.0), "the refused write did not end the lead"
            health = HealthStub(grpc.insecure_channel(server.addresses[0]))
            deadline = time.monotonic() + 2.0
            while health.Check(HealthCheckRequest(), timeout=1).status == HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the deposed replica still serves"
                time.sleep(0.05)
        finally:
            server.stop(0)
            usurper.resign()

    def test_a_write_no_member_answers_until_the_lease_ends_loses_the_lead(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """No etcd member answers (a partition): a write tries them while the lease surely holds, and then gives
        up. That failed the ledger (`on_failed`: `disagg serve` exits 1, "restart it once the ledger can be
        written") whenever the timer saw it before the step-down saw the lease run out. It ends the lead, saying
        why, and the ledger does not fail."""
        leadership = Leadership(etcd.endpoints, "cut-off", ttl_s=TTL_S)
        serving, lost = threading.Event(), threading.Event()
        failed: list[str] = []
        server = FabricManagerServer(
            FabricComposer(
                rack(), store=EtcdStore(etcd.endpoints, prefix="/cut-off/", timeout_s=request_timeout(TTL_S))
            ),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_serving=lambda addresses: serving.set(),
            on_lost=lost.set,
            on_failed=failed.append,
            tick_s=0.05,
        )
        server.start()
        try:
            assert serving.wait(WAIT_S)
            deposed = leadership.deposed

            def slow_to_step_down(why: str) -> None:
                time.sleep(0.3)  # the timer ticks meanwhile, every 0.05 s
                deposed(why)

            monkeypatch.setattr(leadership, "deposed", slow_to_step_down)
            for member in etcd.members:
                assert member.process is not None
                member.process.send_signal(signal.SIGSTOP)
            client = FabricManagerClient(server.addresses[0], retries=NO_RETRY)
            with client, pytest.raises(FabricUnavailableError):
                client.compose(parse_request("cut-off", ["gpu x1"]))
            assert lost.wait(WAIT_S), "the replica whose write outlasted its lease did not step down"
            time.sleep(0.3)  # six ticks of the timer
            assert failed == [], "a write cut off by the end of the lease failed the ledger"
            assert server.composer.store.failure == ""
            said = [r.getMessage() for r in wait_for_records(caplog, logging.CRITICAL, 1)]
            assert said and said[0].startswith(f"lost the lead (epoch {leadership.epoch}): "), said
        finally:
            server.stop(0)

    def test_stopped_while_it_starts_after_winning(self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
        """A replica stopped while its composer starts after it won the lead does not go on to serve."""
        served: list[list[str]] = []
        composer = FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/stopped/"))
        starting, go_on = threading.Event(), threading.Event()
        start = composer.start
        starter: list[threading.Thread] = []  # the replica's thread that starts the composer, and then serves
        started: list[bool] = []

        def slow_start() -> None:
            starter.append(threading.current_thread())
            starting.set()
            go_on.wait(WAIT_S)  # until the stop has come
            try:
                start()  # the stop cancelled it: it raises, having opened nothing more
            finally:
                started.append(True)

        monkeypatch.setattr(composer, "start", slow_start)
        server = FabricManagerServer(
            composer,
            ["127.0.0.1:0"],
            leadership=Leadership(etcd.endpoints, "slow", ttl_s=30),
            on_serving=served.append,
        )
        closed: list[str] = []
        close = composer.close
        monkeypatch.setattr(composer, "close", lambda: (closed.append("started" if started else "starting"), close()))
        server.start()
        assert starting.wait(WAIT_S)
        server.stop(0)
        go_on.set()
        starter[0].join(WAIT_S)  # past the composer's start, and whatever the replica did after it
        assert not starter[0].is_alive(), "the replica's start did not end after the stop"
        assert not served, "a stopped replica went on to serve"
        assert closed[-1:] == ["started"], "what the start opened after the stop was left open"
        server.stop(0)

    def test_a_lead_lost_while_it_starts_is_not_served(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The lead is lost while the composer starts (a long discovery): the replica stepped down only after
        announcing "serving" and reporting SERVING. It steps down while the start still runs, and never serves."""
        composer = FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/lost-starting/"))
        start = composer.start
        starting, go_on, started = threading.Event(), threading.Event(), threading.Event()

        def slow_start() -> None:
            starting.set()
            go_on.wait(WAIT_S)
            try:
                start()
            finally:
                started.set()

        monkeypatch.setattr(composer, "start", slow_start)
        served: list[list[str]] = []
        stepped_down = threading.Event()
        leadership = Leadership(etcd.endpoints, "old", ttl_s=TTL_S)  # its keeper finds the key gone within 1 s
        server = FabricManagerServer(
            composer, ["127.0.0.1:0"], leadership=leadership, on_serving=served.append, on_lost=stepped_down.set
        )
        usurper = Leadership(etcd.endpoints, "new", ttl_s=30)
        try:
            server.start()
            assert starting.wait(WAIT_S)
            etcd_client(etcd).delete(leadership.key)  # as if its lease had run out
            assert usurper.campaign() > leadership.epoch
            assert leadership.lost.wait(WAIT_S)
            assert stepped_down.wait(WAIT_S), "the replica did not step down while its composer started"
            go_on.set()
            assert started.wait(WAIT_S)
            for campaign in [t for t in threading.enumerate() if t.name == "disagg-campaign"]:
                campaign.join(WAIT_S)  # past the start: where the replica served
            assert not served, "a replica that lost the lead while it started went on to serve"
            health = HealthStub(grpc.insecure_channel(server.addresses[0]))
            assert health.Check(HealthCheckRequest(), timeout=1).status == HealthCheckResponse.NOT_SERVING
        finally:
            go_on.set()
            server.stop(0)
            usurper.resign()


class TestADeposedReplica:
    """A replica that lost the lead stopped answering (NOT_SERVING, every call UNAVAILABLE) and went on otherwise:
    its open event watches stayed open and silent, so their clients never moved to the new leader, and its timer
    went on, calling the drivers with the epoch the new leader had replaced."""

    @staticmethod
    def deposed(etcd: EtcdCluster, leadership: Leadership, lost: threading.Event) -> Leadership:
        """Take the lead from ``leadership`` as a new leader would; the new leader's, once the old one knows."""
        host, port = etcd.endpoints[0].rsplit(":", 1)
        etcd3gw.client(host=host, port=int(port)).delete(leadership.key)  # as if its lease had run out
        usurper = Leadership(etcd.endpoints, "new", ttl_s=30)
        assert usurper.campaign() > leadership.epoch
        assert lost.wait(WAIT_S), "the old replica did not step down"
        return usurper

    def test_its_event_watches_end_saying_so(self, etcd: EtcdCluster) -> None:
        leadership, serving, lost = Leadership(etcd.endpoints, "old", ttl_s=TTL_S), threading.Event(), threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/deposed-watch/")),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_serving=lambda addresses: serving.set(),
            on_lost=lost.set,  # an embedder that keeps the server, NOT_SERVING, rather than stopping it
        )
        server.start()
        usurper: Leadership | None = None
        try:
            assert serving.wait(WAIT_S)
            channel = grpc.insecure_channel(server.addresses[0])
            stream = FabricManagerServiceStub(channel).WatchEvents(fm.WatchEventsRequest(), timeout=WAIT_S)
            usurper = self.deposed(etcd, leadership, lost)
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "lost the lead" in (ended.value.details() or "")
            assert "watch again from revision" in (ended.value.details() or "")
            channel.close()
        finally:
            server.stop(0)
            if usurper is not None:
                usurper.resign()

    def test_its_timer_calls_no_driver(self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
        """pcie0 did not answer as the new leader took over, so it was not told the new epoch; when it answered
        again, the deposed replica's retry told it the old one, and could recover, reconcile and heal there."""
        monkeypatch.setattr(runtime, "RETRY_UNREACHABLE_S", 0.2)
        fabrics = rack()
        pcie = fabrics["pcie0"]
        down = threading.Event()
        calls: list[int] = []
        discover, unbind = pcie.discover, pcie.unbind

        def answering_discover() -> Topology:
            if down.is_set():
                raise FabricUnavailableError("pcie0 does not answer")
            return discover()

        def answering_unbind(binding: Binding, ctx: CallContext) -> None:
            if down.is_set():
                raise FabricUnavailableError("pcie0 does not answer")
            calls.append(ctx.epoch)
            unbind(binding, ctx)

        monkeypatch.setattr(pcie, "discover", answering_discover)
        monkeypatch.setattr(pcie, "unbind", answering_unbind)
        leadership, serving, lost = Leadership(etcd.endpoints, "old", ttl_s=TTL_S), threading.Event(), threading.Event()
        server = FabricManagerServer(
            FabricComposer(fabrics, store=EtcdStore(etcd.endpoints, prefix="/deposed-timer/")),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_serving=lambda addresses: serving.set(),
            on_lost=lost.set,
            tick_s=0.05,
        )
        down.set()  # unreachable as the old replica took the lead, and still as the new one takes it
        server.start()
        usurper: Leadership | None = None
        try:
            assert serving.wait(WAIT_S)
            usurper = self.deposed(etcd, leadership, lost)
            calls.clear()
            down.clear()
            time.sleep(1.0)  # five retries' worth of the timer
            assert calls == [], f"the deposed replica (epoch {leadership.epoch}) called pcie0 with epochs {calls}"
        finally:
            server.stop(0)
            if usurper is not None:
                usurper.resign()


class TestStartFailure:
    """A start that fails after the replica won the lead is not a lost lead: the replica says what failed and
    gives the lead up at once, so that another replica may try without waiting out the lease."""

    def test_a_record_that_does_not_decode(self, etcd: EtcdCluster) -> None:
        """It stepped down as if it had lost the lead, kept the lead (30 s here) and said nothing of the ledger
        but in a traceback."""
        etcd_client(etcd).put("/damaged/compositions/x", "{not json")
        leadership = Leadership(etcd.endpoints, "damaged", ttl_s=30)
        failed: list[Exception] = []
        told = threading.Event()
        stepped_down: list[bool] = []
        server = FabricManagerServer(
            FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/damaged/")),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_lost=lambda: stepped_down.append(True),
            on_start_failed=lambda error: (failed.append(error), told.set()),
        )
        try:
            server.start()
            assert told.wait(WAIT_S), "the failed start was not told"
            assert isinstance(failed[0], ConfigError) and "restore it from a backup" in failed[0].message
            assert not stepped_down, "a failed start was told as a lost lead"
            assert etcd_client(etcd).get(leadership.key) == [], "the lead was kept after the start failed"
            with (
                FabricManagerClient(server.addresses[0], retries=NO_RETRY) as client,
                pytest.raises(FabricUnavailableError, match="could not start after winning the lead"),
            ):
                client.compositions()
        finally:
            server.stop(0)

    def test_an_embedder_told_only_of_a_lost_lead_hears_of_a_failed_start(self, etcd: EtcdCluster) -> None:
        """``on_start_failed`` is newer than ``on_lost``: a server built with ``on_lost`` alone was told nothing,
        and sat there neither serving nor campaigning, where it had been told before."""
        etcd_client(etcd).put("/damaged/compositions/x", "{not json")
        told = threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/damaged/")),
            ["127.0.0.1:0"],
            leadership=Leadership(etcd.endpoints, "damaged", ttl_s=30),
            on_lost=told.set,
        )
        try:
            server.start()
            assert told.wait(WAIT_S), "a failed start was not told to on_lost"
        finally:
            server.stop(0)


class TestEpochBase:
    """A new etcd cluster starts its revisions low again while the drivers remember the highest epoch they have
    seen: every leader was refused. ``epoch_base`` lifts the epoch above it, through a base kept in etcd, so a
    replica that was not told leads above it too, and epochs still rise from one leader to the next."""

    def test_every_later_leader_leads_above_the_base(self, etcd: EtcdCluster) -> None:
        pcie = rack()["pcie0"]
        pcie.unbind(Binding("pcie0/disagg-fence", "disagg-fence"), CallContext(epoch=1000))  # seen before
        gpu = "pcie0/gpu-a0"
        low = Leadership(etcd.endpoints, "low", key="/base/leader", ttl_s=TTL_S)
        epoch = low.campaign()
        assert epoch == low.create_revision < 1000
        with pytest.raises(StaleEpochError, match="older than 1000"):
            pcie.bind(gpu, "h1", CallContext(epoch=epoch))
        low.resign()
        told = Leadership(etcd.endpoints, "told", key="/base/leader", ttl_s=TTL_S, epoch_base=1000)
        raised = told.campaign()
        assert raised == 1000 + told.create_revision
        pcie.bind(gpu, "h1", CallContext(epoch=raised))
        told.resign()
        untold = Leadership(etcd.endpoints, "untold", key="/base/leader", ttl_s=TTL_S)
        assert untold.campaign() == 1000 + untold.create_revision > raised
        untold.resign()

    def test_a_server_with_a_base_writes_its_ledger(self, etcd: EtcdCluster) -> None:
        """Ledger writes are fenced on the leader key's create revision, not on the epoch."""
        leadership = Leadership(etcd.endpoints, "based", key="/based/leader", ttl_s=TTL_S, epoch_base=500)
        server, serving = leading_server(etcd, leadership, "/based/")
        try:
            assert serving.wait(WAIT_S)
            with FabricManagerClient(server.addresses[0], retries=NO_RETRY) as client:
                made = client.compose(parse_request("job", ["gpu x1"]))
                assert made.composition is not None and leadership.epoch > 500
            assert not leadership.lost.is_set()
        finally:
            server.stop(0)

    def test_a_damaged_base_is_told_and_the_lead_given_up(self, etcd: EtcdCluster) -> None:
        """A base that is not a whole number raised a bare ValueError in the server's campaign thread: the replica
        neither served, nor said why, nor gave up the leader key it had made, and so did every replica after it."""
        etcd_client(etcd).put("/damaged-base/leader.epoch-base", "48,213")
        leadership = Leadership(etcd.endpoints, "damaged", key="/damaged-base/leader", ttl_s=30)
        failed: list[Exception] = []
        told = threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=EtcdStore(etcd.endpoints, prefix="/damaged-base/")),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_start_failed=lambda error: (failed.append(error), told.set()),
        )
        try:
            server.start()
            assert told.wait(WAIT_S), "the failed start was not told"
            assert isinstance(failed[0], ConfigError) and failed[0].field == "state.epoch_base"
            assert "'48,213', not a whole number of epochs" in failed[0].message
            assert etcd_client(etcd).get(leadership.key) == [], "the lead was kept after the start failed"
        finally:
            server.stop(0)

    def test_a_negative_base(self) -> None:
        with pytest.raises(ConfigError, match="epoch base must be 0 or more"):
            Leadership(["127.0.0.1:2379"], "x", epoch_base=-1)


SLOW_HEARTBEAT_MS = 100
SLOW_ELECTION_MS = 6000
GRANTED_S = 9
"""What etcd grants a lease asked for less under `SLOW_ELECTION_MS`: 1.5 times its election timeout."""


@pytest.fixture(scope="class")
def slow_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member with a 6 s election timeout, shared by the class's tests (each on a key of its own)."""
    etcd_binary()
    cluster = start_etcd_cluster(
        tmp_path_factory.mktemp("slow-etcd"), heartbeat_ms=SLOW_HEARTBEAT_MS, election_timeout_ms=SLOW_ELECTION_MS
    )
    yield from _stopped_at_the_end(cluster)


class TestGrantedLease:
    """etcd grants no lease less than 1.5 times its election timeout, whatever was asked, and says what it
    granted: the replica counts its refreshes, its read lease and its step-down from that, and says once that a
    dead leader holds the lead longer than ``lease_ttl_s``."""

    def test_a_longer_lease_is_told_once(self, slow_etcd: EtcdCluster, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.WARNING, logger="disagg.ha")
        key = f"{fresh_prefix()}leader"
        standby = Leadership(slow_etcd.endpoints, "standby", key=key, ttl_s=TTL_S)
        client = etcd_client(slow_etcd)
        client.put(key, "another")
        try:
            assert standby._attempt() == 0
            assert standby._lease is not None
            standby._lease.revoke()  # ran out: the next attempt is granted another
            assert standby._attempt() == 0
            client.delete(key)
            assert standby.campaign() > 0
        finally:
            standby.resign()
        told = [r.getMessage() for r in caplog.records if r.name == "disagg.ha" and r.levelno == logging.WARNING]
        assert len(told) == 1, told
        assert f"{GRANTED_S} s to live, not the {TTL_S} s asked ([state] lease_ttl_s)" in told[0]
        assert "--election-timeout" in told[0] and f"a dead leader holds the lead {GRANTED_S} s" in told[0]

    def test_the_leader_counts_the_lease_granted(self, slow_etcd: EtcdCluster) -> None:
        """etcd stops answering for longer than the lease asked, less than the lease granted: nobody else can lead
        meanwhile. The replica counted the time it asked: it stopped answering reads and gave the lead up, though
        etcd kept it for it."""
        leadership = Leadership(slow_etcd.endpoints, "leader", key=f"{fresh_prefix()}leader", ttl_s=TTL_S)
        stalled = slow_etcd.members[0].process
        assert stalled is not None
        try:
            assert leadership.campaign() > 0
            stalled.send_signal(signal.SIGSTOP)
            try:
                until = time.monotonic() + TTL_S + 2.0
                while time.monotonic() < until:
                    assert leadership.leading(), "a leader whose lease etcd keeps stopped answering reads"
                    time.sleep(0.1)
            finally:
                stalled.send_signal(signal.SIGCONT)
            assert not leadership.lost.wait(GRANTED_S / 3 + 1.0), "a leader whose lease etcd keeps gave the lead up"
            assert leadership.leading()
        finally:
            leadership.resign()

    def test_a_leaders_ledger_write_waits_while_the_lease_granted_holds(self, slow_etcd: EtcdCluster) -> None:
        """etcd stops answering for longer than a call's patience counted from the lease asked (five sixths of
        it), less than the lease granted: the leader's write waits and lands. It failed the ledger, and stopped
        the leader (exit 1), though etcd kept its lease and its lead."""
        prefix = fresh_prefix()
        leadership = Leadership(slow_etcd.endpoints, "leader", key=f"{prefix}leader", ttl_s=TTL_S)
        store = EtcdStore(  # as `build_composer` makes it for a lease_ttl_s of TTL_S
            slow_etcd.endpoints,
            prefix=prefix,
            timeout_s=request_timeout(TTL_S),
            write_patience_s=write_patience(TTL_S),
        )
        serving = threading.Event()
        server = FabricManagerServer(
            FabricComposer(rack(), store=store),
            ["127.0.0.1:0"],
            leadership=leadership,
            on_serving=lambda addresses: serving.set(),
        )
        stalled = slow_etcd.members[0].process
        assert stalled is not None
        server.start()
        try:
            assert serving.wait(WAIT_S)
            stalled.send_signal(signal.SIGSTOP)
            resume = threading.Timer(TTL_S + 1.0, stalled.send_signal, args=(signal.SIGCONT,))
            resume.start()
            try:
                client = FabricManagerClient(server.addresses[0], retries=NO_RETRY)
                with client:
                    composition = client.compose(parse_request("waits", ["gpu x1"])).composition
            finally:
                resume.join()
                stalled.send_signal(signal.SIGCONT)
            assert composition.name == "waits"
            assert store.failure == ""
            assert leadership.leading()
        finally:
            server.stop(0)


class TestElectionTimeoutRead:
    """etcd's election timeout is read from a member's command line (``/debug/vars``), the one place it shows, and
    only when it was given there: otherwise nothing is warned, and the rule is said at info level."""

    @pytest.mark.parametrize(
        ("cmdline", "expected"),
        [
            (["etcd", "--election-timeout=2000"], 2000),
            (["etcd", "--election-timeout", "1500"], 1500),
            (["etcd", "-election-timeout=3000"], 3000),
            (["etcd", "--heartbeat-interval=100"], None),
            (["etcd", "--election-timeout"], None),
            (["etcd", "--election-timeout=2s"], None),
            ("etcd --election-timeout=2000", None),
        ],
    )
    def test_the_command_line(self, cmdline: object, expected: int | None) -> None:
        assert timeouts.election_timeout_ms(cmdline) == expected

    def test_no_member_answers(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.INFO, logger="disagg.ha")
        endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
        timeouts.advise(endpoints, 3, 0.5)
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "disagg.ha"]
        assert len(said) == 1 and said[0][0] == logging.INFO, said
        assert "could not read etcd's --election-timeout" in said[0][1] and "(1000 ms)" in said[0][1], said

    def test_a_member_given_more_than_a_third(self, slow_etcd: EtcdCluster, caplog: pytest.LogCaptureFixture) -> None:
        """The 6 s election timeout of `slow_etcd` against a 10 s lease: the election timeout to give, or the lease
        to set, three election timeouts rounded up to whole seconds."""
        caplog.set_level(logging.INFO, logger="disagg.ha")
        timeouts.advise(slow_etcd.endpoints, 10, 0.5)
        said = [r.getMessage() for r in caplog.records if r.name == "disagg.ha"]
        assert len(said) == 1, said
        assert f"--election-timeout of {SLOW_ELECTION_MS} ms (at {slow_etcd.endpoints[0]})" in said[0], said
        assert "lease_ttl_s of 10 s" in said[0] and "3333 ms or less, or set lease_ttl_s = 18" in said[0], said
        caplog.clear()
        timeouts.advise(slow_etcd.endpoints, 18, 0.5)
        assert [r for r in caplog.records if r.name == "disagg.ha"] == [], "a lease of three election timeouts"
