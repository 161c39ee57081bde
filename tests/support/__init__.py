"""Helpers shared by the test layers (import as ``tests.support.*``)."""

from __future__ import annotations

import os

import pytest


def require(available: bool, what: str) -> None:
    """Skip on a laptop, fail under CI (``CI=true``), when a test prerequisite is missing."""
    if available:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"prerequisite missing under CI=true: {what}")
    pytest.skip(f"prerequisite missing: {what}")
