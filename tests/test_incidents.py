"""The incident helper that every error edge uses for exceptions that are not SDK errors."""

from __future__ import annotations

import logging
import re

import pytest
from disagg.incidents import log_incident


class TestLogIncident:
    """An unexpected exception is logged with its traceback under a fresh id, and only the id is returned."""

    def test_logs_the_exception_under_the_returned_id(self, caplog: pytest.LogCaptureFixture) -> None:
        logger = logging.getLogger("disagg.test")
        error = RuntimeError("secret path /etc/x")
        with caplog.at_level(logging.ERROR, logger="disagg.test"):
            incident = log_incident(logger, error, "Compose failed unexpectedly")
        assert re.fullmatch(r"[0-9a-f]{12}", incident)
        (record,) = caplog.records
        assert record.getMessage() == f"incident {incident}: Compose failed unexpectedly"
        assert record.exc_info is not None and record.exc_info[1] is error
        assert "secret path" not in incident

    def test_every_incident_gets_its_own_id(self) -> None:
        logger = logging.getLogger("disagg.test.quiet")
        logger.propagate = False
        try:
            ids = {log_incident(logger, ValueError("x"), "boom") for _ in range(50)}
        finally:
            logger.propagate = True
        assert len(ids) == 50
