"""Leases remember the JupyterHub server they came from, and the hub's
``post_stop_hook`` releases only the stopped server's leases.

A real JupyterHub (tests/support/hubprocs.py, named servers allowed): admin runs the
default server and a named server ``two``; ``%gpu acquire`` in a kernel of
``two`` records ``server_name: "two"``. Stopping ``two`` releases its leases
and keeps those of the default server and of no known server; stopping the
last server releases the rest. Also: the ``server_name`` field's validation,
and revision 0003 applied to a store at 0002 on SQLite and PostgreSQL.
"""

from __future__ import annotations


import pytest

from hubprocs import ok, open_kernel
from gpupool.demo_pool import wait_for
from gpupool.wire.leases import LeaseRequest

pytestmark = pytest.mark.timeout(300)

USER = "admin"  # ann and bob belong to test_hub_e2e; admin's quota (2 GPUs) holds all four leases
STOPPED = "the Jupyter server stopped"


# -- validation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [5, "x" * 256, "a\x00b", "tab\there", ["two"]])
def test_bad_server_names_are_refused(value):
    from gpupool.errors import GPUPoolError

    with pytest.raises(GPUPoolError) as refused:
        LeaseRequest.from_json({"fraction": 0.5, "server_name": value})
    assert refused.value.status == 400 and "'server_name'" in refused.value.message


@pytest.mark.parametrize("value", ["", "two", "x" * 255, "GPU-lab é"])
def test_server_names_are_kept(value):
    request = LeaseRequest.from_json({"fraction": 0.5, "server_name": value})
    assert request.server_name == value and request.to_json()["server_name"] == value


# -- the migration ---------------------------------------------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.sqlite"
    return request.getfixturevalue("postgres_url")


def test_revision_0003_adds_server_name_and_keeps_leases(store_url):
    from sqlalchemy import inspect, text

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.migrations import upgrade
    from gpupool.hub_plugin.models import Lease

    store = Store(store_url)
    try:
        with store.engine.begin() as connection:
            upgrade(connection, "0002")
            connection.execute(text(
                "INSERT INTO leases (id, owner, state, fraction, gpu_count, memory, idle_timeout, heartbeat_ttl, "
                "created_at, usage_gpu_seconds) VALUES ('L-000000000001', 'ann', 'active', 0.5, 1, 1024, 60, 60, "
                "'2026-11-29 12:00:00', 0)"))
        assert "server_name" not in {c["name"] for c in inspect(store.engine).get_columns("leases")}
        store.migrate()
        with store.engine.connect() as connection:
            assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar() >= "0003"
        with store.write() as session:
            old = session.get(Lease, "L-000000000001")
            assert (old.owner, old.fraction, old.server_name) == ("ann", 0.5, None)
            old.server_name = "two"
        with store.read() as session:
            assert session.get(Lease, "L-000000000001").server_name == "two"
    finally:
        store.close()


# -- a real JupyterHub with two servers of one user ------------------------------------------------------------------

def start_named(hub, user: str, name: str) -> None:
    path = f"/users/{user}/servers/{name}" if name else f"/users/{user}/server"
    status, body = hub.api("POST", path)
    assert status in (201, 202), (status, body)


def server_model(hub, user: str, name: str) -> dict | None:
    _, model = hub.api("GET", f"/users/{user}")
    return (model.get("servers") or {}).get(name)


def stops_logged(hub, user: str, name: str) -> int:
    """How many times the hub logged the service's answer to the post_stop_hook
    for ``user``'s server ``name`` (logged once the releases are done)."""
    done = "gpupool: released "
    tail = f" of {user} whose server {name!r} stopped"
    return sum(done in line and line.endswith(tail) for line in hub.log.read_text(errors="replace").splitlines())


def stop_named(hub, user: str, name: str, stops_before: int) -> None:
    """Stop ``user``'s server ``name`` and wait until the service answered its post_stop_hook."""
    path = f"/users/{user}/servers/{name}" if name else f"/users/{user}/server"
    status, body = hub.api("DELETE", path)
    assert status in (202, 204), (status, body)
    wait_for(lambda: stops_logged(hub, user, name) > stops_before, 90, f"the post_stop_hook for {user}'s server {name!r}", hub.proc, hub.log)
    wait_for(lambda: server_model(hub, user, name) is None, 60, f"{user}'s server {name!r} to stop",
             hub.proc, hub.log)


