"""Tests on real Kubernetes nodes (``-m platform``; see tests/support/platform.py)."""

from tests.support.platform import *  # noqa: F403
