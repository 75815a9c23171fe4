"""Shared fixtures of the Python tests."""

from __future__ import annotations

import os
import zlib

import pytest


@pytest.fixture
def gen(request):
    """A torch.Generator seeded from the test id (XOR GDN_TEST_SEED, default 0): fresh data for
    every test, reproducible run to run; set GDN_TEST_SEED to draw other data."""
    torch = pytest.importorskip("torch")
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("GDN_TEST_SEED", "0"))
    return torch.Generator().manual_seed(seed)
