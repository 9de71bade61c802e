"""Fixtures for the store: a fresh PostgreSQL database per test (registered
for every test by the root conftest's ``pytest_plugins``)."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any, Awaitable, Callable

import pytest


def in_pool(store, body: Callable[[Any], Awaitable[Any]], now: Callable[[], Any], settings=None) -> Any:
    """Run ``body(pool)`` (a coroutine function) on the service's :class:`Pool` over ``store`` with
    the clock ``now`` and ``settings`` (default: workers stopped within 2 s, nodes never lost by
    silence), its agents reached with a test token; returns what ``body`` returns."""
    from gpupool.hub_plugin.agent_client import AgentClient
    from gpupool.hub_plugin.config import PoolNodes, ServiceSettings
    from gpupool.hub_plugin.pool import Pool

    async def run():
        agents = AgentClient("agent-token")
        pool = Pool(settings or ServiceSettings(nodes=PoolNodes(worker_stop_timeout=2.0, node_ttl=3600)), store,
                    agents, now=now)
        try:
            return await body(pool)
        finally:
            await pool.shutdown()
            agents.close()
            pool.state.work.close()

    return asyncio.run(run())


@pytest.fixture
def postgres_url():
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    base = os.environ.get("GPUPOOL_TEST_POSTGRES_URL")
    required = os.environ.get("GPUPOOL_REQUIRE_POSTGRES") == "1"
    if not base:
        if required:
            pytest.fail("GPUPOOL_REQUIRE_POSTGRES=1 but GPUPOOL_TEST_POSTGRES_URL is not set")
        pytest.skip("PostgreSQL tests need GPUPOOL_TEST_POSTGRES_URL "
                    "(e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test)")
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(base)
    admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
    name = "gpupool_test_" + uuid.uuid4().hex[:12]
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        if required:
            raise
        pytest.skip(f"PostgreSQL at {url.render_as_string(hide_password=True)} is unreachable: {exc}")
    yield url.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """The store's URL: SQLite in ``tmp_path``, then a fresh PostgreSQL database (:func:`postgres_url`)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.sqlite"
    return request.getfixturevalue("postgres_url")
