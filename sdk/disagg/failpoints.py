"""Named failpoints for crash tests: the fabric manager kills itself (SIGKILL, no clean-up of any kind) at a
chosen point of the compose, recompose, decompose or heal path, of the rollback of one that failed, or of the
recovery of one a crash interrupted, so that a test can restart it and check that nothing was lost, leaked or
left half done.

They are armed only by the test setting ``DISAGG_FAILPOINTS``: a comma-separated list of ``NAME`` (kill at
the first hit) or ``NAME@N`` (kill at the N-th hit). Unset, `hit` costs one dict lookup. An unknown name is
a `ConfigError` when any `disagg` command starts (`check`), so a misspelt failpoint cannot make a crash test
pass vacuously.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping

from disagg.errors import ConfigError

ENV = "DISAGG_FAILPOINTS"

FAILPOINTS: dict[str, str] = {
    "compose.after_reserve": "a new composition is recorded COMPOSING with its plan, before any driver call",
    "compose.after_bind": "after each device of a new composition is bound",
    "compose.after_allocate": "after each allocation of a new composition is carved",
    "compose.before_commit": "every driver call of a new composition succeeded; it is not yet COMPOSED",
    "compose.after_commit": "a new composition is COMPOSED, its record queued for the next commit; no answer yet",
    "recompose.after_bind": "after each device added to a composition is bound",
    "recompose.after_allocate": "after each allocation added to a composition is carved",
    "recompose.before_commit": "the devices added are bound; the composition does not list them yet",
    "recompose.during_release": "after each device or allocation removed from a composition is released",
    "recompose.after_commit": "a recomposition is on disk; its answer is not yet recorded",
    "decompose.during_release": "after each device or allocation of a decomposing composition is released",
    "decompose.before_commit": "everything of a decomposing composition is released; it is not yet deleted",
    "heal.after_bind": "after each replacement of a healed composition's unhealthy device is bound",
    "heal.before_commit": "every replacement is bound; the composition does not list them yet",
    "heal.during_release": "after each unhealthy device (or a replacement undone) is unbound",
    "heal.after_commit": "the healed composition is on disk",
    "rollback.during_release": "after each step that the rollback of a failed compose, recompose or heal undoes",
    "recovery.during_release": "after each step that recovery undoes or finishes of a change a crash interrupted",
}
"""Every failpoint, with where it fires."""


def parse(value: str) -> dict[str, int]:
    """``NAME[@N],...`` to the hit count at which each fires; raises `ConfigError`."""
    armed: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, _, count = part.partition("@")
        if name not in FAILPOINTS:
            raise ConfigError(f"{ENV}: no failpoint {name!r} (known: {', '.join(FAILPOINTS)})", field=ENV)
        if count and not (count.isdigit() and int(count) > 0):
            raise ConfigError(f"{ENV}: {part!r}: the hit count after '@' must be a whole number above 0", field=ENV)
        armed[name] = int(count) if count else 1
    return armed


class Failpoints:
    def __init__(self, armed: Mapping[str, int]) -> None:
        self._armed = dict(armed)
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()

    def hit(self, name: str) -> None:
        """Kill this process here when ``name`` is armed and this is its chosen hit."""
        if name not in self._armed:
            return
        with self._lock:
            self._hits[name] = self._hits.get(name, 0) + 1
            if self._hits[name] != self._armed[name]:
                return
        sys.stderr.write(f"disagg: failpoint {name} hit: killing the process\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _from_env() -> tuple[Failpoints, ConfigError | None]:
    try:
        return Failpoints(parse(os.environ.get(ENV, ""))), None
    except ConfigError as exc:
        return Failpoints({}), exc


_active, _error = _from_env()


def check() -> None:
    """Raise the `ConfigError` of a bad ``DISAGG_FAILPOINTS``; every `disagg` command calls it before it starts."""
    if _error is not None:
        raise _error


hit = _active.hit
"""The failpoint ``name`` (one of `FAILPOINTS`) of this process: `Failpoints.hit` itself, as it is hit several
times in every Compose."""
