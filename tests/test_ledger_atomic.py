"""The composer's changes written as one ledger transaction a step (`Store.atomic`, whose contract every ledger
keeps in tests/test_store.py): a composition's record and the event that tells of its change are durable together
or not at all.

Written one by one, a lead lost between the record and its event (etcd's writes were a transaction each) or a
commit taken between them (SQLite's committer takes whatever is queued) left the ledger with the record and not
the event: a watcher that resumes from a revision never learnt of the change, and saw the composition COMPOSED
for ever while the ledger held it DECOMPOSING. Against a real etcd member (`etcd_helpers`; skipped without etcd,
failed on CI) and real SQLite files.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from composer_helpers import composer, rack
from disagg import codec
from disagg.errors import ConfigError, FabricUnavailableError
from disagg.interfaces import CallContext
from disagg.model import Composition, CompositionState, Event, EventType
from disagg.requestlang import parse_request
from disagg.store import EtcdStore, SqliteStore, Store
from disagg.store import etcd as etcd_store
from disagg.store.etcd import LeadershipLostError
from etcd_helpers import EtcdCluster, fresh_prefix, one_etcd_member, raw_client, take_lead

REQUEST = parse_request("job", ["host cores>=8", "gpu x2 model=H200"])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from one_etcd_member(tmp_path_factory)


def _composition(cid: str, generation: int = 1) -> Composition:
    return Composition(
        id=cid, name=f"name-{cid}", host="h1", state=CompositionState.COMPOSED, resources=(), generation=generation
    )


def _event(revision: int, subject: str = "c1") -> Event:
    return Event(revision, EventType.COMPOSITION_UPDATED, subject, f"event {revision}", float(revision), {})


def _held(store: Store) -> tuple[dict[str, int], list[int]]:
    """The compositions' generations and the event revisions the store holds, once its writes are durable."""
    state = store.load()
    return {c.id: c.generation for c in state.compositions}, [e.revision for e in store.events_after(0)]


class TestSqlite:
    def test_the_committer_takes_none_of_a_block_before_it_ends(self, tmp_path: Path) -> None:
        """Whatever is queued is committed (``load`` waits for that) while the block is open: the file holds
        nothing of it; once it ends, all of it."""
        path = tmp_path / "ledger.db"
        store = SqliteStore(path)
        reader = sqlite3.connect(path)
        try:
            with store.atomic():
                store.put_composition(_composition("c1"))
                store.load()  # every write queued so far is committed
                assert reader.execute("SELECT count(*) FROM compositions").fetchone() == (0,)
                store.append_event(_event(1))
            store.load()
            assert reader.execute("SELECT count(*) FROM compositions").fetchone() == (1,)
            assert reader.execute("SELECT revision FROM events").fetchall() == [(1,)]
        finally:
            reader.close()
            store.close()

    def test_a_refused_event_leaves_nothing_of_its_block(self, tmp_path: Path) -> None:
        """An event not above the newest (a composer that reloaded a ledger it was not given) is refused as the
        block ends, and the record written beside it is not queued either."""
        store = SqliteStore(tmp_path / "ledger.db")
        try:
            store.append_event(_event(5))
            with pytest.raises(sqlite3.IntegrityError, match="revision 5 is not above 5"), store.atomic():
                store.put_composition(_composition("c1"))
                store.append_event(_event(5))
            assert _held(store) == ({}, [5])
        finally:
            store.close()

    def test_a_block_holds_only_its_own_threads_writes(self, tmp_path: Path) -> None:
        """Each thread has blocks of its own (`_Blocks`, made as a thread first opens one): a write another thread
        makes meanwhile, outside a block or in one of its own, is queued as that thread's, not held in this one."""
        store = SqliteStore(tmp_path / "ledger.db")
        opened, release = threading.Event(), threading.Event()

        def hold() -> None:
            with store.atomic():
                store.put_composition(_composition("c1"))
                opened.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            try:
                assert opened.wait(10)
                store.put_composition(_composition("c2"))
                with store.atomic():
                    store.put_composition(_composition("c3"))
                assert _held(store) == ({"c2": 1, "c3": 1}, [])
            finally:
                release.set()
                holder.join()
            assert _held(store) == ({"c1": 1, "c2": 1, "c3": 1}, [])
        finally:
            store.close()