def states(hub, token: str) -> dict[str, dict]:
    status, body = hub.pool(token, path="/leases?active=0")
    assert status == 200, body
    return {lease["id"]: lease for lease in body["leases"]}


def test_stopping_one_server_releases_only_its_leases(jupyterhub):
    hub = jupyterhub
    token = hub.user_token(USER)
    start_named(hub, USER, "")
    start_named(hub, USER, "two")
    for name in ("", "two"):
        wait_for(lambda: (server_model(hub, USER, name) or {}).get("ready"), 90, f"{USER}'s server {name!r}",
                 hub.proc, hub.log)

    # %gpu acquire in a kernel of server "two" names that server (from JUPYTERHUB_SERVER_NAME).
    kc = open_kernel(hub, USER, token, server="two")
    try:
        assert ok(kc, "import os; print(repr(os.environ['JUPYTERHUB_SERVER_NAME']))").strip() == "'two'"
        out = ok(kc, "%gpu acquire 0.25")
        assert "gpupool: attached L-" in out, out
        attached = out.split("attached ")[1].split(":")[0]
    finally:
        kc.stop_channels()
    assert states(hub, token)[attached]["server_name"] == "two"

    # Leases no kernel owns (so only the hook can end them): of each server, and of no known one.
    made = {}
    for key, extra in (("default", {"server_name": ""}), ("two", {"server_name": "two"}), ("unknown", {})):
        status, lease = hub.pool(token, "POST", "/leases", {"fraction": 0.25, **extra})
        assert status == 201, lease
        made[key] = lease["id"]
    seen = states(hub, token)
    assert [seen[made[k]]["server_name"] for k in ("default", "two", "unknown")] == ["", "two", None]

    def renew() -> None:  # the heartbeat TTL must not end any of them first
        for lease_id in made.values():
            assert hub.pool(token, "POST", f"/leases/{lease_id}/heartbeat", {})[0] == 200

    for lease_id in made.values():  # placed and started before any server stops
        status, lease = hub.pool(token, path=f"/leases/{lease_id}?wait=30&state=starting")
        assert lease["state"] == "active", lease
    status, parked = hub.pool(token, "POST", f"/leases/{made['two']}/park", {})  # a parked one goes too
    assert (status, parked["state"]) == (200, "parked"), parked
    stops = {name: stops_logged(hub, USER, name) for name in ("", "two")}
    renew()
    stop_named(hub, USER, "two", stops["two"])
    after = states(hub, token)
    assert after[made["two"]]["state"] == "released" and after[made["two"]]["reason"] == STOPPED
    assert after[attached]["state"] == "released"  # by its kernel's provisioner or by the hook
    assert {after[made[k]]["state"] for k in ("default", "unknown")} == {"active"}, after

    # The last server stopping releases the rest, also the lease of no known server.
    renew()
    stop_named(hub, USER, "", stops[""])
    after = states(hub, token)
    for key in ("default", "unknown"):
        assert (after[made[key]]["state"], after[made[key]]["reason"]) == ("released", STOPPED), after[made[key]]



def test_a_hub_shutting_down_says_its_servers_leases_end_by_their_ttl_without_a_warning(tmp_path):
    """JupyterHub stops its managed services (gpupool's) before the user servers it cleans up: the
    hook cannot reach the service then, and says so in an info line, not a warning."""
    import hubprocs

    why = hubprocs.missing()
    if why:
        pytest.skip(why)
    hub = hubprocs.start_hub(tmp_path, servers=(USER,))
    try:
        hub.wait_server(USER)
    finally:
        hub.stop()
    log = hub.log.read_text(errors="replace")
    assert "Cleaning up single-user servers" in log, log[-3000:]
    assert f"gpupool: {USER}'s server stopped as the hub shuts down, after the gpupool service" in log, log[-3000:]
    assert "could not tell the service" not in log, log[-3000:]
