"""The page at /services/gpupool/ in headless Chromium, under the real JupyterHub
of deploy/jupyterhub/: logging in through the hub (OAuth), an admin sees every
lease and everyone's usage and the quota table; bob sees only his own.
Screenshots go to test-artifacts/ (git-ignored)."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser import Browser, chromium_path

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = [
    pytest.mark.skipif(chromium_path() is None, reason="the page tests need Debian's chromium "
                       "(`apt-get install -y chromium`; `make install` does it as root)"),
    pytest.mark.timeout(180),
]

FACTS = """(() => {
  const rows = (id) => [...document.querySelectorAll(`#${id} tr.lease`)].map(r => r.dataset.owner);
  return {
    who: document.querySelector('#who').innerText,
    leases: rows('leases'),
    usage: [...document.querySelectorAll('.usage-user')].map(e => e.dataset.user),
    bars: document.querySelectorAll('rect.usage-bar').length,
    gpus: [...document.querySelectorAll('#gpus tr[data-gpu] td.alloc')].map(td => td.innerText),
    claimed: [...document.querySelectorAll('#gpus tr[data-gpu] td.claimed')].map(td => td.innerText),
    claimBars: document.querySelectorAll('#gpus span.bar span.claim').length,
    totals: document.querySelector('#totals').innerText,
    quotas: (document.querySelector('#quotas') || {innerText: ''}).innerText,
    parked: [...document.querySelectorAll('#leases tr.lease')].filter(r => r.querySelector('span.parked'))
      .map(r => r.dataset.owner + ': ' + r.querySelector('td.state').innerText),
    parkedNodes: (document.querySelector('#parked-nodes') || {innerText: ''}).innerText,
    workers: Object.fromEntries([...document.querySelectorAll('#leases tr.lease')]
      .map(r => [r.dataset.lease, r.querySelector('td.worker').innerText])),
  };
})()"""


def open_page_as(hub, user: str) -> Browser:
    """A fresh browser that opens the page and logs in as ``user`` at the hub's form."""
    browser = Browser()
    try:
        browser.goto(f"{hub.url}/services/gpupool/")
        browser.wait_until("!!document.querySelector('#username_input')", what="the hub's login form")
        browser.evaluate(f"document.querySelector('#username_input').value = {user!r};"
                         "document.querySelector('#password_input').value = 'any';"
                         "document.querySelector('#login_submit').click()")
        browser.wait_until("location.pathname === '/services/gpupool/' && !!document.querySelector('#who')",
                           what=f"the gpupool page for {user}")
    except BaseException:
        browser.close()
        raise
    return browser


def active_lease(hub, token: str, fraction: float) -> str:
    status, lease = hub.pool(token, "POST", "/leases", {"fraction": fraction})
    assert status == 201, lease
    status, lease = hub.pool(token, path=f"/leases/{lease['id']}?wait=30&state=starting")
    assert lease["state"] == "active", lease
    return lease["id"]


def test_admin_and_user_pages(jupyterhub):
    hub = jupyterhub
    ann, bob = hub.user_token("ann"), hub.user_token("bob")
    used = active_lease(hub, bob, 0.25)
    assert hub.pool(bob, "DELETE", f"/leases/{used}")[1]["usage_gpu_seconds"] > 0
    held = [active_lease(hub, ann, 0.5), active_lease(hub, bob, 0.25)]
    try:
        for token, lease_id in ((ann, held[0]), (bob, held[1])):  # no kernel heartbeats these
            hub.pool(token, "POST", f"/leases/{lease_id}/heartbeat", {})
        status, parked = hub.pool(bob, "POST", f"/leases/{held[1]}/park", {})  # bob's: parked in place
        assert (status, parked["state"], parked["parked"]["tier"]) == (200, "parked", "memory"), parked
        with open_page_as(hub, "admin") as browser:
            facts = browser.evaluate(FACTS)
            browser.screenshot(ARTIFACTS / "admin-page-admin.png")
        assert "Signed in as admin (pool admin" in facts["who"] and "gpu-admins" in facts["who"]
        assert sorted(facts["leases"]) == ["ann", "bob"]
        assert sorted(facts["usage"]) == ["ann", "bob"] and facts["bars"] >= 2
        assert sorted(facts["gpus"]) == ["0.00", "0.50"], "the parked lease's share is back in the pool"
        assert sorted(facts["claimed"]) == ["", "0.25 (1 parked lease)"], "and claimed there for its resume"
        assert facts["claimBars"] == 1
        assert "0.25 of the pool claimed by parked leases" in facts["totals"], facts["totals"]
        [row] = facts["parked"]
        assert row.startswith("bob: parked (in memory, ") and "of host RAM" in row, row
        assert facts["workers"][held[1]] == "-", "its worker is frozen, as gpupool status shows it, not idle"
        assert "1 lease, " in facts["parkedNodes"] and "simulated" in facts["parkedNodes"], facts["parkedNodes"]
        assert "group:physics" in facts["quotas"] and "everyone (default)" in facts["quotas"]

        with open_page_as(hub, "bob") as browser:
            facts = browser.evaluate(FACTS)
            browser.screenshot(ARTIFACTS / "admin-page-bob.png")
        assert "Signed in as bob (your own" in facts["who"] and "chemistry" in facts["who"]
        assert facts["leases"] == ["bob"]
        assert facts["usage"] == ["bob"]
        assert "group:physics" not in facts["quotas"] and "max_gpus" in facts["quotas"]
        assert "8.0 GPU-hours" in facts["quotas"] and "86400" not in facts["quotas"], "in the CLI's words"
    finally:
        for token, lease_id in ((ann, held[0]), (bob, held[1])):
            hub.pool(token, "DELETE", f"/leases/{lease_id}")
