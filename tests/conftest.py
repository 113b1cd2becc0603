"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def monkeypatch_module():
    """A monkeypatch undone when the module's tests end: a module fixture that sets an
    environment variable (SHARDLAB_CACHE) must not leak it into the next test file that the
    same pytest worker runs."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp
