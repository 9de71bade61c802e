"""Rehearsal of deploy/systemd/README.md, "Three GPU hosts and a hub", in network namespaces
(tests/support/netns.py): the service on host ``svc`` and two agents on ``gpu1`` and ``gpu2``, started
with the command lines and environment of the systemd units and their ``gpupool_config.py``
(read from deploy/systemd, not copied here), with ``c.GPUPool.public_url`` naming the hub by
its host name over HTTPS; a notebook kernel on host ``nb`` runs a cell on each GPU host.

Each host gets what the README's steps give a real one: its own ``/etc/gpupool`` and
``/var/lib/gpupool`` (folders under the test's root), its own host name (``unshare --uts``)
and ``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/NAME/hosts``), certificates of one
CA (step 2) and the same agent token (step 3). What differs from real hosts, and why:

- paths: ``/opt/gpupool/bin`` is this test's Python, ``/etc/gpupool`` and ``/var/lib/gpupool``
  are per-host folders (every such path in the units and the config is rewritten, nothing else);
- the store: SQLite in the service's state directory instead of the README's PostgreSQL role;
- accounts: the service runs as root (``User=gpupool`` needs systemd), so the config's ``admin_users``
  names root where it names the unit's ``User=`` (README step 7's quota command then runs as the
  service's account, as on a real host), and the worker account
  is the suite's ``gpupool-test-worker`` (tests/node/test_worker_user.py) instead of ``gpupool-worker``;
- the GPUs: no GPU here, so each agent's ``gpupool`` runs with the fake NVML of
  tests/support/fakenvml.py (one H100 on gpu1, one A100 on gpu2); its arguments are the unit's, but
- containment: ``ip netns exec`` mounts a fresh /sys without the cgroup hierarchies, so the
  agents here can have no cgroups and the unit's ``--require-containment`` would (rightly) make
  them refuse to serve: it is dropped here (tests/node/test_require_containment.py checks the refusal).

Needs root and ``ip netns``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import datetime
import getpass
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

import netns
from frontend import run
from deploy_parse import SYSTEMD, unit
from pki import common_name, write_key
from gpupool.api import ServiceClient
from gpupool.magics.kernelspec import kernel_json
from procs import stop_process, wait_for
from worker_account import USER as TEST_WORKER, worker_account

TESTS = Path(__file__).resolve().parents[1] / "support"
GPUS = {"gpu1": ("gpu-1", "GPU-11111111-aaaa-bbbb-cccc-000000000001", "NVIDIA H100 80GB HBM3"),
        "gpu2": ("gpu-2", "GPU-22222222-aaaa-bbbb-cccc-000000000002", "NVIDIA A100-SXM4-80GB")}
#: Runs ``gpupool ARGS`` with NVML replaced by the fake (argv[1]: the GPU's UUID, argv[2]: its name).
#: NVML runs in the agent's watched helper process (gpupool.node.inventory.nvml.watch), so the fake goes there.
FAKE_GPU_HOST = (
    "import sys; sys.path.insert(0, {tests!r}); from gpupool.node.inventory.nvml import watch as nvml_watch; "
    "helper = ('import sys; sys.path.insert(0, %r); from fakenvml import FakeGPU, FakeNVML; "
    "sys.modules[\"pynvml\"] = FakeNVML([FakeGPU(%r, name=%r)]); "
    "from gpupool.node.inventory.nvml import helper as nvml_helper; "
    "sys.exit(nvml_helper.main(sys.argv[1:]))') % ({tests!r}, sys.argv[1], sys.argv[2]); "
    "nvml_watch.helper_command = lambda: [sys.executable, '-c', helper]; "
    "from gpupool.cli import main; sys.exit(main(sys.argv[3:]))")


def rewrite(text: str, root: Path) -> str:
    """The unit's or config's text on host folder ``root`` (module docstring: paths only)."""
    python_bin = str(Path(sys.executable).parent)
    for real, here in (("/opt/gpupool/bin", python_bin), ("/etc/gpupool", str(root / "etc/gpupool")),
                       ("/var/lib/gpupool", str(root / "var/lib/gpupool"))):
        text = text.replace(real, here)
    return text


def exec_start(name: str, root: Path) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart words after ``gpupool`` and its Environment, on host folder ``root``."""
    service = unit(name)["Service"]
    words = shlex.split(rewrite(service["ExecStart"][0], root))
    assert Path(words[0]).name == "gpupool"
    env = dict(rewrite(e, root).split("=", 1) for e in service.get("Environment", []))
    return words[1:], env


