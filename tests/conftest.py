"""Shared fixtures: a throwaway PKI and the CI rule for missing prerequisites."""

from __future__ import annotations

import pytest

from tests.support.pki import PkiFiles, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_pki(tmp_path_factory.mktemp("pki"))
