"""What `disagg certify`, the suite's fixtures and its pytest plugin share through ``config.stash``.

Kept apart from the plugin and the test classes so that certify can set them up before pytest imports (and
rewrites the assertions of) those modules.
"""

from __future__ import annotations

import attrs
import pytest

from disagg.model import Capabilities
from disagg.testing.harness import (
    BUILD_TIMEOUT_S,
    RESTART_TIMEOUT_S,
    Epochs,
    FabricFactory,
    Leftover,
    Restart,
    Watchdog,
)
from disagg.testing.report import Report, Subject

EPOCHS = pytest.StashKey[Epochs]()
LEFTOVERS = pytest.StashKey[list[Leftover]]()
WATCHDOG = pytest.StashKey[Watchdog]()
"""The run's watchdog: what it abandoned makes the later tests of that driver NOT TESTED."""
SEEN_CAPABILITIES = pytest.StashKey[list[tuple[str, Capabilities]]]()
"""The fabric name and capabilities each test found, for a report that no `disagg certify` names."""
SUBJECT = pytest.StashKey[Subject]()
"""Set by `disagg certify` to name what is certified."""
REPORT = pytest.StashKey[Report]()
"""The report of the session, once it has finished."""


@attrs.frozen
class Target:
    """The fabric under certification: how to build it, and how to restart its driver (None: certify cannot)."""

    factory: FabricFactory
    restart: Restart | None
    no_restart_reason: str = ""
    call_timeout_s: float = 30.0
    """Each driver call's time limit (certify's ``--config``)."""
    build_timeout_s: float = BUILD_TIMEOUT_S
    """How long building the fabric may take (certify's ``--config``)."""
    restart_timeout_s: float = RESTART_TIMEOUT_S
    """How long restarting the driver may take (certify's ``--config``)."""


TARGET = pytest.StashKey[Target]()
