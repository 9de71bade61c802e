"""The gpupool service down while a notebook is attached: the notebook is told once, in the cell
that runs then, and once more when the service answers again (atop the next cell); gpupool's log lines go to the kernel
process's stderr (the Jupyter server's log), never into a cell, though ipykernel sends what the
process writes to its stderr into the cells under Jupyter. A real service (stopped, then started
again on its port and store), agent and gpupool kernel, started as Jupyter starts it."""

from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from frontend import install_kernelspec, run, start_gpupool_kernel
from procs import start_agent, start_service

pytestmark = pytest.mark.timeout(240)


#: Heartbeats every 10 s, every 2 s while a cell runs.
CONFIG = {"heartbeat_ttl": 30.0}


@contextmanager
def attached(tmp_path):
    """A service, an agent and a gpupool kernel attached to a lease (as Jupyter starts it): a namespace
    with ``svc`` (which :func:`restart` replaces), ``agent``, ``kernels``, ``km`` and ``kc``."""
    pool = SimpleNamespace(svc=start_service(tmp_path, config=CONFIG))
    pool.agent = start_agent(tmp_path, pool.svc)
    pool.kernels = install_kernelspec(tmp_path / "prefix", pool.svc.url, pool.svc.user_token)
    pool.km, pool.kc = start_gpupool_kernel(pool.kernels, tmp_path, as_in_jupyter=True)
    try:
        assert run(pool.kc, "%gpu acquire 0.25").ok
        yield pool
        assert run(pool.kc, "%gpu release --discard").ok
    finally:
        pool.kc.stop_channels()
        pool.km.shutdown_kernel(now=True)
        pool.agent.stop()
        pool.svc.stop()


def restart(pool, tmp_path) -> None:
    """Start the service again on its port and store, after ``pool.svc.stop()``."""
    port = int(pool.svc.url.rsplit(":", 1)[1])
    pool.svc = start_service(tmp_path, config=CONFIG, port=port, tokens={"tester": pool.svc.user_token})


def test_a_service_outage_is_said_once_and_its_end_once_and_no_log_line_reaches_a_cell(tmp_path):
    with attached(tmp_path) as pool:
        kc = pool.kc
        pool.svc.stop()
        down = run(kc, "import time\nfor _ in range(7): time.sleep(1)\nprint('ran')", timeout=60)
        text = down.text()
        assert down.ok and "ran" in down.stdout, text
        assert text.count("the gpupool service cannot be reached") == 1, text
        assert "[gpupool" not in text, "log lines stay out of the cell"
        log = pool.kernels.parent / "gpupool-kernels.log"
        assert "[gpupool WARNING" in log.read_text() and "heartbeat for L-" in log.read_text()

        restart(pool, tmp_path)
        time.sleep(11)  # an idle beat reaches it: said atop the next cell
        back = run(kc, "print('again')", timeout=60)
        text = back.text()
        assert back.ok and "again" in back.stdout, text
        assert text.count("the gpupool service answers again") == 1 and "is kept" in text, text
        assert "cannot be reached" not in text and "[gpupool" not in text, text
        time.sleep(0.5)


def test_an_outage_that_ended_before_the_next_cell_is_said_as_over_only(tmp_path):
    """The service down while the notebook is idle (an idle beat fails: the notice waits for the
    next cell), then back before that cell: the cell says it answers again, not that it cannot be
    reached (its heartbeat beats again before the notice is said)."""
    with attached(tmp_path) as pool:
        pool.svc.stop()
        time.sleep(11)  # an idle beat fails
        restart(pool, tmp_path)
        back = run(pool.kc, "print('again')", timeout=60)
        text = back.text()
        assert back.ok and "again" in back.stdout, text
        assert "cannot be reached" not in text, text
        assert text.count("the gpupool service answers again") == 1 and "is kept" in text, text
