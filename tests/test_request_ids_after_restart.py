"""After a restart (or a failover) the composer answers a retry from the newest request ids the ledger kept, in the
order they were answered, not in the order of the ids: client-chosen ids (random uuids) sort apart from their
answers, and a ledger that loaded or pruned them in key order would forget recent ids and keep old ones, so that a
recent retry composed a second time. Against real SQLite files and one real etcd member (`etcd_helpers`; skipped
without etcd, failed on CI)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from composer_helpers import composer, rack
from disagg.composer import FabricComposer
from disagg.requestlang import parse_request
from disagg.store import EtcdStore, SqliteStore, Store
from disagg.store import etcd as etcd_store
from disagg.store import sqlite as sqlite_store
from etcd_helpers import EtcdCluster, fresh_prefix, one_etcd_member

KEPT = 3
"""The request ids the composer remembers and the ledger keeps, lowered for the test."""
JOB = parse_request("job", ["gpu x1"])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from one_etcd_member(tmp_path_factory)


@pytest.fixture(params=["sqlite", "etcd"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """A maker of the store a new composer opens, each on the same ledger."""
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "ledger.db")
    cluster: EtcdCluster = request.getfixturevalue("etcd")
    prefix = fresh_prefix()
    return lambda: EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True)


@pytest.fixture(autouse=True)
def few_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("disagg.composer.composer.REQUEST_ID_MEMORY", KEPT)
    monkeypatch.setattr(sqlite_store, "REQUEST_RETENTION", KEPT)
    monkeypatch.setattr(etcd_store, "REQUEST_RETENTION", KEPT)


def _answered_then_decomposed(comp: FabricComposer, request_id: str) -> str:
    """Compose under ``request_id`` and decompose what it made: only the ledger's request answer tells of the id
    after that. The id of the composition made."""
    made = comp.compose(JOB, request_id=request_id).composition
    assert made is not None
    comp.decompose(made.id)
    return made.id


class TestTheNewestAnswersAfterARestart:
    """Ids answered newest last but sorting oldest last (the reverse of their answers): a retry of each of the
    newest `KEPT` gets its first answer after a restart, and only older ones are composed again."""

    def test_a_retry_of_a_recent_id_is_not_composed_again(self, ledger: Callable[[], Store]) -> None:
        ids = sorted((str(uuid.uuid4()) for _ in range(KEPT + 4)), reverse=True)
        first = composer(rack(), store=ledger())
        made = {request_id: _answered_then_decomposed(first, request_id) for request_id in ids}
        first.close()
        again = composer(rack(), store=ledger())
        try:
            for request_id in reversed(ids[-KEPT:]):  # newest first: a forgotten id run again pushes out no other
                answer = again.compose(JOB, request_id=request_id).composition
                assert answer is not None and answer.id == made[request_id], f"{request_id} was composed again"
            older = again.compose(JOB, request_id=ids[-KEPT - 1]).composition
            assert older is not None and older.id != made[ids[-KEPT - 1]]  # past the retention: a new request
        finally:
            again.close()
