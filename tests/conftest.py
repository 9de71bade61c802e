"""Fixtures named for what they give: a running pool service and agents."""

from __future__ import annotations

import pytest

from procs import start_agent, start_service


@pytest.fixture
def service(tmp_path):
    """A fresh ``gpupool service`` (SQLite under tmp_path), stopped after the test."""
    svc = start_service(tmp_path)
    yield svc
    svc.stop()


@pytest.fixture
def agent(tmp_path, service):
    """One agent with two simulated A100-80GB GPUs registered with ``service``."""
    node = start_agent(tmp_path, service)
    yield node
    node.stop()


@pytest.fixture
def pool(service, agent):
    """A ready pool: ``(service, agent)``."""
    return service, agent
