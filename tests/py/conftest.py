"""Shared fixtures of the Python tests."""

from __future__ import annotations

import os
import zlib

import pytest

# Inductor's on-disk caches key a compiled graph by its code, not by the schemas of the gdn ops it
# calls, so code compiled against another gdn version would be reused: compile afresh.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@pytest.fixture
def gen(request):
    """A torch.Generator seeded from the test id (XOR GDN_TEST_SEED, default 0): fresh data for
    every test, reproducible run to run; set GDN_TEST_SEED to draw other data."""
    torch = pytest.importorskip("torch")
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("GDN_TEST_SEED", "0"))
    return torch.Generator().manual_seed(seed)
