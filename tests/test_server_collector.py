"""``disagg serve`` collects the garbage collector's youngest generation less often (`disagg.server.collector`).

Per call the server makes many short-lived objects, nearly all freed by reference counting; CPython's default
of a young collection every 700 allocations cost a durable Compose about 4% of its loop time. The serving
process raises it before it builds any fabric, and keeps the older generations' thresholds.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg.cli import serve as serve_cli
from disagg.cli.main import main
from disagg.server.collector import YOUNG_THRESHOLD, tune_for_serving


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[tuple[int, int, int]]:
    """This process's thresholds, as the test found them and as they are given back after it."""
    before = gc.get_threshold()
    gc.set_threshold(700, 11, 12)
    try:
        yield gc.get_threshold()
    finally:
        gc.set_threshold(*before)


def test_the_young_generation_waits_for_more_allocations_and_the_older_keep_theirs() -> None:
    tune_for_serving()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
    assert YOUNG_THRESHOLD > 700


def test_serve_tunes_the_collector_before_it_builds_a_fabric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []

    def serve(args: argparse.Namespace, *rest: Any) -> int:
        seen.append(gc.get_threshold())
        return 0

    monkeypatch.setattr(serve_cli, "_serve", serve)
    config = tmp_path / "disagg.toml"
    config.write_text(
        '[state]\nledger = "memory"\n[[fabric]]\nname = "pcie0"\ndriver = "sim"\noptions = { topology = "demo-pcie" }\n'
    )
    assert main(["serve", "--config", str(config), "--listen", f"unix:{tmp_path}/fm.sock"]) == 0
    assert seen == [(YOUNG_THRESHOLD, 11, 12)]


def test_a_refused_serve_leaves_the_collector_as_it_was(tmp_path: Path, thresholds: tuple[int, int, int]) -> None:
    assert main(["serve", "--listen", "0.0.0.0:50051"]) == 2
    assert gc.get_threshold() == thresholds
