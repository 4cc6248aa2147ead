"""The etcd ledger's writes: ordered, so that a copy re-sent to another member and the first copy landing late
never apply out of order; patient across an etcd election, so that one member's death does not fail the
leader's ledger; and refused before `EtcdStore.fence` unless the store was made for a single writer.

Against real etcd processes on loopback (`etcd_helpers`), a member's misbehaviour played by a proxy in front of
it (`_Proxy`): it holds a write and sends it on only when the test says, sends it on and never answers, or
answers 503 as members do during an election. Without etcd the tests are skipped (failed on CI).
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from disagg import codec
from disagg.composer import FabricComposer
from disagg.config import build_composer, parse_config
from disagg.errors import ConfigError, FabricUnavailableError, InvalidRequestError
from disagg.ha import Leadership
from disagg.ha.election import lease_clock
from disagg.model import ComposeMode, Composition, CompositionRequest, CompositionState
from disagg.requestlang import parse_resource
from disagg.store import EtcdStore
from disagg.store import etcd as etcd_store
from disagg.store.etcd import LeadershipLostError, request_timeout
from disagg_sim import create_fabric
from etcd_helpers import EtcdCluster, fresh_prefix, one_etcd_member, raw_client, start_etcd_cluster, take_lead

TTL_S = 3
TIMEOUT_S = request_timeout(TTL_S)
"""Each request's wait, as `disagg serve` sets it for the default lease."""
PATIENCE_S = 5 * TIMEOUT_S
"""A call's patience by default: five sixths of the lease."""
WAIT_S = 10.0


def _campaigned(leadership: Leadership) -> Leadership:
    """``leadership``, having won its campaign within `WAIT_S` (the test fails otherwise)."""
    stop = threading.Event()
    timer = threading.Timer(WAIT_S, stop.set)
    timer.start()
    try:
        assert leadership.campaign(stop)
    finally:
        timer.cancel()
    return leadership


def _compact_after_a_page(
    monkeypatch: pytest.MonkeyPatch, store: EtcdStore, endpoint: str, under: bytes = b""
) -> list[int]:
    """Have ``store``'s first read of a page at a pinned revision (of keys under ``under``) be followed by another
    program's write and the operator's compaction at that write's revision; the list gets the revision compacted."""
    pinned_range = store._range
    compacted: list[int] = []

    def compact_after_the_page(start: bytes, end: bytes, **kw: Any) -> Any:
        answer = pinned_range(start, end, **kw)
        if kw.get("limit") and kw.get("revision") and under in start and not compacted:
            raw_client(endpoint).put("/elsewhere", "x")
            ((_, meta),) = raw_client(endpoint).get("/elsewhere", metadata=True)
            compacted.append(int(meta["mod_revision"]))
            url = f"http://{endpoint}/v3/kv/compaction"
            requests.post(url, json={"revision": compacted[0], "physical": True}, timeout=5).raise_for_status()
        return answer

    monkeypatch.setattr(store, "_range", compact_after_the_page)
    return compacted


def _composition(cid: str, generation: int = 1) -> Composition:
    return Composition(
        id=cid, name=f"name-{cid}", host="h1", state=CompositionState.COMPOSED, resources=(), generation=generation
    )


