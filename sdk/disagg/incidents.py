"""Incidents: an unexpected exception is logged once under a fresh id, and only the id travels on.

Exception text can carry paths, addresses or secrets, so callers (a gRPC client, the composer's caller) get
the incident id and the exception's type at most; the fabric manager's or driver's log has the rest.
"""

from __future__ import annotations

import logging
import uuid


def log_incident(logger: logging.Logger, exc: BaseException, what: str) -> str:
    """Log ``exc`` with its traceback as ``incident <id>: <what>`` and return the id (12 hex digits)."""
    incident = uuid.uuid4().hex[:12]
    logger.error("incident %s: %s", incident, what, exc_info=exc)
    return incident


def described(exc: BaseException) -> str:
    """``repr(exc)`` for a log line, or its type's name when that repr fails: an exception may hold an object whose
    repr asks the hardware that just failed, and the failure to describe it must not replace the failure itself."""
    try:
        return repr(exc)
    except Exception:
        return f"{type(exc).__name__} (whose repr failed)"
