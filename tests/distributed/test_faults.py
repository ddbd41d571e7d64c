"""Faults: every collective hfcp issues is bounded by hfcp.patch(..., timeout=...)."""
import pytest

import workers_faults as W
from hfcp.testing.dist_pool import DistPool


@pytest.fixture
def fresh_pool2():
    pool = DistPool(2)
    yield pool
    pool.close(kill=True)


def test_peer_that_never_arrives_raises_within_timeout(fresh_pool2):
    r = fresh_pool2.run(W.one_rank_skips_forward, 3.0, timeout=120, expect=[0])[0]  # rank 1 stays silent
    assert r["raised"] is not None, r
    # bounded by the 3 s timeout, not gloo's 30 min default; the upper bound is loose because a loaded machine
    # (CI shares its cores) can take seconds to schedule the raising thread
    assert 2.0 < r["after_s"] < 60.0, r