class _Proxy:
    """An HTTP proxy in front of one etcd member. ``mode`` says what it does with the next write (a transaction;
    reads always pass): "pass" sends it on and answers; "hold" keeps it until `release`, then sends it on, to a
    client long gone, as a member that stalled and resumed; "swallow" sends it on at once and never answers, as a
    member that applied it and died; the last two happen once, then it passes again. "unavailable" answers
    every request 503, as members do while etcd elects a leader."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.late: list[dict[str, Any]] = []
        """etcd's answers to the writes held or swallowed, which the client never got."""
        self.forwarded = threading.Event()
        self.requests: list[tuple[str, str]] = []
        """Every request that reached the proxy: its method and path."""
        self.on_forwarded: Callable[[], None] = lambda: None
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def release(self) -> None:
        self._release.set()

    def take(self, path: str) -> str:
        """The mode for this request, a one-shot mode spent on it."""
        with self._lock:
            mode = self.mode
            if mode in ("hold", "swallow"):
                if not path.endswith("/kv/txn"):
                    return "pass"
                self.mode = "pass"
            return mode

    def forward(self, path: str, body: bytes) -> requests.Response:
        return requests.post(
            f"http://{self.upstream}{path}", data=body, headers={"Content-Type": "application/json"}, timeout=WAIT_S
        )

    def heard(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        """Passed on (etcd3gw asks ``/version`` before its first call unless given the API path)."""
        proxy: _Proxy = self.server.proxy  # type: ignore[attr-defined]
        proxy.heard("GET", self.path)
        answer = requests.get(f"http://{proxy.upstream}{self.path}", timeout=WAIT_S)
        self._answer(answer.status_code, answer.content)

    def do_POST(self) -> None:
        proxy: _Proxy = self.server.proxy  # type: ignore[attr-defined]
        proxy.heard("POST", self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        mode = proxy.take(self.path)
        if mode == "unavailable":
            self._answer(503, b'{"error":"etcdserver: no leader","code":14}')
            return
        if mode == "busy":  # its apply loop lags its log: the request is not proposed
            self._answer(429, b'{"error":"etcdserver: too many requests","code":8}')
            return
        if mode == "hold":
            proxy._release.wait(WAIT_S)
        answer = proxy.forward(self.path, body)
        if mode == "pass":
            self._answer(answer.status_code, answer.content)
            return
        proxy.late.append(answer.json())
        proxy.on_forwarded()
        proxy.forwarded.set()
        if mode == "swallow":
            proxy._release.wait(WAIT_S)  # the client times out meanwhile; it never gets this answer

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def etcd_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from one_etcd_member(tmp_path_factory)


@pytest.fixture
def prefix() -> str:
    return fresh_prefix()


@pytest.fixture
def proxies(etcd_one: EtcdCluster) -> Iterator[Callable[[], _Proxy]]:
    """Proxies in front of the one member, closed after the test."""
    made: list[_Proxy] = []

    def make() -> _Proxy:
        made.append(_Proxy(etcd_one.endpoints[0]))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


def _fenced(endpoints: list[str], prefix: str, on_deposed: Callable[[str], None] | None = None) -> EtcdStore:
    """A store fenced on ``{prefix}leader`` as a leading replica's is, loaded as the composer does on start."""
    store = EtcdStore(endpoints, prefix=prefix, timeout_s=TIMEOUT_S)
    key = f"{prefix}leader"
    store.fence(key, take_lead(endpoints[-1], key), on_deposed)
    store.load()
    return store


def _set(proxies: list[_Proxy], mode: str) -> None:
    for proxy in proxies:
        proxy.mode = mode


def _held(endpoint: str, prefix: str, cid: str) -> Composition | None:
    """The composition as etcd holds it, read by a client of its own."""
    values = raw_client(endpoint).get(f"{prefix}compositions/{cid}")
    return codec.loads(values[0], Composition) if values else None


class TestLateCopies:
    """A write whose answer did not come in time is sent again to the next member, and the first copy may still
    reach etcd; whichever copy lands first is the write, and no other copy applies after it."""

    @pytest.mark.parametrize("later", ["delete", "put"])
    def test_a_copy_held_by_a_stalled_member_does_not_land_after_newer_writes(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str, later: str
    ) -> None:
        """The member that got the first copy stalled, and resumes after the re-sent copy and a newer write
        landed. Its copy put the old record back over the newer one, or brought a deleted composition back."""
        member = etcd_one.endpoints[0]
        stalled = proxies()
        store = _fenced([stalled.endpoint, member], prefix)
        try:
            store.put_composition(_composition("c1", 1))
            stalled.mode = "hold"
            store.put_composition(_composition("c1", 2))  # held; re-sent to the member, where it lands
            if later == "delete":
                store.delete_composition("c1")
            else:
                store.put_composition(_composition("c1", 3))
            stalled.release()
            assert stalled.forwarded.wait(WAIT_S), "the held copy was never sent on"
            expected = None if later == "delete" else _composition("c1", 3)
            assert _held(member, prefix, "c1") == expected
            assert stalled.late[0].get("succeeded") is None, "etcd applied the late copy"
            assert store.failure == ""
            assert [c.generation for c in store.load().compositions] == ([] if later == "delete" else [3])
        finally:
            store.close()

    def test_the_first_copy_landed_and_its_answer_was_lost(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The re-sent copy is refused since the first one landed: the write is done, not failed, and the
        writes after it go on in order."""
        member = etcd_one.endpoints[0]
        dying = proxies()
        store = _fenced([dying.endpoint, member], prefix)
        try:
            store.put_composition(_composition("c1", 1))
            dying.mode = "swallow"
            with caplog.at_level(logging.INFO, logger="disagg.store"):
                store.put_composition(_composition("c1", 2))
            assert dying.late[0].get("succeeded") is True
            assert "sent earlier landed" in caplog.text
            assert _held(member, prefix, "c1") == _composition("c1", 2)
            store.delete_composition("c1")
            store.put_composition(_composition("c2"))
            assert store.failure == ""
            assert [c.id for c in store.load().compositions] == ["c2"]
        finally:
            store.close()

    def test_the_first_copy_landed_before_another_replica_took_the_lead(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str
    ) -> None:
        """Its answer was lost, then the lead moved: the re-sent copy is refused on both counts, and the write
        is still reported done, since it landed while this replica led; the next one is LeadershipLostError."""
        member = etcd_one.endpoints[0]
        dying = proxies()
        deposed: list[str] = []
        store = _fenced([dying.endpoint, member], prefix, deposed.append)

        def another_leads() -> None:
            take_lead(member, f"{prefix}leader")

        try:
            dying.on_forwarded = another_leads
            dying.mode = "swallow"
            store.put_composition(_composition("c1"))
            assert _held(member, prefix, "c1") == _composition("c1")
            assert not deposed
            with pytest.raises(LeadershipLostError):
                store.delete_composition("c1")
            assert deposed and store.failure == ""
        finally:
            store.close()

    def test_another_writer_fails_the_store(self, etcd_one: EtcdCluster, prefix: str) -> None:
        """A second writer on the prefix (a store made for a single writer, twice) moved the ledger after this
        one loaded it: this one's memory may be stale, so it takes no more writes instead of overwriting."""
        first = EtcdStore(etcd_one.endpoints, prefix=prefix, unfenced=True)
        second = EtcdStore(etcd_one.endpoints, prefix=prefix, unfenced=True)
        try:
            first.put_composition(_composition("c1"))
            first.load()
            second.delete_composition("c1")
            with pytest.raises(FabricUnavailableError, match="another writer changed the etcd ledger"):
                first.put_composition(_composition("c1", 2))
            assert "another writer" in first.failure
            assert _held(etcd_one.endpoints[0], prefix, "c1") is None
        finally:
            first.close()
            second.close()


class TestPatience:
    """A call tries the members again, with a backoff, while they refuse or answer 503 (an etcd election), for up
    to ``write_patience_s``; only then does the ledger fail."""

    def test_a_write_waits_out_an_election(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str
    ) -> None:
        """Every member answered 503 for a second: one attempt each failed the write and the store for good."""
        members = [proxies(), proxies()]
        store = _fenced([m.endpoint for m in members], prefix)
        try:
            _set(members, "unavailable")
            threading.Timer(1.0, _set, args=(members, "pass")).start()
            started = time.monotonic()
            store.put_composition(_composition("c1"))
            assert 0.9 < time.monotonic() - started < PATIENCE_S
            assert store.failure == ""
            assert _held(etcd_one.endpoints[0], prefix, "c1") == _composition("c1")
            _set(members, "unavailable")
            threading.Timer(1.0, _set, args=(members, "pass")).start()
            assert [c.id for c in store.load().compositions] == ["c1"]  # reads wait too
        finally:
            store.close()

    def test_a_write_waits_out_a_member_that_lags(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str
    ) -> None:
        """etcd answered "too many requests" (429) for a moment, the request not proposed: the write failed, and
        the store with it, for good."""
        member = proxies()
        store = _fenced([member.endpoint], prefix)
        try:
            _set([member], "busy")
            threading.Timer(0.5, _set, args=([member], "pass")).start()
            store.put_composition(_composition("c1"))
            assert store.failure == ""
            assert _held(etcd_one.endpoints[0], prefix, "c1") == _composition("c1")
        finally:
            store.close()

    def test_the_patience_ends_within_the_lease(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str
    ) -> None:
        """Members that never come back fail the write and the store once the patience is spent, within the
        lease, naming every endpoint."""
        members = [proxies(), proxies()]
        store = _fenced([m.endpoint for m in members], prefix)
        try:
            _set(members, "unavailable")
            started = time.monotonic()
            with pytest.raises(FabricUnavailableError, match="no etcd endpoint answered") as info:
                store.put_composition(_composition("c1"))
            took = time.monotonic() - started
            assert PATIENCE_S - 0.1 < took < TTL_S
            assert all(m.endpoint in info.value.message for m in members)
            assert "no etcd endpoint answered" in store.failure
            assert store.write_patience_s == etcd_store.write_patience(TTL_S) == PATIENCE_S
        finally:
            store.close()

    def test_the_etcd_leader_dies_under_writes(self, tmp_path: Path, prefix: str) -> None:
        """The etcd leader, one member of three, is killed while the fabric manager's leader writes: every
        write lands, in order, and the ledger goes on."""
        cluster = start_etcd_cluster(tmp_path, members=3)
        endpoints = cluster.endpoints
        try:
            store = _fenced(endpoints, prefix)
            status = [requests.post(f"http://{e}/v3/maintenance/status", json={}, timeout=2).json() for e in endpoints]
            leader = next(i for i, s in enumerate(status) if s["header"]["member_id"] == status[0]["leader"])
            killer = threading.Timer(0.3, cluster.kill, args=(leader,))
            killer.start()
            ends = time.monotonic() + 2.0
            n = 0
            while time.monotonic() < ends:
                n += 1
                store.put_composition(_composition(f"c{n}"))
                store.delete_composition(f"c{n - 1}")
            killer.join()
            assert store.failure == ""
            assert [c.id for c in store.load().compositions] == [f"c{n}"]
            store.close()
        finally:
            cluster.stop()


class TestPatienceFollowsTheLease:
    """A fenced ledger's write is tried again for as long as the leader's lease, as etcd granted it, surely holds;
    no longer. It was tried for five sixths of the lease asked: on an etcd that grants more (``--election-timeout``
    of 2000 ms: 3 s for the 2 s asked), the election after the etcd leader's death outlasted the write, which failed
    the ledger and stopped the leader (exit 1), though its lease, and its lead, held."""

    SLOW_HEARTBEAT_MS = 100
    SLOW_ELECTION_MS = 2000
    ASKED_S = 2

    def _slow_cluster(self, tmp_path: Path) -> EtcdCluster:
        """Three members whose elections take 2 s and more: etcd grants 3 s for the 2 s asked."""
        return start_etcd_cluster(
            tmp_path, members=3, heartbeat_ms=self.SLOW_HEARTBEAT_MS, election_timeout_ms=self.SLOW_ELECTION_MS
        )

    def _serve_config(self, endpoints: list[str], prefix: str) -> EtcdStore:
        """The ledger as `disagg serve` builds it from ``[state]`` (`build_composer`)."""
        doc = {
            "state": {"ledger": "etcd", "endpoints": endpoints, "prefix": prefix, "lease_ttl_s": self.ASKED_S},
            "fabric": [{"name": "f", "driver": "sim", "options": {"generate": {"devices": 4}}}],
        }
        composer = build_composer(parse_config(doc, "test", {}))
        store = composer.store
        for fabric in composer.fabrics.values():
            fabric.close()
        assert isinstance(store, EtcdStore)
        return store

    def _lead(self, endpoints: list[str], prefix: str) -> tuple[Leadership, EtcdStore]:
        """A replica that leads, its ledger fenced and loaded as the server does on winning the lead."""
        leadership = _campaigned(Leadership(endpoints, "leader", key=f"{prefix}leader", ttl_s=self.ASKED_S))
        assert leadership.granted_ttl_s == 3
        store = self._serve_config(endpoints, prefix)
        store.fence(
            leadership.key,
            leadership.create_revision,
            leadership.deposed,
            lease_left=leadership.lease_left,  # as the server fences it (`runtime`)
        )
        store.load()
        return leadership, store

    def test_a_write_waits_out_an_election_the_granted_lease_outlives(self, tmp_path: Path) -> None:
        """Every member answers 503 for 2.2 s, as members do while a cluster with a 2 s election timeout elects
        a leader: the lease granted (3 s) outlives it, and so must the write."""
        cluster = self._slow_cluster(tmp_path)
        members = [_Proxy(e) for e in cluster.endpoints]
        prefix = fresh_prefix()
        try:
            leadership, store = self._lead([m.endpoint for m in members], prefix)
            try:
                deadline = time.monotonic() + WAIT_S
                while leadership._valid_until - lease_clock() < 2.8:  # just after a refresh: the lease holds 2.8 s
                    assert time.monotonic() < deadline, "no refresh of the lease was taken"
                    time.sleep(0.01)
                _set(members, "unavailable")
                back = threading.Timer(2.2, _set, args=(members, "pass"))
                back.start()
                started = time.monotonic()
                store.put_composition(_composition("c1"))
                assert 2.1 < time.monotonic() - started < 2.8
                back.join()
                assert store.failure == ""
                assert leadership.leading()
                assert _held(cluster.endpoints[0], prefix, "c1") == _composition("c1")
            finally:
                leadership.resign()
                store.close()
        finally:
            for m in members:
                m.close()
            cluster.stop()

    def test_the_write_ends_with_the_lease(self, tmp_path: Path) -> None:
        """Members that never come back fail the write once the lease may have run out, not later: a write tried
        past it would be a deposed leader's (which the fence refuses anyway). The lead ends then, not the ledger:
        the write failed the ledger, and `disagg serve` exited 1 instead of 3 when its timer saw that first. No
        later write is sent, since whether this one landed is unknown."""
        cluster = self._slow_cluster(tmp_path)
        members = [_Proxy(e) for e in cluster.endpoints]
        prefix = fresh_prefix()
        try:
            leadership, store = self._lead([m.endpoint for m in members], prefix)
            try:
                _set(members, "unavailable")
                with pytest.raises(LeadershipLostError, match="no etcd endpoint answered"):
                    store.put_composition(_composition("c1"))
                ended = lease_clock()
                assert leadership._valid_until - 0.1 < ended < leadership._valid_until + TIMEOUT_S
                assert leadership.lost.is_set() and store.failure == ""
                _set(members, "pass")
                with pytest.raises(LeadershipLostError, match="takes no more writes"):
                    store.put_composition(_composition("c2"))
                assert _held(cluster.endpoints[0], prefix, "c2") is None
            finally:
                leadership.resign()
                store.close()
        finally:
            for m in members:
                m.close()
            cluster.stop()

    def test_the_etcd_leader_dies_under_writes(self, tmp_path: Path) -> None:
        """The etcd leader, one member of three with a 2 s election timeout, is killed while the fabric
        manager's leader writes: the ledger fails only once the lease may have run out, never while the lead
        holds."""
        cluster = self._slow_cluster(tmp_path)
        endpoints = cluster.endpoints
        prefix = fresh_prefix()
        try:
            status = [requests.post(f"http://{e}/v3/maintenance/status", json={}, timeout=2).json() for e in endpoints]
            leader = next(i for i, s in enumerate(status) if s["header"]["member_id"] == status[0]["leader"])
            order = [endpoints[leader]] + [e for i, e in enumerate(endpoints) if i != leader]  # writes go to it
            leadership, store = self._lead(order, prefix)
            try:
                killer = threading.Timer(0.3, cluster.kill, args=(leader,))
                killer.start()
                ends = time.monotonic() + 5.0
                n = 0
                with contextlib.suppress(FabricUnavailableError):
                    while time.monotonic() < ends:
                        n += 1
                        store.put_composition(_composition(f"c{n}"))
                killer.join()
                if store.failure:
                    assert not leadership.leading(), f"the ledger failed while the lead held: {store.failure}"
            finally:
                leadership.resign()
                store.close()
        finally:
            cluster.stop()


class TestNoVersionDiscovery:
    """Every request to etcd goes to its ``/v3/`` gateway: the election's clients asked each member's ``/version``
    before its first call, one more round trip to a member newly tried, in a failover too."""

    def test_the_election_and_the_ledger_ask_no_version(
        self, etcd_one: EtcdCluster, proxies: Callable[[], _Proxy], prefix: str
    ) -> None:
        member = proxies()
        leadership = _campaigned(Leadership([member.endpoint], "leader", key=f"{prefix}leader", ttl_s=TTL_S))
        store = EtcdStore([member.endpoint], prefix=prefix, timeout_s=TIMEOUT_S)
        try:
            store.fence(leadership.key, leadership.create_revision)
            store.load()
            store.put_composition(_composition("c1"))
        finally:
            leadership.resign()
            store.close()
        assert member.requests
        assert [r for r in member.requests if r[0] != "POST" or not r[1].startswith("/v3/")] == []


class TestFencedFirst:
    """The replicas' ledger takes writes only from the replica that leads: a store that was not fenced refuses
    every write, unless made for a single writer (``unfenced``)."""

    def test_an_unfenced_write_is_refused(self, etcd_one: EtcdCluster, prefix: str) -> None:
        """A local command on the replicas' configuration wrote compositions and events beside the leader's."""
        store = EtcdStore(etcd_one.endpoints, prefix=prefix)
        try:
            with pytest.raises(FabricUnavailableError, match="before it was fenced") as info:
                store.put_composition(_composition("c1"))
            assert info.value.reason == "LEDGER_NOT_FENCED" and not info.value.retryable
            assert "fenced" in store.failure
            assert store.load().compositions == ()  # reads go on
            assert raw_client(etcd_one.endpoints[0]).get_prefix(prefix) == []
        finally:
            store.close()

    def test_a_single_writer_opts_in(self, etcd_one: EtcdCluster, prefix: str) -> None:
        store = EtcdStore(etcd_one.endpoints, prefix=prefix, unfenced=True)
        try:
            store.put_composition(_composition("c1"))
            assert [c.id for c in store.load().compositions] == ["c1"]
        finally:
            store.close()

    def test_fenced_after_made(self, etcd_one: EtcdCluster, prefix: str) -> None:
        """The leading replica's store: made at start-up, fenced once it leads, written after."""
        store = _fenced(etcd_one.endpoints, prefix)
        try:
            store.put_composition(_composition("c1"))
            assert _held(etcd_one.endpoints[0], prefix, "c1") == _composition("c1")
        finally:
            store.close()


class TestDamagedRecords:
    """A record in etcd that does not decode (damaged, or written by hand) made the replica taking the lead fail
    with a traceback from the codec; it is a ConfigError naming the key, as a damaged SQLite ledger's is."""

    @pytest.mark.parametrize(
        ("kind", "value"),
        [("compositions", '{"id": "c1", "name": '), ("compositions", "[1, 2]"), ("reservations", '{"id": 3}')],
    )
    def test_the_load_names_the_record(self, etcd_one: EtcdCluster, prefix: str, kind: str, value: str) -> None:
        store = EtcdStore(etcd_one.endpoints, prefix=prefix, unfenced=True)
        try:
            store.put_composition(_composition("c0"))
            raw_client(etcd_one.endpoints[0]).put(f"{prefix}{kind}/bad", value)
            with pytest.raises(ConfigError, match="restore it from a backup") as refused:
                store.load()
            assert f"{prefix}{kind}/bad" in refused.value.message and refused.value.field == "state.prefix"
        finally:
            store.close()


class TestClosed:
    def test_a_closed_store_takes_no_write(self) -> None:
        """A server that stopped waiting for a reconcile closes the ledger so that what the reconcile writes
        once it returns lands nowhere; a closed etcd store went on writing, over connections it opened again."""
        store = EtcdStore(["127.0.0.1:1"], timeout_s=0.05, write_patience_s=0, unfenced=True)
        store.close()
        with pytest.raises(FabricUnavailableError, match="is closed"):
            store.put_composition(_composition("c1"))


class TestRecordSize:
    """etcd limits a request's raw bytes (``--max-request-bytes``, 1.5 MiB by default), and the gateway carries
    them base64-encoded: a record is measured as etcd measures it."""

    GPUS = 7000
    """About 900 kB of record: base64, 1.2 MB, which the ledger took for etcd's measure and refused."""
    TOO_MANY = 16_000
    """Records of 1.3 MB (the composition) to 2 MB (while it binds): more than etcd takes in one request."""

    def _composer(self, etcd: EtcdCluster, prefix: str, gpus: int) -> tuple[FabricComposer, EtcdStore]:
        generate = {"devices": gpus + 50, "hosts_per_domain": 2, "gpus_per_chassis": gpus + 10}
        store = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        return FabricComposer({"pcie0": create_fabric("pcie0", {"generate": generate})}, store=store), store

    def test_a_composition_etcd_takes_is_written(self, etcd_one: EtcdCluster, prefix: str) -> None:
        """A composition of 7000 GPUs failed the ledger, and so stopped the leader, though etcd takes it."""
        composer, store = self._composer(etcd_one, prefix, self.GPUS)
        try:
            composer.start()
            result = composer.compose(CompositionRequest("big", (parse_resource(f"gpu x{self.GPUS}"),)))
            assert store.failure == ""
            reader = EtcdStore(etcd_one.endpoints, prefix=prefix)
            (held,) = reader.load().compositions
            reader.close()
            assert held == result.composition and len(held.devices) == self.GPUS
        finally:
            composer.close()

    def test_a_composition_too_large_for_etcd_is_refused_and_the_ledger_goes_on(
        self, etcd_one: EtcdCluster, prefix: str
    ) -> None:
        """Its first record failed the ledger, which stopped the leader, and the client's retry of the request
        stopped each replica that took the lead after it: it is refused as it is planned, before anything is
        claimed, bound or written, and the ledger takes the next change."""
        composer, store = self._composer(etcd_one, prefix, self.TOO_MANY)
        try:
            composer.start()
            big = CompositionRequest("big", (parse_resource(f"gpu x{self.TOO_MANY}"),))
            with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
                composer.compose(big, request_id="r-big")
            assert refused.value.field == "resources" and not refused.value.retryable
            assert store.failure == "" and not composer.fabrics["pcie0"].bindings()
            small = composer.compose(CompositionRequest("small", (parse_resource("gpu x2"),)), request_id="r-small")
            assert [c.id for c in store.load().compositions] == [small.composition.id]
        finally:
            composer.close()

    def test_a_recomposition_too_large_for_etcd_is_refused_and_the_ledger_goes_on(
        self, etcd_one: EtcdCluster, prefix: str
    ) -> None:
        """An addition that grows a composition past what etcd takes in one record is refused as planned too."""
        composer, store = self._composer(etcd_one, prefix, self.TOO_MANY)
        try:
            composer.start()
            small = composer.compose(CompositionRequest("small", (parse_resource("gpu x2"),)), request_id="r-small")
            cid = small.composition.id
            more = (parse_resource(f"gpu x{self.TOO_MANY - 2}"),)
            with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
                composer.recompose(cid, add=more, request_id="r-grow")
            assert refused.value.field == "add"
            assert store.failure == "" and len(composer.fabrics["pcie0"].bindings()) == 2
            grown = composer.recompose(cid, add=(parse_resource("gpu x1"),), request_id="r-one")
            assert store.load().compositions == (grown,)
        finally:
            composer.close()

    def test_a_removal_whose_pending_record_is_too_large_for_etcd_is_refused_and_the_ledger_goes_on(
        self, etcd_one: EtcdCluster, prefix: str
    ) -> None:
        """A removal's first record names what it removes beside all the composition holds: removing most of a
        composition grown to what etcd takes (composed, then as much added) wrote a record it does not, which
        failed the ledger and stopped the leader."""
        half = 5975
        composer, store = self._composer(etcd_one, prefix, 2 * half)
        try:
            composer.start()
            gpus = (parse_resource(f"gpu x{half}"),)
            first = composer.compose(CompositionRequest("big", gpus)).composition
            assert first is not None
            big = composer.recompose(first.id, add=gpus)
            assert store.failure == "" and len(big.devices) == 2 * half
            with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
                composer.recompose(big.id, remove=big.device_ids[1:], request_id="r-shrink")
            assert refused.value.field == "remove" and store.failure == ""
            assert len(composer.fabrics["pcie0"].bindings()) == 2 * half
            shrunk = composer.recompose(big.id, remove=big.device_ids[:2], request_id="r-two")
            assert store.failure == "" and store.load().compositions == (shrunk,)
        finally:
            composer.close()

    def test_a_reservation_too_large_for_etcd_is_refused_and_the_ledger_goes_on(
        self, etcd_one: EtcdCluster, prefix: str
    ) -> None:
        """A reservation's record holds its plan: one past what etcd takes failed the ledger as a composition did."""
        composer, store = self._composer(etcd_one, prefix, self.TOO_MANY)
        try:
            composer.start()
            big = CompositionRequest("big", (parse_resource(f"gpu x{self.TOO_MANY}"),))
            with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record"):
                composer.compose(big, ComposeMode.RESERVE, request_id="r-big")
            small = CompositionRequest("small", (parse_resource("gpu x2"),))
            held = composer.compose(small, ComposeMode.RESERVE, request_id="r-small").reservation
            assert store.failure == "" and held is not None
            assert [r.id for r in store.load().reservations] == [held.id]
        finally:
            composer.close()


class TestCompaction:
    """A replica taking the lead reads the ledger at one revision, page after page; an operator's `etcdctl
    compact` of the current revision (their runbook's, or on an etcd that other programs write too) between two
    pages failed that start, and the replica exited."""

    def test_a_load_outlives_a_compaction_between_its_pages(
        self, tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cluster = start_etcd_cluster(tmp_path)
        endpoint = cluster.endpoints[0]
        monkeypatch.setattr(etcd_store, "PAGE", 2)
        store = EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True)
        try:
            for n in range(5):
                store.put_composition(_composition(f"c{n}"))
            compacted = _compact_after_a_page(monkeypatch, store, endpoint)
            loaded = store.load()
            assert compacted and [c.id for c in loaded.compositions] == [f"c{n}" for n in range(5)]
            store.put_composition(_composition("c5"))  # and it writes on, ordered after what it loaded
        finally:
            store.close()
            cluster.stop()

    def test_a_load_outlives_a_compaction_between_the_pages_of_a_staged_block(
        self, tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A block left staged is read back before the ledger, at a revision of its own, page after page: a
        compaction between two of its pages failed the start of the replica taking the lead, before the load's
        own reading again could."""
        cluster = start_etcd_cluster(tmp_path)
        endpoint = cluster.endpoints[0]
        monkeypatch.setattr(etcd_store, "PAGE", 2)
        monkeypatch.setattr(etcd_store, "TXN_OPS", 3)
        monkeypatch.setattr(etcd_store, "STAGE_PART_BYTES", 200)
        first = EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True)
        second = EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True)
        try:

            def stopped(chunks: list[list[dict[str, Any]]]) -> None:  # staged, then etcd stops answering
                raise FabricUnavailableError("no etcd endpoint answered")

            monkeypatch.setattr(first, "_apply_staged", stopped)
            with pytest.raises(FabricUnavailableError), first.atomic():
                for n in range(9):
                    first.put_cordon(f"pcie0/g{n}")
            parts = raw_client(endpoint).get_prefix(f"{prefix}staged/")
            assert len(parts) > 2  # more than a page of parts
            compacted = _compact_after_a_page(monkeypatch, second, endpoint, b"staged/")
            loaded = second.load()
            assert compacted and loaded.cordons == tuple(f"pcie0/g{n}" for n in range(9))
            assert second.failure == "" and not raw_client(endpoint).get_prefix(f"{prefix}staged")
        finally:
            first.close()
            second.close()
            cluster.stop()
