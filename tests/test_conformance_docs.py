"""What docs/conformance.md and docs/driver-tutorial.md tell a driver author to type works on the package that
`disagg new-driver` generates."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from disagg.cli.newdriver import render_package
from disagg.testing.clauses import MARKER, SUITE_VERSION

DOCS = Path(__file__).parent.parent / "docs"


def python_block_after(text: str, marker: str) -> str:
    """The first ```python block after ``marker`` in ``text``."""
    found = re.search(re.escape(marker) + r".*?```python\n(.*?)```", text, flags=re.DOTALL)
    assert found is not None, f"no python block after {marker!r}"
    return found.group(1)


class TestTheDeselectSnippet:
    """The conftest.py snippet that deselects the clauses of undeclared features runs against the generated acme
    package: it names what the package defines."""

    def test_it_runs_against_the_generated_package(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        for path, content in render_package("acme").items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(content)
        monkeypatch.syspath_prepend(str(tmp_path / "src"))
        for name in [m for m in sys.modules if m == "disagg_acme" or m.startswith("disagg_acme.")]:
            monkeypatch.delitem(sys.modules, name)
        snippet = python_block_after((DOCS / "conformance.md").read_text(), "can deselect them instead")
        conftest = tmp_path / "tests" / "conftest.py"
        namespace: dict[str, Any] = {"__file__": str(conftest)}
        exec(compile(snippet, str(conftest), "exec"), namespace)

        class Item:
            def __init__(self, clause: str) -> None:
                self.path = tmp_path / "tests" / "test_conformance.py"
                self.clause = clause

            def get_closest_marker(self, name: str) -> pytest.Mark | None:
                mark: pytest.Mark = getattr(pytest.mark, MARKER)(self.clause).mark
                return mark if name == MARKER else None

        deselected: list[Any] = []

        def deselect(items: list[Any]) -> None:
            deselected.extend(items)

        config = types.SimpleNamespace(hook=types.SimpleNamespace(pytest_deselected=deselect))
        carve, bind = Item("CARVE-CONSERVES"), Item("BIND-IDEMPOTENT")
        items = [carve, bind]
        namespace["pytest_collection_modifyitems"](config, items)
        assert items == [bind] and deselected == [carve]  # the generated driver declares bind, not carve


class TestTheTutorial:
    """The tutorial says how disagg, which is not on PyPI, gets into a driver author's virtualenv before the
    generated package (which depends on it) is installed."""

    def test_it_installs_disagg_before_the_driver(self) -> None:
        text = (DOCS / "driver-tutorial.md").read_text()
        step = text[text.index("## 1. Generate, install, certify") : text.index("## 2.")]
        install = step.find("pip install -e '/path/to/disagg[testing]'")
        assert install != -1, "the tutorial does not say how to install disagg"
        assert "not on PyPI" in step
        assert install < step.index("pip install -e '.[test]'")


class TestTheSuiteVersion:
    """The conformance page names the suite version that every report carries."""

    def test_the_page_names_the_current_version(self) -> None:
        found = re.search(r"^Suite version: (\S+)\.\s", (DOCS / "conformance.md").read_text(), flags=re.MULTILINE)
        assert found is not None and found.group(1) == SUITE_VERSION
