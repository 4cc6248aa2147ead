"""The expected-failures file: clause ids a driver is known to fail while it is being developed."""

from __future__ import annotations

from pathlib import Path

from disagg.errors import ConfigError
from disagg.testing.clauses import CLAUSES


def read_expected_failures(path: Path) -> tuple[str, ...]:
    """Clause ids, one per line (``#`` starts a comment); an unknown id is a `ConfigError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"expected failures: cannot read {path}: not UTF-8 ({exc})", field="expected_failures"
        ) from None
    except OSError as exc:
        raise ConfigError(f"expected failures: cannot read {path}: {exc}", field="expected_failures") from None
    ids = []
    for n, line in enumerate(text.splitlines(), 1):
        word = line.split("#", 1)[0].strip()
        if not word:
            continue
        clause_id = word.split()[0]
        if clause_id not in CLAUSES:
            raise ConfigError(
                f"expected failures: {path}:{n}: no clause {clause_id!r} (see docs/conformance.md)",
                field="expected_failures",
            )
        ids.append(clause_id)
    return tuple(dict.fromkeys(ids))
