"""The gpupool kernelspec and kernel provisioner, with real notebook kernels."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import sys
import time

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from gpupool.magics.kernel_provisioner import GPUPoolProvisioner, gpupool_command
from gpupool.magics.kernelspec import main as kernelspec_main
from gpupool.wire.leases import LeaseRequest
from frontend import ready_kernel
from procs import free_port

needs_service = pytest.mark.skipif(importlib.util.find_spec("gpupool.hub_plugin.app") is None,
                                   reason="gpupool service (hub_plugin/app.py) not built yet")


def install(tmp_path, url: str, token: str) -> KernelSpecManager:
    """``gpupool kernelspec install --prefix`` into tmp_path; a spec manager that sees only it."""
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    assert kernelspec_main(["install", "--prefix", str(tmp_path / "prefix"), "--url", url,
                            "--token-file", str(token_file)]) == 0
    return KernelSpecManager(kernel_dirs=[str(tmp_path / "prefix" / "share" / "jupyter" / "kernels")])


def run(km: KernelManager, code: str) -> str:
    """Run ``code`` in the kernel; return its stdout."""
    client = km.client()
    client.start_channels()
    out: list[str] = []
    try:
        client.wait_for_ready(timeout=30)
        reply = client.execute_interactive(
            code, timeout=30,
            output_hook=lambda msg: out.append(msg["content"]["text"]) if msg["msg_type"] == "stream" else None)
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out)


@pytest.fixture
def kernel_manager(tmp_path):
    """Start a KernelManager made by the test, ready; shut it down afterwards."""
    made: list[KernelManager] = []

    def make(spec_manager: KernelSpecManager) -> KernelManager:
        km, kc = ready_kernel(lambda: KernelManager(kernel_name="gpupool", kernel_spec_manager=spec_manager),
                              tmp_path / "kernel.log")
        kc.stop_channels()
        made.append(km)
        return km

    yield make
    for km in made:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def test_kernelspec_install_writes_provisioner_config_not_the_token(tmp_path, capsys):
    install(tmp_path, "http://pool:8765", "secret-user-token")
    out = capsys.readouterr().out
    assert "Installed kernelspec gpupool" in out and "warning" not in out
    spec_file = tmp_path / "prefix" / "share" / "jupyter" / "kernels" / "gpupool" / "kernel.json"
    text = spec_file.read_text()
    assert "secret-user-token" not in text
    spec = json.loads(text)
    assert spec["argv"] == [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec["display_name"] == "Python 3 (gpupool)"
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": "gpupool",
        "config": {"service_url": "http://pool:8765", "token_file": str((tmp_path / "token").resolve())}}


def test_kernelspec_install_is_readable_by_every_user(tmp_path, capsys):
    """As `jupyter kernelspec install` makes them: the folder 0755, its files 0644 (it was 0700, the
    temporary folder's mode, so root's --sys-prefix install was no kernel for anyone else)."""
    old_umask = os.umask(0o077)  # whatever the installing user's umask: the modes are set, not left to it
    try:
        install(tmp_path, "http://pool:8765", "secret-user-token")
    finally:
        os.umask(old_umask)
    capsys.readouterr()
    spec_dir = tmp_path / "prefix" / "share" / "jupyter" / "kernels" / "gpupool"
    assert stat.S_IMODE(spec_dir.stat().st_mode) == 0o755
    files = {path.name: stat.S_IMODE(path.stat().st_mode) for path in spec_dir.iterdir()}
    assert "kernel.json" in files and set(files.values()) == {0o644}, files


def test_kernelspec_install_warns_of_a_token_file_it_cannot_read(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "token"
    assert kernelspec_main(["install", "--prefix", str(tmp_path / "prefix"), "--url", "http://pool:8765",
                            "--token-file", str(missing)]) == 0  # it may come later: kernels read it at start
    assert f"warning: the token file {missing} cannot be read now" in capsys.readouterr().out


def test_kernelspec_help_and_bad_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        kernelspec_main(["install", "--help"])
    assert info.value.code == 0
    assert "--token-file" in capsys.readouterr().out
    from gpupool.errors import GPUPoolError

    with pytest.raises(GPUPoolError, match="may only hold"):
        kernelspec_main(["install", "--prefix", str(tmp_path), "--name", "../evil"])
    for url in ("notaurl", "127.0.0.1:8765", "ftp://pool:8765"):  # refused, not written over a good one
        with pytest.raises(GPUPoolError, match="is not a service URL; it should look like http://HOST:PORT"):
            kernelspec_main(["install", "--prefix", str(tmp_path), "--url", url])
    assert not (tmp_path / "share" / "jupyter" / "kernels" / "gpupool").exists()


def test_kernel_gets_its_id_url_token_and_magics(tmp_path, kernel_manager):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: releasing must not hang the shutdown
    km = kernel_manager(install(tmp_path, url, "user-token-1"))
    assert isinstance(km.provisioner, GPUPoolProvisioner)
    seen = json.loads(run(km, "import os, json\n"
                              "print(json.dumps({'env': {k: os.environ.get(k) for k in ('GPUPOOL_URL', 'GPUPOOL_TOKEN', 'GPUPOOL_KERNEL_ID')},"
                              " 'kernel': type(get_ipython().kernel).__name__,"
                              " 'app': type(get_ipython().kernel.parent).__name__,"
                              " 'threads': sorted(t.name for t in __import__('threading').enumerate()),"
                              " 'magics': 'gpu' in get_ipython().magics_manager.magics['line']}))"))
    assert seen["env"] == {"GPUPOOL_URL": url, "GPUPOOL_TOKEN": "user-token-1", "GPUPOOL_KERNEL_ID": km.kernel_id}
    assert seen["kernel"] == "GPUPoolKernel" and seen["magics"]
    # ipykernel's shell-channel thread only serves subshells, which the gpupool kernel has not.
    assert seen["app"] == "GPUPoolKernelApp" and "Shell channel" not in " ".join(seen["threads"]), seen
    started = time.monotonic()
    km.shutdown_kernel()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("cmd, expected", [
    (["py", "-m", "ipykernel_launcher", "-f", "c.json"], ["py", "-m", "gpupool.magics.kernelapp", "-f", "c.json"]),
    (["py", "-m", "ipykernel", "-f", "c.json"], ["py", "-m", "gpupool.magics.kernelapp", "-f", "c.json"]),
    (["launch-kernel", "-f", "c.json"], ["launch-kernel", "-f", "c.json",
                                         "--IPKernelApp.kernel_class=gpupool.magics.kernel.GPUPoolKernel",
                                         "--IPKernelApp.outstream_class=gpupool.magics.outstream.QuietOutStream"]),
    (["launch-kernel", "--IPKernelApp.kernel_class=my.Kernel"],
     ["launch-kernel", "--IPKernelApp.kernel_class=my.Kernel",
      "--IPKernelApp.outstream_class=gpupool.magics.outstream.QuietOutStream"]),
])
def test_the_kernel_command_runs_the_gpupool_kernel_app(cmd, expected):
    assert gpupool_command(cmd) == expected


# -- releasing leases with the real service ---------------------------------------------------------------------

def lease_for(service, kernel_id: str):
    client = service.client()
    lease = client.create_lease(LeaseRequest(fraction=0.25, kernel_id=kernel_id))
    lease = client.get_lease(lease.id, wait=30, state="starting")
    assert lease.state.value == "active", lease
    return lease


def state_of(service, lease_id: str):
    lease = service.client().get_lease(lease_id)
    return lease.state.value, lease.reason


@needs_service
def test_shutdown_restart_and_death_release_the_kernels_leases(tmp_path, pool, kernel_manager):
    service, _agent = pool
    km = kernel_manager(install(tmp_path, service.url, service.user_token))
    other = service.client().create_lease(LeaseRequest(fraction=0.25, kernel_id="another-kernel"))

    lease = lease_for(service, km.kernel_id)
    km.interrupt_kernel()  # SIGINT is not a release
    run(km, "pass")
    assert state_of(service, lease.id)[0] == "active"

    km.restart_kernel()
    state, reason = state_of(service, lease.id)
    assert state == "released" and "the notebook kernel restarted" in reason

    lease = lease_for(service, km.kernel_id)
    # died on its own: jupyter_client's restarter then calls restart_kernel(now=True)
    os.kill(km.provisioner.pid, signal.SIGKILL)
    km.restart_kernel(now=True)
    state, reason = state_of(service, lease.id)
    assert state == "released" and "the notebook kernel died" in reason

    lease = lease_for(service, km.kernel_id)
    km.shutdown_kernel()
    state, reason = state_of(service, lease.id)
    assert state == "released" and "the notebook kernel shut down" in reason

    assert state_of(service, other.id)[0] in ("starting", "active")  # only this kernel's leases
    service.client().release(other.id)
