"""Tests on real Kubernetes nodes (``-m platform``; see tests/support/platform_layer.py)."""

from tests.support.platform_layer import *  # noqa: F403
