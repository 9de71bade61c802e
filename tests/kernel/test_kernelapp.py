"""gpupool's kernel applications (gpupool.kernelapp) when a port they were
given is taken: they exit with ZMQ's words, so that whoever started them
(Jupyter Server's restarter, the agent) starts them again with new ports.
ipykernel 7.4's own application hangs there instead."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from jupyter_client.connect import write_connection_file

APPS = ("gpupool.kernelapp", "gpupool.magics.kernelapp")  # a worker, the notebook kernel


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("channel", ["shell", "control", "iopub"])
def test_a_kernel_whose_port_is_taken_exits_with_zmqs_words(tmp_path, app, channel):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"), ip="127.0.0.1",
                                                   **{f"{channel}_port": port})
        try:
            done = subprocess.run([sys.executable, "-m", app, "-f", connection_file], capture_output=True,
                                  text=True, timeout=30, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{app} hung on a taken {channel} port instead of exiting")
    assert done.returncode == 1
    assert f"Address already in use (addr='tcp://127.0.0.1:{port}')" in done.stderr
