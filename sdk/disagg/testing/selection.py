"""Leaving out, in a driver's own test run, the clauses for features the driver does not declare.

`disagg certify` reports those clauses as NOT TESTED. In a driver's CI they would show as skips, which hide
real skips among them; a driver's ``conftest.py`` calls `deselect_undeclared` from its
``pytest_collection_modifyitems`` hook so that they are deselected instead, and pytest says how many.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from disagg.model import Feature
from disagg.testing.clauses import CLAUSES, MARKER


def deselect_undeclared(
    config: pytest.Config, items: list[pytest.Item], declared: Iterable[Feature], under: Path
) -> None:
    """Deselect the conformance tests under ``under`` (the conftest's directory: a conftest hook sees the whole
    session's items) whose clause does not apply to a driver that declares ``declared`` (`Clause.applies`)."""
    features = frozenset(declared)
    kept, dropped = [], []
    for item in items:
        mark = item.get_closest_marker(MARKER)
        if item.path.is_relative_to(under) and mark is not None and not CLAUSES[mark.args[0]].applies(features):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
