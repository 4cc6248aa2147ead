"""Shared test settings: Hypothesis runs without deadlines so that a slow CI machine does not flake."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "disagg",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("disagg")
