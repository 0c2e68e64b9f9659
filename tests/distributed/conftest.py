"""Fixtures of the distributed tests."""

from __future__ import annotations

import pytest
from _launch import free_port


@pytest.fixture
def world_of_one(monkeypatch):
    """This test process as the one rank of a group (gloo): a data-parallel Module's whole path, no peers."""
    pytest.importorskip("torch")
    from graphforge.distributed import World

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    world = World.join(timeout_s=30)
    yield world
    world.leave()
