"""A ledger an earlier version wrote still loads: its compositions and reservations may hold request values a
request may no longer give (a selector's whole number beyond int64 or its infinity, a latency bound beyond
uint64, a negative host minimum), which the version before the request limits took and recorded. The model
classes refused them, so one such record made every local command, and `disagg serve`, fail as it started."""

from __future__ import annotations

import contextlib
import json
import math
import re
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from composer_helpers import composer, rack
from disagg.cli.main import main
from disagg.client import FabricManagerClient
from disagg.config import load_config
from disagg.errors import ConfigError
from disagg.model import ComposeMode, CompositionState
from disagg.requestlang import parse_request
from disagg.store import SqliteStore
from server_helpers import WAIT_S, serving, socket_path

BIG = 12345678901234567890123
"""A selector's whole number beyond int64, which the earlier version's text form read and recorded."""
LONG_NS = 99999999999999999999999 * 10**6
"""``latency<=99999999999999999999999ms``, beyond uint64 ns."""

AS_WRITTEN_BEFORE: Mapping[str, list[tuple[str, str]]] = {
    "compositions": [
        ('"value":12345', f'"value":{BIG}'),
        ('"value":1.5', '"value":Infinity'),
        ('"max_latency_ns":600', f'"max_latency_ns":{LONG_NS}'),
    ],
    "reservations": [('"min_cores":7', '"min_cores":-7')],
}
"""What the records of the requests below become as the earlier version wrote them (in records a ledger writes
today: a record's layout is the same)."""


def as_written_before(ledger: Path, tables: Mapping[str, list[tuple[str, str]]] = AS_WRITTEN_BEFORE) -> None:
    """Rewrite the records of ``ledger`` (closed) as the earlier version wrote them: in each table, each
    ``(old, new)`` text of each record (`AS_WRITTEN_BEFORE`)."""
    with contextlib.closing(sqlite3.connect(ledger)) as db, db:
        for table, changes in tables.items():
            rows = db.execute(f"SELECT id, doc FROM {table}").fetchall()
            assert rows, table
            for key, written in rows:
                doc = written
                for old, new in changes:
                    assert old in doc, (old, doc)
                    doc = doc.replace(old, new)
                db.execute(f"UPDATE {table} SET doc = ? WHERE id = ?", (doc, key))


def fabrics(state: Path) -> Mapping[str, Any]:
    return rack(pcie0={"state_file": str(state / "pcie0.json")}, cxl0={"state_file": str(state / "cxl0.json")})


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """A SQLite ledger holding the composition ``big`` and a reservation for ``held``, their requests holding
    values a request may no longer give, beside the hardware state they were made on."""
    path = tmp_path / "ledger.db"
    first = composer(fabrics(tmp_path), store=SqliteStore(path))
    try:
        first.compose(parse_request("big", ["gpu k!=12345 j!=1.5 latency<=600ns"]))
        first.compose(parse_request("held", ["host cores>=7", "gpu"]), ComposeMode.RESERVE, reservation_ttl_s=3600)
    finally:
        first.close()
    as_written_before(path)
    return path


class TestALedgerOfAnEarlierVersion:
    """Its compositions and reservations load, are served and can be decomposed or released."""

    def test_the_composer_starts_on_it(self, tmp_path: Path, ledger: Path) -> None:
        restarted = composer(fabrics(tmp_path), store=SqliteStore(ledger))  # FabricComposer.start loads it
        try:
            (big,) = restarted.compositions()
            assert big.name == "big" and big.state is CompositionState.COMPOSED
            (line,) = big.resources
            assert [s.value for s in line.selectors] == [BIG, math.inf]
            assert line.max_latency_ns == LONG_NS
            (held,) = restarted.reservations()
            assert held.request.host.min_cores == -7
            restarted.decompose(big.id)
            restarted.release_reservation(held.id)
            assert restarted.compositions() == [] and restarted.reservations() == []
        finally:
            restarted.close()

    def test_a_server_on_it_answers_every_client(self, tmp_path: Path, ledger: Path) -> None:
        """Each value goes as the equivalent its field carries: a whole number beyond int64 as a double, a bound
        beyond uint64 as the largest, a negative minimum as 0."""
        with (
            serving(socket_path(tmp_path), fabrics(tmp_path), store=SqliteStore(ledger)) as served,
            FabricManagerClient(served.address, timeout_s=WAIT_S) as client,
        ):
            (big,) = client.compositions()
            (line,) = big.resources
            assert [s.value for s in line.selectors] == [float(BIG), math.inf]
            assert line.max_latency_ns == 2**64 - 1
            (held,) = client.reservations()
            assert held.request.host.min_cores == 0
            assert client.get("big").id == big.id


class TestTheCli:
    """`disagg ls` on a ledger the earlier version's `disagg compose` wrote (the reviewer's case) exits 0."""

    @pytest.mark.parametrize(
        ("clause", "change"),
        [
            ("gpu x1 part_number!=12345", ('"value":12345', f'"value":{BIG}')),
            ("gpu x1 latency<=600ns", ('"max_latency_ns":600', f'"max_latency_ns":{LONG_NS}')),
        ],
    )
    def test_ls(
        self,
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        clause: str,
        change: tuple[str, str],
    ) -> None:
        monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path))
        monkeypatch.delenv("DISAGG_CONFIG", raising=False)
        monkeypatch.delenv("DISAGG_SERVER", raising=False)
        monkeypatch.chdir(tmp_path)
        assert main(["compose", "train", clause]) == 0
        as_written_before(tmp_path / "ledger.db", {"compositions": [change]})
        capsys.readouterr()
        assert main(["ls", "--json"]) == 0, capsys.readouterr().err
        (listed,) = json.loads(capsys.readouterr().out)
        assert listed["name"] == "train"


class TestTheDocumentedStateTable:
    """docs/configuration.md's example, with each ledger its comment offers, loads as the comments say: its
    ``path`` line is refused with ``ledger = "etcd"``, which the comment sent there without a word."""

    def test_each_ledger_it_offers(self, tmp_path: Path) -> None:
        text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
        example = text.split("```toml\n", 1)[1].split("```", 1)[0]
        (line,) = [x for x in example.splitlines() if x.startswith("ledger = ")]
        comment = line.split("#", 1)[1]
        offered = re.findall(r'"(\w+)"', comment)
        assert sorted(offered) == ["etcd", "memory"]
        for ledger in offered:
            doc = example.replace('ledger = "sqlite"', f'ledger = "{ledger}"')
            if ledger == "etcd":
                assert re.search(r'"etcd"[^"]*without path', comment), comment
                doc = "\n".join(x for x in doc.splitlines() if not x.startswith("path = "))
                doc = doc.replace("[state]", '[state]\nendpoints = ["127.0.0.1:2379"]')
                with_path = tmp_path / "with-path.toml"
                with_path.write_text(example.replace('ledger = "sqlite"', 'ledger = "etcd"\nendpoints = ["e:1"]'))
                with pytest.raises(ConfigError) as info:
                    load_config(with_path, {"DISAGG_STATE_DIR": str(tmp_path)})
                assert info.value.field == "state.path"
            path = tmp_path / f"{ledger}.toml"
            path.write_text(doc)
            assert load_config(path, {"DISAGG_STATE_DIR": str(tmp_path)}).ledger == ledger