def certificate(ca, ca_key, names: list[str], ips: list[str], key_path: Path, cert_path: Path) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (x509.CertificateBuilder().subject_name(common_name(names[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(key_path, key)


def make_ca():
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(common_name("gpupool-ca")).issuer_name(common_name("gpupool-ca"))
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(key, hashes.SHA256()))
    return ca, key


@pytest.fixture
def hosts_files():
    """``/etc/netns/NAME/hosts`` files made by the test, removed after it."""
    made: list[Path] = []

    def write(host: netns.Host, text: str) -> None:
        folder = Path("/etc/netns") / host.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(text)
        made.append(folder)

    yield write
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def test_three_gpu_hosts_and_a_hub(shared_root, python_reachable, hosts_files):  # noqa: F811
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is not installed (each host needs its own host name)")
    worker_account()
    with ExitStack() as stack:
        net = netns.Network()
        stack.callback(lambda: _no_leaks(net))
        svc, gpu1, gpu2, nb = (net.add_host(role) for role in ("svc", "gpu1", "gpu2", "nb"))
        hosts = (f"127.0.0.1 localhost\n{svc.ip} hub.example.org\n{gpu1.ip} {GPUS['gpu1'][0]}\n"
                 f"{gpu2.ip} {GPUS['gpu2'][0]}\n")
        for host in (svc, gpu1, gpu2, nb):
            hosts_files(host, hosts)

        # Steps 2 and 3 of the README on every host: the CA, each host's certificate, the tokens.
        ca, ca_key = make_ca()
        token = os.urandom(32).hex()
        roots = {h.name: shared_root / h.name.rsplit("-", 1)[1] for h in (svc, gpu1, gpu2, nb)}
        for host, root in zip((svc, gpu1, gpu2, nb), roots.values()):
            etc = root / "etc" / "gpupool"
            etc.mkdir(parents=True)
            (root / "var" / "lib" / "gpupool").mkdir(parents=True)
            (etc / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
            for name in ("agent_token", "metrics_token"):
                (etc / name).write_text(token + "\n" if name == "agent_token" else os.urandom(8).hex())
                (etc / name).chmod(0o600)
            config = rewrite((SYSTEMD / "gpupool_config.py").read_text(), root)
            state = root / "var/lib/gpupool/service"
            config = config.replace('c.GPUPool.db_url = "postgresql+psycopg://gpupool@/gpupool?host=/run/postgresql"',
                                    f'c.GPUPool.db_url = "sqlite:///{state}/gpupool.sqlite"')
            service_user = unit("gpupool-service.service")["Service"]["User"][0]
            admins = f'c.GPUPool.admin_users = {{"{service_user}"}}'
            assert admins in config, "the config's admins are not the service's account"
            config = config.replace(admins, f'c.GPUPool.admin_users = {{"{getpass.getuser()}"}}')
            (etc / "gpupool_config.py").write_text(config)
        svc_etc = roots[svc.name] / "etc/gpupool"
        certificate(ca, ca_key, ["hub.example.org"], [svc.ip], svc_etc / "service.key", svc_etc / "service.crt")
        for host in (gpu1, gpu2):
            etc = roots[host.name] / "etc/gpupool"
            certificate(ca, ca_key, [GPUS[host.name.rsplit("-", 1)[1]][0]], [host.ip], etc / "node.key", etc / "node.crt")

        # Step 4: the service, as its unit starts it.
        args, env = exec_start("gpupool-service.service", roots[svc.name])
        (roots[svc.name] / "var/lib/gpupool/service").mkdir(parents=True)
        service_log = roots[svc.name] / "service.log"
        with service_log.open("wb") as out:
            service = subprocess.Popen([*svc.launcher, sys.executable, "-m", "gpupool.cli", *args],
                                       env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        stack.callback(stop_process, service)
        state = roots[svc.name] / "var/lib/gpupool/service"
        info = wait_for(lambda: (state / "service.json").exists() and json.loads((state / "service.json").read_text()),
                        60, "the service", service, service_log)
        assert info["public_url"] == "https://hub.example.org:8765/"

        # Step 5: an agent on each GPU host, as its unit starts it.
        agents = {}
        for host in (gpu1, gpu2):
            hostname, uuid, model = GPUS[host.name.rsplit("-", 1)[1]]
            args, env = exec_start("gpupool-agent.service", roots[host.name])
            args = [a.replace("--worker-user=gpupool-worker", f"--worker-user={TEST_WORKER}") for a in args
                    if a != "--require-containment"]
            log = roots[host.name] / "agent.log"
            with log.open("wb") as out:
                agents[hostname] = subprocess.Popen(
                    [*host.launcher, "unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh",
                     sys.executable, "-c", FAKE_GPU_HOST.format(tests=str(TESTS)), uuid, model, *args],
                    env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            stack.callback(stop_process, agents[hostname])

        # Step 6: the pool lists both nodes, reached over HTTPS at the hub's address.
        user_token = (state / "user_token").read_text().strip()
        client = ServiceClient(f"https://{svc.ip}:8765", user_token, ca_file=str(svc_etc / "ca.crt"))
        nodes = wait_for(lambda: (found := client.pool()["nodes"]) and len(found) == 2 and found, 60,
                         "both agents to register", service, service_log)
        assert {n["name"] for n in nodes} == {"gpu-1", "gpu-2"}
        assert all(n["state"] == "up" for n in nodes)

        # Step 7: the service's account, an admin, sets a quota with its token file.
        quota = subprocess.run([sys.executable, "-m", "gpupool.cli", "quota", "set", "user:ann", "max_gpus=2",
                                "--url", f"https://{svc.ip}:8765", "--token-file", str(state / "user_token"),
                                "--ca-file", str(svc_etc / "ca.crt")], capture_output=True, text=True, timeout=60)
        assert quota.returncode == 0, quota.stderr

        # A notebook kernel on nb, told the public URL, runs a cell on each GPU host.
        kernels = shared_root / "kernels" / "gpupool-nb"
        kernels.mkdir(parents=True)
        token_file = kernels.parent / "token"
        token_file.write_text(user_token)
        token_file.chmod(0o600)
        spec = kernel_json("Python 3 (gpupool, nb)", info["public_url"], str(token_file))
        spec["argv"] = [*nb.launcher, *spec["argv"]]
        (kernels / "kernel.json").write_text(json.dumps(spec))
        km = KernelManager(kernel_name="gpupool-nb", kernel_spec_manager=KernelSpecManager(
            kernel_dirs=[str(kernels.parent)]), ip="0.0.0.0")
        km.start_kernel(cwd=str(shared_root), env={**os.environ, "GPUPOOL_CA_FILE": str(roots[nb.name] / "etc/gpupool/ca.crt")})
        kc = km.client(ip=nb.ip)
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            for model, hostname in (("H100", "gpu-1"), ("A100", "gpu-2")):
                attached = run(kc, f"%gpu acquire 0.5 --model {model}")
                assert attached.ok, attached.text()
                cell = run(kc, "import socket, os; print(socket.gethostname(), os.getuid())")
                assert cell.ok, cell.text()
                assert cell.stdout.split() == [hostname, str(worker_account().pw_uid)]
                assert run(kc, "%gpu release --discard").ok
        finally:
            kc.shutdown()
            wait_for(lambda: not km.is_alive(), 15, "the notebook kernel to exit")
            kc.stop_channels()


def _no_leaks(net: netns.Network) -> None:
    leaked = net.close()
    assert leaked == [], f"processes were left running in the namespaces: {leaked}"
