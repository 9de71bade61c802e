"""gpupool under a real JupyterHub: deploy/jupyterhub/jupyterhub_config.py with
configurable-http-proxy and real single-user servers, whose gpupool kernels
reach the pool with the server's own JUPYTERHUB_API_TOKEN.

ann (group physics, limit 1.0 GPU) and bob (chemistry, default 0.5) start
servers; their kernels acquire within and beyond their quotas; neither can
see or release the other's lease; usage is recorded; stopping ann's server
releases her leases, also one no kernel would release (the post_stop_hook).
"""

from __future__ import annotations

import json

import pytest

from hubprocs import http, ok, open_kernel

pytestmark = pytest.mark.timeout(240)

NEW_LEASE = """
from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.wire.leases import LeaseRequest
client = ServiceClient.from_env()
def try_lease(fraction):
    try:
        print("LEASE", client.create_lease(LeaseRequest(fraction=fraction)).id)
    except GPUPoolError as exc:
        print("REFUSED", exc.code, exc.message)
"""


def lease_ids(stdout, word="LEASE"):
    return [line.split()[1] for line in stdout.splitlines() if line.startswith(word)]


def test_two_users_quotas_isolation_usage_and_server_stop(jupyterhub):
    hub = jupyterhub
    ann, bob, admin = (hub.user_token(u) for u in ("ann", "bob", "admin"))
    hub.wait_server("ann")  # the fixture asked for both servers
    hub.wait_server("bob")
    ann_kc, bob_kc = open_kernel(hub, "ann", ann), open_kernel(hub, "bob", bob)
    try:
        # The kernel got the service URL and the server's token from the hub, not from us.
        env = ok(ann_kc, "import os; print(os.environ['GPUPOOL_URL'], bool(os.environ.get('JUPYTERHUB_API_TOKEN')))")
        assert env.split() == [f"http://127.0.0.1:{_service_port(hub)}/services/gpupool", "True"]

        # ann (physics, 1.0): a lease no kernel owns, then %gpu acquire, then one too many.
        extra = lease_ids(ok(ann_kc, NEW_LEASE + "try_lease(0.25)"))[0]
        out = ok(ann_kc, "%gpu acquire 0.5")
        assert "gpupool: attached L-" in out, out
        ann_attached = out.split("attached ")[1].split(":")[0]
        refused = ok(ann_kc, "%%local\ntry_lease(0.5)")
        assert "REFUSED quota_exceeded" in refused and "0.75" in refused, refused

        # bob (chemistry, default 0.5): within, then beyond his quota.
        out = ok(bob_kc, "%gpu acquire 0.5")
        assert "gpupool: attached L-" in out, out
        bob_lease = out.split("attached ")[1].split(":")[0]
        refused = ok(bob_kc, "%%local\n" + NEW_LEASE + "try_lease(0.25)")
        assert "REFUSED quota_exceeded" in refused, refused

        # Neither sees nor releases the other's lease: 404 from the kernel and from the API.
        probe = ok(bob_kc, "%%local\n" + "\n".join(
            f"try:\n    client.{call}\nexcept GPUPoolError as exc:\n    print('DENIED', exc.status, exc.code)"
            for call in (f"get_lease({ann_attached!r})", f"release({extra!r})")))
        assert probe.split("\n")[:2] == ["DENIED 404 not_found", "DENIED 404 not_found"], probe
        status, mine = hub.pool(bob, path="/leases")
        assert status == 200 and [lease["id"] for lease in mine["leases"]] == [bob_lease]
        assert hub.pool(bob, "DELETE", f"/leases/{extra}")[0] == 404
        # The pool admin sees everyone's.
        assert hub.pool(admin, path=f"/leases/{ann_attached}")[1]["owner"] == "ann"

        # Groups came from the hub; usage is recorded when bob releases.
        assert hub.pool(ann, path="/quota")[1]["groups"] == ["physics"]
        out = ok(bob_kc, "%gpu release")
        assert f"released {bob_lease}" in out, out
        ended = hub.pool(bob, path=f"/leases/{bob_lease}")[1]
        assert ended["state"] == "released" and ended["usage_gpu_seconds"] > 0, ended

        # Metrics through the proxy at /services/gpupool/metrics.
        status, text = http("GET", f"{hub.url}/services/gpupool/metrics", token=admin)
        assert status == 200 and 'gpupool_leases{state="active"}' in text
    finally:
        ann_kc.stop_channels()
        bob_kc.stop_channels()

    # No kernel heartbeats the extra lease: renew it, so that the heartbeat TTL cannot end it first.
    assert hub.pool(ann, "POST", f"/leases/{extra}/heartbeat", {})[0] == 200
    # Stopping ann's server ends both her leases: the kernel's by its provisioner
    # (or the hook), the one no kernel owns by the post_stop_hook.
    hub.stop_server("ann")
    status, body = hub.pool(ann, path="/leases?active=0")
    by_id = {lease["id"]: lease for lease in body["leases"]}
    assert by_id[ann_attached]["state"] == "released", by_id[ann_attached]
    assert by_id[extra]["state"] == "released" and "the Jupyter server stopped" in by_id[extra]["reason"]
    hub.stop_server("bob")


def _service_port(hub) -> int:
    return json.loads((hub.state / "pool" / "service.json").read_text())["url"].rsplit(":", 1)[1]
