"""The gpupool service down while a notebook is attached: the notebook is told once, in the cell
that runs then, and once more when the service answers again (atop the next cell); gpupool's log lines go to the kernel
process's stderr (the Jupyter server's log), never into a cell, though ipykernel sends what the
process writes to its stderr into the cells under Jupyter. A real service (stopped, then started
again on its port and store), agent and gpupool kernel, started as Jupyter starts it."""

from __future__ import annotations

import time

import pytest
from frontend import install_kernelspec, run, start_gpupool_kernel
from procs import start_agent, start_service

pytestmark = pytest.mark.timeout(240)


def test_a_service_outage_is_said_once_and_its_end_once_and_no_log_line_reaches_a_cell(tmp_path):
    config = {"heartbeat_ttl": 30.0}  # beats every 10 s, every 2 s while a cell runs
    svc = start_service(tmp_path, config=config)
    agent = start_agent(tmp_path, svc)
    kernels = install_kernelspec(tmp_path / "prefix", svc.url, svc.user_token)
    km, kc = start_gpupool_kernel(kernels, tmp_path, as_in_jupyter=True)
    try:
        assert run(kc, "%gpu acquire 0.25").ok
        port = int(svc.url.rsplit(":", 1)[1])
        svc.stop()
        down = run(kc, "import time\nfor _ in range(7): time.sleep(1)\nprint('ran')", timeout=60)
        text = down.text()
        assert down.ok and "ran" in down.stdout, text
        assert text.count("the gpupool service cannot be reached") == 1, text
        assert "[gpupool" not in text, "log lines stay out of the cell"
        log = kernels.parent / "gpupool-kernels.log"
        assert "[gpupool WARNING" in log.read_text() and "heartbeat for L-" in log.read_text()

        svc = start_service(tmp_path, config=config, port=port, tokens={"tester": svc.user_token})
        time.sleep(11)  # an idle beat reaches it: said atop the next cell
        back = run(kc, "print('again')", timeout=60)
        text = back.text()
        assert back.ok and "again" in back.stdout, text
        assert text.count("the gpupool service answers again") == 1 and "is kept" in text, text
        assert "cannot be reached" not in text and "[gpupool" not in text, text
        time.sleep(0.5)
        assert run(kc, "%gpu release --discard").ok
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        agent.stop()
        svc.stop()


def test_an_outage_that_ended_before_the_next_cell_is_said_as_over_only(tmp_path):
    """The service down while the notebook is idle (an idle beat fails: the notice waits for the
    next cell), then back before that cell: the cell says it answers again, not that it cannot be
    reached (its heartbeat beats again before the notice is said)."""
    config = {"heartbeat_ttl": 30.0}  # beats every 10 s
    svc = start_service(tmp_path, config=config)
    agent = start_agent(tmp_path, svc)
    kernels = install_kernelspec(tmp_path / "prefix", svc.url, svc.user_token)
    km, kc = start_gpupool_kernel(kernels, tmp_path, as_in_jupyter=True)
    try:
        assert run(kc, "%gpu acquire 0.25").ok
        port = int(svc.url.rsplit(":", 1)[1])
        svc.stop()
        time.sleep(11)  # an idle beat fails
        svc = start_service(tmp_path, config=config, port=port, tokens={"tester": svc.user_token})
        back = run(kc, "print('again')", timeout=60)
        text = back.text()
        assert back.ok and "again" in back.stdout, text
        assert "cannot be reached" not in text, text
        assert text.count("the gpupool service answers again") == 1 and "is kept" in text, text
        assert run(kc, "%gpu release --discard").ok
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        agent.stop()
        svc.stop()
