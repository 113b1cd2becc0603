"""Fixtures shared by the test files."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture(scope="module")
def spawned() -> Callable[..., list[Any]]:
    """`spawned(fn, world)`: `run_workers(world, fn)`'s per-rank results, spawned once per (fn, world)
    for the whole test module. A parity file runs all its cases in one spawn per world size (process
    start-up dominates) and still gives every case its own test, which asserts that case's result:
    `-k` selects one and a failure hides none of the others. A spawn that failed is not retried:
    the first of its tests shows the error, the others fail at once naming it."""
    from shardlab.testing import run_workers

    done: dict[tuple, Any] = {}

    def get(fn: Callable, world: int, **kwargs: Any) -> list[Any]:
        key = (fn, world, *sorted(kwargs.items()))
        if key in done and isinstance(done[key], BaseException):
            pytest.fail(f"{fn.__name__} on {world} rank(s) failed in an earlier test of this module: "
                        f"{type(done[key]).__name__}: {str(done[key])[:2000]}")
        if key not in done:
            try:
                done[key] = run_workers(world, fn, **kwargs)
            except Exception as e:
                done[key] = e
                raise
        return done[key]

    return get


@pytest.fixture(scope="module")
def monkeypatch_module():
    """A monkeypatch undone when the module's tests end: a module fixture that sets an
    environment variable (SHARDLAB_CACHE) must not leak it into the next test file that the
    same pytest worker runs."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp
