"""TLS for the service's and the agents' HTTP.

A test CA (made here with ``cryptography``) signs one certificate for
127.0.0.1; the service and an agent serve HTTPS with it and trust the CA
through ``--ca-file`` / ``c.GPUPool.ca_file`` (``GPUPOOL_CA_FILE`` for
clients). A lease goes through its whole life over https, and every party
that does not trust the CA (a client, the CLI, an agent, a service) gets a
clear certificate error instead of talking in clear or printing a traceback.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pki import common_name, write_key
from gpupool import demo_pool
from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from workercell import run_worker_cell
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from procs import processes_mentioning, start_service, stop_process, wait_for

#: Upper bound (seconds) on each wait for something that must happen.
BOUND = 30.0


def make_pki(where: Path) -> dict[str, Path]:
    """A CA and a certificate for 127.0.0.1 / localhost signed by it: paths
    ``ca``, ``cert``, ``key``, and ``other_key`` (a key of no certificate)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = common_name("gpupool test CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(common_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {name: where / f"{name}.pem" for name in ("ca", "cert", "key", "other_key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(paths["key"], key)
    write_key(paths["other_key"], ec.generate_private_key(ec.SECP256R1()))
    return paths


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def no_ca_from_env(monkeypatch):
    """Trust comes only from the options each test passes."""
    monkeypatch.delenv("GPUPOOL_CA_FILE", raising=False)


def _tls_args(pki) -> list[str]:
    return [f"--ssl-cert={pki['cert']}", f"--ssl-key={pki['key']}"]


def _start_agent(root: Path, service, name: str, args: list[str], client: ServiceClient) -> demo_pool.AgentProcess:
    return demo_pool.start_agent(root / f"agent-{name}", service.process, name=name, simulate="1xA100-80GB",
                                 extra_args=args, client=client)


@pytest.fixture(scope="module")
def tls_pool(tmp_path_factory, pki):
    """A service and an agent that both serve HTTPS and trust the test CA."""
    root = tmp_path_factory.mktemp("tls")
    service = start_service(root, config={"ssl_cert": str(pki["cert"]), "ssl_key": str(pki["key"]),
                                          "ca_file": str(pki["ca"])})
    client = ServiceClient(service.url, service.user_token, ca_file=str(pki["ca"]))
    agent = _start_agent(root, service, "tls-node", [*_tls_args(pki), f"--ca-file={pki['ca']}"], client)
    yield service, agent, client
    agent.stop()
    service.stop()


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpupool.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_lease_lives_and_runs_a_cell_over_https(tls_pool):
    service, agent, client = tls_pool
    assert service.url.startswith("https://127.0.0.1:")
    info = agent.state_dir / "agent.json"  # written once the service has answered the registration
    registered = wait_for(lambda: info.exists() and json.loads(info.read_text())["url"], BOUND, "agent.json")
    assert registered == agent.url and registered.startswith("https://"), "the agent registered its https URL"

    lease = client.create_lease(LeaseRequest(fraction=0.5))
    lease = client.get_lease(lease.id, wait=BOUND, state="starting")
    assert lease.state is LeaseState.active, lease.reason  # the service reached the agent over verified TLS
    assert asyncio.run(run_worker_cell(lease.connection, "print('over tls')")) == "over tls\n"
    assert client.heartbeat(lease.id).state is LeaseState.active
    ended = client.release(lease.id)
    assert ended.state in (LeaseState.releasing, LeaseState.released)
    ended = wait_for(lambda: (got := client.get_lease(lease.id)).state is LeaseState.released and got, BOUND,
                     "the release over https")
    assert ended.connection is None and not client.list_leases(active=True)


def test_a_client_without_the_ca_gets_a_certificate_error_not_a_traceback(tls_pool, pki):
    service, _, _ = tls_pool
    with pytest.raises(GPUPoolError) as refused:
        ServiceClient(service.url, service.user_token).pool()
    assert refused.value.code == "untrusted_certificate"
    assert "not trusted" in refused.value.message and "GPUPOOL_CA_FILE" in refused.value.message
    assert service.user_token not in refused.value.message

    denied = _cli("status", f"--url={service.url}", f"--token={service.user_token}")
    assert denied.returncode == 1 and "Traceback" not in denied.stderr
    assert denied.stderr.startswith("gpupool status: the TLS certificate of the gpupool service at https://")
    assert "certificate verify failed" in denied.stderr or "not trusted" in denied.stderr

    trusted = _cli("status", f"--url={service.url}", f"--token={service.user_token}", f"--ca-file={pki['ca']}")
    assert trusted.returncode == 0, trusted.stderr
    assert "tls-node" in trusted.stdout

    with pytest.raises(GPUPoolError, match="service_unavailable|cannot reach") as plain:
        ServiceClient(service.url.replace("https://", "http://"), service.user_token).pool()
    assert plain.value.code == "service_unavailable", "the service does not answer plain HTTP"


def test_an_agent_without_the_ca_does_not_register_and_says_why(tmp_path, tls_pool):
    service, _, client = tls_pool
    state, log = tmp_path / "doubter", tmp_path / "doubter.log"
    args = [*demo_pool.GPUPOOL, "agent", f"--service-url={service.url}",
            f"--token-file={service.process.agent_token_file}", "--name=doubter", "--port=0",
            f"--state-dir={state}", "--simulate=1xA100-80GB"]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "not trusted" in log.read_text(), BOUND, "the agent's complaint", proc, log)
    finally:
        stop_process(proc)
    assert "GPUPOOL_CA_FILE" in log.read_text() and "Traceback" not in log.read_text()
    assert "doubter" not in [node["name"] for node in client.pool()["nodes"]]
    assert not processes_mentioning(str(state))


def test_a_service_without_the_ca_refuses_an_https_agent(tmp_path, pki):
    service = start_service(tmp_path)  # plain HTTP, no ca_file
    client = service.client()
    agent = _start_agent(tmp_path, service, "unverified", _tls_args(pki), client)
    try:
        lease_id = client.create_lease(LeaseRequest(fraction=0.5)).id
        lease = wait_for(lambda: (got := client.get_lease(lease_id)).state.ended and got, BOUND, "the lease's end")
        assert lease.state is LeaseState.failed
        assert "not trusted" in lease.reason and "https://" in lease.reason
        assert not client.list_leases(active=True), "nothing is held"
    finally:
        agent.stop()
        service.stop()


@pytest.mark.parametrize("args, words", [
    (["--ssl-cert={cert}"], "needs both a certificate and its key"),
    (["--ssl-cert={cert}", "--ssl-key={other_key}"], "cannot be used together"),
    (["--ssl-cert={tmp}/missing.pem", "--ssl-key={key}"], "cannot read the TLS certificate or key"),
])
def test_bad_tls_settings_stop_the_service_with_one_line(tmp_path, pki, args, words):
    state = tmp_path / "state"
    values = {**{name: str(path) for name, path in pki.items()}, "tmp": str(tmp_path)}
    result = _cli("service", "--port=0", f"--state-dir={state}", *(a.format(**values) for a in args))
    assert result.returncode == 1 and words in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (state / "gpupool.sqlite").exists(), "nothing was created"