class TestEtcd:
    def test_a_block_is_one_transaction(self, etcd: EtcdCluster) -> None:
        prefix = fresh_prefix()
        store = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        try:
            with store.atomic():
                store.put_composition(_composition("c1"))
                store.append_event(_event(1))
                store.put_cordon("pcie0/g0")
            kvs = raw_client(etcd.endpoints[0]).get_prefix(prefix)
            revisions = {int(meta["mod_revision"]) for _, meta in kvs}
            assert len(kvs) == 4  # the three records and the sequence key
            assert len(revisions) == 1
        finally:
            store.close()

    def test_a_block_larger_than_a_transaction_is_written_whole(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """etcd takes up to 128 operations in one transaction (its --max-txn-ops): a reconcile that quarantines
        more devices at once is written in several, in order."""
        monkeypatch.setattr(etcd_store, "TXN_OPS", 3)
        store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), unfenced=True)
        try:
            with store.atomic():
                for n in range(8):
                    store.put_cordon(f"pcie0/g{n}")
            assert store.load().cordons == tuple(sorted(f"pcie0/g{n}" for n in range(8)))
        finally:
            store.close()

    def test_a_block_refused_for_a_lost_lead_writes_none_of_it(self, etcd: EtcdCluster) -> None:
        prefix = fresh_prefix()
        key = f"{prefix}leader"
        store = EtcdStore(etcd.endpoints, prefix=prefix)
        store.fence(key, take_lead(etcd.endpoints[0], key))
        try:
            store.put_composition(_composition("c1"))
            with pytest.raises(LeadershipLostError), store.atomic():
                store.put_composition(_composition("c1", 2))
                take_lead(etcd.endpoints[0], key)
                store.append_event(_event(1))
            reader = EtcdStore(etcd.endpoints, prefix=prefix)
            assert _held(reader) == ({"c1": 1}, [])
            reader.close()
        finally:
            store.close()

    def test_a_prune_in_a_block_drops_the_events_put_before_it(self, etcd: EtcdCluster) -> None:
        """With a retention of one event, the second event of a block prunes the first, put in the same
        transaction: etcd refuses a transaction that puts a key its delete range covers, which failed the store."""
        store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), unfenced=True, event_retention=1)
        try:
            store.append_event(_event(1))
            with store.atomic():
                store.append_event(_event(2))
                store.append_event(_event(3))
            assert store.failure == ""
            assert [e.revision for e in store.events_after(0)] == [3]
        finally:
            store.close()

    def test_a_reconcile_that_quarantines_two_bindings_keeps_the_log_to_its_retention(self, etcd: EtcdCluster) -> None:
        """Two bindings no composition records: one hold of the reconcile reports both, two events that a log of
        one event's retention prunes within the hold."""
        fabrics = rack()
        store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), unfenced=True, event_retention=1)
        comp = composer(fabrics, store=store)
        try:
            for device in ("pcie0/gpu-b8", "pcie0/gpu-b9"):
                fabrics["pcie0"].bind(device, "h4", CallContext(epoch=0))
            comp.reconcile()
            assert store.failure == ""
            assert [e.type for e in store.events_after(0)] == [EventType.BINDING_QUARANTINED]
        finally:
            comp.close()
            store.close()


def _deposed_before(store: EtcdStore, etcd: EtcdCluster, key: str, commit: int) -> None:
    """Make ``store`` lose the lead just before its ``commit``-th transaction from now (1: the next)."""
    made = store._commit
    calls = 0

    def deposing(ops: list[dict[str, Any]]) -> None:
        nonlocal calls
        calls += 1
        if calls == commit:
            take_lead(etcd.endpoints[0], key)
        made(ops)

    store._commit = deposing  # type: ignore[method-assign]


def _staged_keys(etcd: EtcdCluster, prefix: str) -> list[str]:
    kvs = raw_client(etcd.endpoints[0]).get_prefix(f"{prefix}staged")
    return sorted(meta["key"].decode() for _, meta in kvs)


def _cordons_in_etcd(etcd: EtcdCluster, prefix: str) -> int:
    return len(raw_client(etcd.endpoints[0]).get_prefix(f"{prefix}cordons/"))


