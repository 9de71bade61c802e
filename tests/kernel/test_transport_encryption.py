"""CurveZMQ between notebook kernels and workers.

One service, two agents: ``curve-node`` (one simulated A100, workers with
``--transport-encryption=curve``) and ``plain-node`` (one simulated H100,
``--transport-encryption=none``), so ``--model`` picks the mode. A real
notebook kernel runs cells on each through the ``%gpu`` magics, while an
eavesdropper on the worker's ports (a ZeroMQ SUB on IOPub and a DEALER on
shell, both without the server key but with the right HMAC key) listens: on
the curve worker it is refused at the handshake and hears nothing, on the
plain one it hears the cell's output (so the check can fail).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
import zmq
from jupyter_client.session import Session
from zmq.utils.monitor import recv_monitor_message

from frontend import install_kernelspec, run, start_gpupool_kernel
from workercell import run_worker_cell
from gpupool.remote import RemoteKernel
from procs import start_agent, start_service

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")

#: Upper bound (seconds) on each wait for something that must happen; not an assertion on speed.
BOUND = 30.0


@pytest.fixture(scope="module")
def curve_pool(tmp_path_factory):
    """Service, ``curve-node`` (A100, curve), ``plain-node`` (H100, none), kernels dir."""
    root = tmp_path_factory.mktemp("curve")
    service = start_service(root)
    curve = start_agent(root, service, name="curve-node", simulate="1xA100-80GB",
                        extra_args=["--transport-encryption=curve", "--log-level=DEBUG"])
    plain = start_agent(root, service, name="plain-node", simulate="1xH100-80GB",
                        extra_args=["--transport-encryption=none"])
    kernels = install_kernelspec(root / "prefix", service.url, service.user_token)
    yield service, curve, plain, kernels
    plain.stop()
    curve.stop()
    service.stop()


@pytest.fixture
def notebook(curve_pool, tmp_path):
    """A notebook kernel on the gpupool kernelspec: its client."""
    km, kc = start_gpupool_kernel(curve_pool[3], tmp_path)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=False)


def _acquire(kc, service, model: str):
    cell = run(kc, f"%gpu acquire 0.5 --model {model}")
    assert cell.ok, cell.text()
    [lease] = service.client().list_leases(active=True)
    return lease


class Eavesdropper:
    """Plain (no CURVE keys) ZeroMQ sockets on a worker's IOPub and shell
    ports, holding the lease's HMAC key, with monitors that tell whether
    their handshakes succeeded or were refused."""

    def __init__(self, connection: dict) -> None:
        self.context = zmq.Context()
        self.session = Session(key=connection["key"].encode(), signature_scheme=connection["signature_scheme"])
        url = f"tcp://{connection['ip']}:"
        self.iopub = self.context.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.shell = self.context.socket(zmq.DEALER)
        self.shell.sndtimeo = int(BOUND * 1000)  # a DEALER without a connected peer blocks on send
        self.monitors = [sock.get_monitor_socket() for sock in (self.iopub, self.shell)]
        self.iopub.connect(url + str(connection["iopub_port"]))
        self.shell.connect(url + str(connection["shell_port"]))

    def handshakes(self) -> list[str]:
        """``"succeeded"`` or ``"refused"`` per socket (IOPub, shell): the first
        handshake outcome each monitor reports."""
        outcomes = []
        for monitor in self.monitors:
            while True:
                assert monitor.poll(BOUND * 1000), "no handshake outcome"
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    outcomes.append("succeeded")
                    break
                if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                             zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                    outcomes.append("refused")
                    break
        return outcomes

    def heard(self) -> bytes:
        """Every byte the IOPub socket has received and not yet read."""
        frames = b""
        while self.iopub.poll(0):
            frames += b"".join(self.iopub.recv_multipart())
        return frames

    def hear(self, text: bytes, wait: float = BOUND) -> bool:
        """Read IOPub until a message containing ``text`` arrives (True) or
        none arrives for ``wait`` seconds (False)."""
        while self.iopub.poll(wait * 1000):
            if text in b"".join(self.iopub.recv_multipart()):
                return True
        return False

    def subscribed(self) -> bool:
        """Send signed ``kernel_info_request`` on shell until IOPub carries the
        status of one (the SUB has joined: no later output can be missed);
        False when none did within BOUND attempts."""
        for _ in range(int(BOUND)):
            msg = self.session.send(self.shell, "kernel_info_request", {})
            if self.hear(msg["header"]["msg_id"].encode(), wait=1.0):
                return True
        return False

    def ask_kernel_info(self, wait_ms: int) -> dict | None:
        """A correctly signed ``kernel_info_request`` on shell; the reply, or
        None (not even sent when no handshake let a connection through)."""
        try:
            self.session.send(self.shell, "kernel_info_request", {})
        except zmq.Again:
            return None
        if not self.shell.poll(wait_ms):
            return None
        _, parts = self.session.feed_identities(self.shell.recv_multipart())
        return self.session.deserialize(parts)

    def close(self) -> None:
        for sock in (self.iopub, self.shell):
            sock.disable_monitor()
        self.context.destroy(linger=0)


def _worker_secret(agent, public_key: str) -> str:
    """The CurveZMQ secret key in the connection file (on the node) of the worker with ``public_key``."""
    files = [json.loads(path.read_text()) for path in (Path(agent.state_dir) / "workers").glob("kernel-*.json")]
    [secret] = [info["curve_secretkey"] for info in files if info.get("curve_publickey") == public_key]
    return secret


def test_curve_worker_serves_the_magics_and_refuses_an_eavesdropper(curve_pool, notebook):
    service, curve, _, _ = curve_pool
    kernel = notebook
    lease = _acquire(kernel, service, "A100")
    connection = lease.connection
    assert lease.node == "curve-node"
    assert "curve_secretkey" not in connection, "the owner gets the public key only"
    secret = _worker_secret(curve, connection["curve_publickey"])

    spy = Eavesdropper(connection)
    try:
        assert spy.handshakes() == ["refused", "refused"]
        marker = f"secret-output-{uuid.uuid4().hex}"
        cell = run(kernel, f"import os\nfor i in range(50): print('{marker}', i)\nos.environ['GPUPOOL_LEASE_ID']")
        assert cell.ok, cell.text()
        assert marker in cell.stdout and lease.id in cell.text(), "the cell ran on the worker, over CURVE"
        assert spy.heard() == b"", "the eavesdropper got nothing from IOPub"
        assert spy.ask_kernel_info(1000) is None, "a client without the server key gets no answer"
        assert spy.heard() == b""
    finally:
        spy.close()

    # Any client that has the public key (and a key pair of its own) is served, on every channel.
    assert asyncio.run(run_worker_cell(connection, "print(6 * 7)")) == "42\n"
    remote = RemoteKernel(connection)
    try:
        remote.hb.send(b"ping")
        assert remote.hb.poll(BOUND * 1000) and remote.hb.recv() == b"ping", "the heartbeat echoes over CURVE"
    finally:
        remote.close()

    # The worker's secret key stays on its node: not in the service's answers, store or logs.
    assert secret not in json.dumps(service.client().request("GET", f"/leases/{lease.id}"))
    assert run(kernel, "%gpu release --discard").ok
    for path in (service.log, curve.log, *Path(service.state_dir).glob("*.sqlite*")):
        assert secret.encode() not in path.read_bytes(), path


def test_plain_worker_is_readable_by_the_same_eavesdropper(curve_pool, notebook):
    service, _, _, _ = curve_pool
    kernel = notebook
    lease = _acquire(kernel, service, "H100")
    assert lease.node == "plain-node" and "curve_publickey" not in lease.connection
    spy = Eavesdropper(lease.connection)
    try:
        assert spy.handshakes() == ["succeeded", "succeeded"]
        assert spy.subscribed(), "it talks to the worker's shell and hears its IOPub"
        marker = f"secret-output-{uuid.uuid4().hex}"
        assert marker in run(kernel, f"print('{marker}')").stdout
        assert spy.hear(marker.encode()), "without CURVE, anyone on the path reads the output"
        reply = spy.ask_kernel_info(int(BOUND * 1000))
        assert reply is not None and reply["msg_type"] == "kernel_info_reply"
    finally:
        spy.close()
    assert run(kernel, "%gpu release --discard").ok


def test_curve_is_the_default_and_bad_values_are_refused():
    from gpupool.node.settings import AgentWorkers

    assert AgentWorkers().transport_encryption == "curve", "zmq.has('curve') here: curve is the default"
    with pytest.raises(Exception, match="transport_encryption"):
        AgentWorkers(transport_encryption="tls")
