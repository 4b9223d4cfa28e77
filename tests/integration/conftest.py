"""Fixtures shared by the integration tests."""

import pytest

from tests.distributed.workers.export_sources import ensure_sources, source_dir


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """Small trained and consolidated gpt / ascender / connection runs, made once per session
    (tests/distributed/workers/export_sources.py): the inputs of the export and evaluation tests."""
    return ensure_sources(source_dir(tmp_path_factory))
