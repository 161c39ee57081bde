"""Shared fixtures: a throwaway PKI, and logging set back after each test."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from tests.support.pki import PkiFiles, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """A test that runs a program's ``main`` in-process (the CLI, say) configures logging onto the
    stderr of the moment, pytest's capture file, which is closed after the test: later tests would
    log into a closed file. Logging is set back to what it was before the test."""
    structlog_config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**structlog_config)
    root.handlers[:] = handlers
    root.setLevel(level)
