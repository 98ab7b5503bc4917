"""Shared fixtures: paths to ../shared and hypothesis profiles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVTIER_SHARED", ROOT.parent / "shared"))

settings.register_profile(
    "ci", max_examples=60, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow", max_examples=2_000, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("KVTIER_HYPOTHESIS_PROFILE", "ci"))
#: The nightly profile: state machines, whose own settings fix their sizes, scale them up under it.
SLOW = os.environ.get("KVTIER_HYPOTHESIS_PROFILE") == "slow"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"../shared not found at {SHARED}; set KVTIER_SHARED")
    return SHARED
