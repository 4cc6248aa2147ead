"""The driver conformance suite: importable test classes, their fixtures, and the certification report.

A driver's tests subclass `FabricConformance` and override its ``fabric_factory`` fixture, with the pytest
plugin enabled (``pytest_plugins = ["disagg.testing.plugin"]``); ``disagg certify`` runs the same suite against
an installed driver or a FabricDriver endpoint. ``docs/conformance.md`` lists the clauses.

The test classes are imported on first use, so that pytest, once it runs, can rewrite their assertions.
"""

from typing import TYPE_CHECKING, Any

import pytest

from disagg.testing.clauses import CLAUSES, SUITE_VERSION, Clause, clause

if TYPE_CHECKING:
    from disagg.testing.suite import FabricConformance

pytest.register_assert_rewrite("disagg.testing.suite")

__all__ = ["CLAUSES", "SUITE_VERSION", "Clause", "FabricConformance", "clause"]


def __getattr__(name: str) -> Any:
    if name == "FabricConformance":
        from disagg.testing.suite import FabricConformance

        return FabricConformance
    raise AttributeError(name)
