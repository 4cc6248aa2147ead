"""Leaving out, in a driver's own test run, the clauses for features the driver does not declare.

`disagg certify` reports those clauses as NOT TESTED. In a driver's CI they would show as skips, which hide
real skips among them; a driver's ``conftest.py`` calls `deselect_undeclared` from its
``pytest_collection_modifyitems`` hook so that they are deselected instead, and pytest says how many. So are,
when the conftest names them, the clauses for hardware its fabric does not have (no MLD pool): skipped, they
would show in a CI run that must skip nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from disagg.model import Feature
from disagg.testing.clauses import CLAUSES, MARKER


def deselect_undeclared(
    config: pytest.Config,
    items: list[pytest.Item],
    declared: Iterable[Feature],
    under: Path,
    *,
    lacking: Mapping[str, str] | None = None,
) -> None:
    """Deselect the conformance tests under ``under`` (the conftest's directory: a conftest hook sees the whole
    session's items) whose clause does not apply to a driver that declares ``declared`` (`Clause.applies`), and
    those of the clauses ``lacking`` names: clauses whose hardware the fabric under test does not have (an MLD
    pool, for CARVE-MLD-LOGICAL-DEVICES), each with why, which `disagg certify` reports NOT TESTED for it. A
    clause id that is not the suite's is refused, so that a renamed clause is not left out unseen."""
    features = frozenset(declared)
    absent = dict(lacking or {})
    unknown = sorted(set(absent) - set(CLAUSES))
    if unknown:
        raise ValueError(f"no conformance clause has the id {', '.join(unknown)}: lacking names clause ids")
    kept, dropped = [], []
    for item in items:
        mark = item.get_closest_marker(MARKER)
        if (
            item.path.is_relative_to(under)
            and mark is not None
            and (not CLAUSES[mark.args[0]].applies(features) or mark.args[0] in absent)
        ):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