class TestEtcdBlocksLargerThanATransaction:
    """A block of more operations than etcd takes in one transaction (`TXN_OPS`; 128 by default, and a fabric
    that goes away marks each of its compositions UNKNOWN in one block) is written in several. Written straight
    into its keys, a leader that lost the lead between two of them left the first written and the rest not: the
    next leader loaded half a block, a record without its event among it. Staged first, it is finished by the
    next leader as it loads, or, if its staging did not end, never seen."""

    @pytest.fixture(autouse=True)
    def small_transactions(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(etcd_store, "TXN_OPS", 3)  # staged blocks apply one operation a transaction

    def _leader(self, etcd: EtcdCluster, prefix: str) -> EtcdStore:
        store = EtcdStore(etcd.endpoints, prefix=prefix)
        store.fence(f"{prefix}leader", take_lead(etcd.endpoints[0], f"{prefix}leader"))
        return store

    def _cut_short(self, etcd: EtcdCluster, prefix: str, commit: int, cordons: int = 9) -> None:
        """A leader that writes ``cordons`` cordons in one block and loses the lead before its ``commit``-th
        transaction."""
        old = self._leader(etcd, prefix)
        _deposed_before(old, etcd, f"{prefix}leader", commit)
        with pytest.raises(LeadershipLostError), old.atomic():
            for n in range(cordons):
                old.put_cordon(f"pcie0/g{n}")
        old.close()

    def test_a_block_cut_short_by_a_lost_lead_is_finished_by_the_next_leader(self, etcd: EtcdCluster) -> None:
        prefix = fresh_prefix()
        self._cut_short(etcd, prefix, commit=3)  # staged, then one of the nine cordons applied
        left = _cordons_in_etcd(etcd, prefix), _staged_keys(etcd, prefix)
        new = self._leader(etcd, prefix)
        try:
            assert new.load().cordons == tuple(f"pcie0/g{n}" for n in range(9))
            assert left == (1, [f"{prefix}staged", f"{prefix}staged/000000"])
            assert _staged_keys(etcd, prefix) == []
        finally:
            new.close()

    def test_only_a_writer_loads_past_a_staged_block(self, etcd: EtcdCluster) -> None:
        """A store that may not write (not fenced, and not made a single writer) cannot finish the block, and would
        read half of it: refused, without failing the store."""
        prefix = fresh_prefix()
        self._cut_short(etcd, prefix, commit=2)
        standby = EtcdStore(etcd.endpoints, prefix=prefix)
        try:
            with pytest.raises(FabricUnavailableError, match="staged and did not finish"):
                standby.load()
            assert standby.failure == ""
        finally:
            standby.close()

    def test_a_block_whose_staging_was_cut_short_is_none_of_it(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Staged in parts, the key that names them put with the last: parts without it are ignored, and the next
        staged block replaces and then deletes them."""
        monkeypatch.setattr(etcd_store, "STAGE_PART_BYTES", 200)
        prefix = fresh_prefix()
        self._cut_short(etcd, prefix, commit=2)  # the first part staged, not the rest
        assert _staged_keys(etcd, prefix) == [f"{prefix}staged/000000"]

        new = self._leader(etcd, prefix)
        try:
            assert new.load().cordons == ()
            with new.atomic():
                for n in range(4):
                    new.put_composition(_composition(f"c{n}"))
            assert _held(new) == ({f"c{n}": 1 for n in range(4)}, [])
            assert _staged_keys(etcd, prefix) == []
        finally:
            new.close()

    def test_a_damaged_staged_block_is_refused_naming_it(self, etcd: EtcdCluster) -> None:
        prefix = fresh_prefix()
        raw_client(etcd.endpoints[0]).put(f"{prefix}staged", '{"parts": 2}')
        raw_client(etcd.endpoints[0]).put(f"{prefix}staged/000000", "[")
        store = self._leader(etcd, prefix)
        try:
            with pytest.raises(ConfigError, match="staged block") as refused:
                store.load()
            assert "1 of its 2 parts" in str(refused.value)
        finally:
            store.close()


def _large(cid: str) -> Composition:
    """A record of about 20 KB: a composition of many resources."""
    return attrs.evolve(_composition(cid), message="m" * 20_000)


class TestEtcdBlocksLargerThanARequest:
    """etcd refuses a request above 1.5 MiB by default (``--max-request-bytes``) as well as one of more than 128
    operations."""

    def test_a_block_of_many_large_records_is_written_whole(self, etcd: EtcdCluster) -> None:
        """101 records of 20 KB: its transactions were cut by count alone, each about 2 MB, which etcd refused; the
        block staged, every next leader's load met the same refusal as it finished it, and none could start."""
        prefix = fresh_prefix()
        store = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        try:
            with store.atomic():
                for n in range(101):
                    store.put_composition(_large(f"c{n}"))
            assert store.failure == ""
            assert len(store.load().compositions) == 101
            assert _staged_keys(etcd, prefix) == []
        finally:
            store.close()

    def test_a_record_larger_than_a_request_fails_the_store_and_stages_nothing(self, etcd: EtcdCluster) -> None:
        prefix = fresh_prefix()
        store = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        try:
            too_large = attrs.evolve(_composition("c1"), message="m" * 2_000_000)
            with pytest.raises(FabricUnavailableError, match="more than etcd takes in one transaction"), store.atomic():
                store.put_composition(_composition("c0"))
                store.put_composition(too_large)
            assert "more than etcd takes" in store.failure
        finally:
            store.close()
        again = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        try:
            assert again.load().compositions == () and _staged_keys(etcd, prefix) == []
        finally:
            again.close()


class TestEtcdAStagedBlockLeftBehind:
    def test_the_next_writer_finishes_it_before_staging_its_own(
        self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A writer that did not load first (a single writer: a tool) staged its own block over the parts of one
        left behind, and its last transaction deleted them: the block left behind stayed half applied."""
        monkeypatch.setattr(etcd_store, "TXN_OPS", 3)
        prefix = fresh_prefix()
        first = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        made, calls = first._commit, 0

        def failing(ops: list[dict[str, Any]]) -> None:  # staged, one cordon applied, then etcd stops answering
            nonlocal calls
            calls += 1
            if calls == 3:
                raise FabricUnavailableError("no etcd endpoint answered")
            made(ops)

        first._commit = failing  # type: ignore[method-assign]
        with pytest.raises(FabricUnavailableError), first.atomic():
            for n in range(9):
                first.put_cordon(f"a/g{n}")
        first.close()
        second = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True)
        try:
            with second.atomic():
                for n in range(4):
                    second.put_cordon(f"b/g{n}")
            assert second.load().cordons == tuple([f"a/g{n}" for n in range(9)] + [f"b/g{n}" for n in range(4)])
        finally:
            second.close()

    def test_a_writer_that_cannot_look_for_one_fails(self, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
        """Before staging, a writer reads whether a block is left staged. That read, when no member answered it,
        failed the block but not the store, as every other first read of a write does (`_read_for_write`): the
        composer had changed its memory for a block etcd never got, and the ledger took the writes after it."""
        monkeypatch.setattr(etcd_store, "TXN_OPS", 3)  # a block of five cordons is staged
        prefix = fresh_prefix()
        store = EtcdStore(etcd.endpoints, prefix=prefix, unfenced=True, timeout_s=0.25, write_patience_s=0.5)
        try:
            store.put_cordon("before")
            proc = etcd.members[0].process
            assert proc is not None
            proc.send_signal(signal.SIGSTOP)  # the only member stops answering
            try:
                with pytest.raises(FabricUnavailableError, match="no etcd endpoint answered"), store.atomic():
                    for n in range(5):
                        store.put_cordon(f"g{n}")
            finally:
                proc.send_signal(signal.SIGCONT)
            assert "no etcd endpoint answered" in store.failure
            with pytest.raises(FabricUnavailableError):
                store.put_cordon("after")
            assert _cordons_in_etcd(etcd, prefix) == 1
        finally:
            store.close()


class _DeposedAtTheEvent(EtcdStore):
    """A leader's ledger that loses the lead just before its next event is written, as a replica paused (or cut
    off) between a change's record and its event would."""

    leader_key = ""
    depose_at_event = False

    def append_event(self, event: Event) -> None:
        if self.depose_at_event:
            self.depose_at_event = False
            take_lead(self.endpoints[0], self.leader_key)
        super().append_event(event)


class _CommittedBeforeTheEvent(SqliteStore):
    """A ledger whose committer takes everything queued just before each event is queued, and which keeps what the
    file then holds, as a crash at that instant would leave it: the compositions' states, and the events."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.seen: list[tuple[dict[str, CompositionState], list[Event]]] = []

    def append_event(self, event: Event) -> None:
        self.load()  # waits until everything queued is committed
        reader = sqlite3.connect(self.path)
        try:
            comps = [codec.loads(d, Composition) for (d,) in reader.execute("SELECT doc FROM compositions")]
            events = [codec.loads(d, Event) for (d,) in reader.execute("SELECT doc FROM events")]
        finally:
            reader.close()
        self.seen.append(({c.id: c.state for c in comps}, events))
        super().append_event(event)


def _untold(comps: dict[str, CompositionState], events: list[Event]) -> list[str]:
    """The compositions whose state on disk no event on disk tells of: one a watcher would never learn of."""
    told = {(e.subject, e.data.get("new")) for e in events if e.type is EventType.COMPOSITION_STATE_CHANGED}
    told |= {(e.subject, CompositionState.COMPOSING.value) for e in events if e.type is EventType.COMPOSITION_CREATED}
    return [f"{cid} {state.value}" for cid, state in comps.items() if (cid, state.value) not in told]


class TestTheComposersChanges:
    """A change's record and its event, through the composer's lock (`disagg.composer.ledgerlock`)."""

    def test_a_decompose_that_lost_the_lead_leaves_the_record_as_its_events_tell(self, etcd: EtcdCluster) -> None:
        prefix = fresh_prefix()
        key = f"{prefix}leader"
        store = _DeposedAtTheEvent(etcd.endpoints, prefix=prefix)
        store.leader_key = key
        store.fence(key, take_lead(etcd.endpoints[0], key))
        comp = composer(rack(), store=store)
        heard: list[Event] = []
        try:
            made = comp.compose(REQUEST).composition
            assert made is not None
            revision = comp.revision
            comp.add_listener(heard.append)
            store.depose_at_event = True
            with pytest.raises(LeadershipLostError):
                comp.decompose(made.id)
            reader = EtcdStore(etcd.endpoints, prefix=prefix)
            try:
                held = {c.id: c.state for c in reader.load().compositions}
                assert held == {made.id: CompositionState.COMPOSED}, "the record changed without its event"
                assert [e.revision for e in reader.events_after(revision)] == []
            finally:
                reader.close()
            assert heard == [], "a listener heard of an event the ledger does not hold"
        finally:
            comp.close()
            store.close()

    def test_a_commit_between_a_record_and_its_event_is_not_made(self, tmp_path: Path) -> None:
        """At every event a compose and a decompose write, what the file holds then has an event for each
        composition's state."""
        store = _CommittedBeforeTheEvent(tmp_path / "ledger.db")
        comp = composer(rack(), store=store)
        try:
            made = comp.compose(REQUEST).composition
            assert made is not None
            comp.decompose(made.id)
            assert len(store.seen) >= 4
            assert [_untold(*seen) for seen in store.seen] == [[]] * len(store.seen)
        finally:
            comp.close()
            store.close()

    def test_a_listener_hears_an_event_once_the_ledger_holds_it(self, etcd: EtcdCluster) -> None:
        store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), unfenced=True)
        comp = composer(rack(), store=store)
        found: list[bool] = []
        try:
            comp.add_listener(lambda event: found.append(bool(store.events_after(event.revision - 1, 1))))
            comp.compose(REQUEST)
            assert found and all(found)
        finally:
            comp.close()
            store.close()

    def test_a_change_a_listener_makes_is_heard_at_once(self, tmp_path: Path) -> None:
        """A listener that changes something (here, cordons a device when a composition is COMPOSED, the last hold of
        the Compose): its event is told as the hold that told the listener ends, not held back until a later one."""
        store = SqliteStore(tmp_path / "ledger.db")
        comp = composer(rack(), store=store)
        heard: list[EventType] = []

        def cordon_once(event: Event) -> None:
            if event.type is EventType.COMPOSITION_STATE_CHANGED and event.data["new"] == "COMPOSED":
                comp.cordon("pcie0/gpu-b9")

        try:
            comp.add_listener(cordon_once)
            comp.add_listener(lambda event: heard.append(event.type))
            comp.compose(REQUEST)
            assert EventType.DEVICE_CORDONED in heard
            assert heard.index(EventType.COMPOSITION_STATE_CHANGED) < heard.index(EventType.DEVICE_CORDONED)
            store.sync()
            assert store.load().cordons == ("pcie0/gpu-b9",)
        finally:
            comp.close()
            store.close()
