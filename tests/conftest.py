"""Shared fixtures: a throwaway PKI, and logging set back after each test; Ctrl-C that stops the run;
the signal that a run's prerequisites are built."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Ctrl-C stops the run. Inside a trio test the KeyboardInterrupt reaches pytest wrapped in an
    exception group, which pytest takes for one failed test, and it went on with the next."""
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, BaseExceptionGroup) and error.subgroup(KeyboardInterrupt) is not None:
        item.session.shouldstop = "interrupted (Ctrl-C)"
    return report


PREPARED_ENV = "CLUSTER_PROXY_TESTS_PREPARED"


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Touch the file ``$CLUSTER_PROXY_TESTS_PREPARED`` names, if set, once the other conftests have
    built what this run needs (etcd and kube-apiserver, the images): scripts/test-slow.sh starts its
    clock-bound lane then, so that a cold build does not starve tests that keep time."""
    if marker := os.environ.get(PREPARED_ENV):
        Path(marker).touch()
