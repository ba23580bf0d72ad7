"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys

import pytest

# The tests import the package from the checkout and the harness module next to this file,
# also in the rank processes spawned by the harness (they inherit sys.path).
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_TESTS), _TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tp_harness import RankPools  # noqa: E402


@pytest.fixture(scope="session")
def tp_pool():
    """`tp_pool(world_size)` -> a `RankPool` of gloo ranks, spawned once per session.

    `tp_pool(2).run(fn, *args)` calls the module-level `fn(rank, world_size, *args)` on every
    rank (with megatron's parallel_state set up for TP = world size) and returns the list
    of per-rank results; an exception on any rank fails the test with its traceback.
    """
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()
