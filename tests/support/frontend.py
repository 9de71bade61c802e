"""Drive a kernel the way a notebook front end does, with jupyter_client."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

#: What ZMQ says on a kernel's stderr when a port jupyter_client picked for it
#: was taken before the kernel bound it.
PORT_TAKEN = "Address already in use"
#: Starts of one test kernel in all when it loses a port that way.
PORT_TRIES = 3


@dataclass
class Cell:
    """What one executed cell produced: IOPub outputs in order, and the reply."""

    outputs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reply.get("status") == "ok"

    @property
    def stdout(self) -> str:
        return "".join(c["text"] for kind, c in self.outputs if kind == "stream" and c["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(c["text"] for kind, c in self.outputs if kind == "stream" and c["name"] == "stderr")

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.outputs]

    def text(self) -> str:
        """Everything a person would read: streams, text/plain of results, error tracebacks."""
        parts = []
        for kind, content in self.outputs:
            if kind == "stream":
                parts.append(content["text"])
            elif kind in ("display_data", "execute_result"):
                parts.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                parts.append("\n".join(content["traceback"]))
        return "\n".join(parts)


def run(kc, code: str, timeout: float = 60, stdin: list[str] | None = None) -> Cell:
    """Execute ``code`` and collect its outputs until the kernel is idle again.

    ``stdin``: answers for ``input()`` prompts, in order.
    """
    answers = list(stdin or [])
    msg_id = kc.execute(code, allow_stdin=bool(answers))
    cell = Cell()
    idle = False
    while not idle:
        if answers:
            try:
                request = kc.get_stdin_msg(timeout=0.05)
                kc.input(answers.pop(0))
                cell.outputs.append(("input_request", request["content"]))
            except Exception:  # queue.Empty: no prompt yet
                pass
        try:
            msg = kc.get_iopub_msg(timeout=timeout if not answers else 0.05)
        except Exception:
            if answers:
                continue
            raise
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "status":
            idle = msg["content"]["execution_state"] == "idle"
        elif kind != "execute_input":
            cell.outputs.append((kind, msg["content"]))
    # Skip replies to earlier requests: wait_for_ready may leave extra
    # kernel_info replies queued when the kernel was slow to start.
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    cell.reply = reply["content"]
    return cell


def install_kernelspec(prefix: Path, service_url: str, token: str, name: str = "gpupool") -> Path:
    """``gpupool kernelspec install --name NAME`` into ``prefix``; returns the kernels dir."""
    token_file = prefix / "token"
    prefix.mkdir(parents=True, exist_ok=True)
    token_file.write_text(token)
    token_file.chmod(0o600)
    subprocess.run([sys.executable, "-m", "gpupool.cli", "kernelspec", "install", f"--prefix={prefix}",
                    f"--name={name}", f"--url={service_url}", f"--token-file={token_file}"],
                   check=True, capture_output=True)
    return prefix / "share" / "jupyter" / "kernels"


def start_gpupool_kernel(kernels_dir: Path, cwd: Path, name: str = "gpupool", as_in_jupyter: bool = False):
    """Start a kernel from the installed gpupool spec ``name`` (its stderr
    in ``kernels_dir``'s parent); returns ``(km, kc)``. ``as_in_jupyter``:
    without pytest's marker in its environment, so that ipykernel sends what
    the process writes to its own stdout and stderr into the cells, as under
    Jupyter (under pytest it does not)."""
    ksm = KernelSpecManager(kernel_dirs=[str(kernels_dir)])
    env = {**os.environ}
    if as_in_jupyter:
        env.pop("PYTEST_CURRENT_TEST", None)
    return ready_kernel(lambda: KernelManager(kernel_name=name, kernel_spec_manager=ksm),
                        kernels_dir.parent / f"{name}-kernels.log", cwd=str(cwd), env=env)


def ready_kernel(make: Callable[[], KernelManager], log: Path, **start: Any):
    """Start the kernel of ``make()`` (``start``: ``start_kernel``'s
    arguments), its stderr appended to ``log``, and wait until it answers;
    returns ``(km, kc)``. RuntimeError, with the kernel's stderr, when it
    does not.

    jupyter_client picks a kernel's ports free and the kernel binds them a
    moment later; on a busy host another socket can take one in between and
    the kernel exits with "Address already in use". Jupyter Server's
    restarter then starts it again with new ports; a bare KernelManager does
    not, so here such a start is tried again with a new manager (new ports),
    :data:`PORT_TRIES` in all."""
    for attempt in range(1, PORT_TRIES + 1):
        km = make()
        err, said = _stderr_to(km, log)
        km.start_kernel(**start, stderr=err)
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            return km, kc
        except RuntimeError as exc:
            kc.stop_channels()
            if km.has_kernel:
                km.shutdown_kernel(now=True)
            if PORT_TAKEN not in said() or attempt == PORT_TRIES:
                raise RuntimeError(f"{exc}; the kernel's stderr:\n{said()[-4000:]}") from None
    raise AssertionError("unreachable")


def _stderr_to(km: KernelManager, log: Path) -> tuple[Any, Callable[[], str]]:
    """The end of ``log``, opened for ``km``'s kernel's stderr (closed with
    ``km``: a restart writes there too), and a function that reads what the
    kernel wrote there since."""
    offset = log.stat().st_size if log.exists() else 0
    err = open(log, "ab")  # noqa: SIM115 - closed with km
    weakref.finalize(km, err.close)
    return err, lambda: log.read_bytes()[offset:].decode(errors="replace")



@contextmanager
def notebook_pool(root: Path, *, config: dict[str, Any], simulate: str = "2xA100-80GB",
                  tokens: dict[str, str] | None = None) -> Iterator[tuple[Any, Path]]:
    """A service with ``config`` (and the users of ``tokens``), one agent serving
    ``simulate`` and the gpupool kernelspec for user tester: ``(service, kernels dir)``;
    both stopped after."""
    from procs import start_agent, start_service

    service = start_service(root, tokens=tokens, config=config)
    try:
        agent = start_agent(root, service, simulate=simulate)
        try:
            yield service, install_kernelspec(root / "prefix", service.url, service.user_token)
        finally:
            agent.stop()
    finally:
        service.stop()


def remote_value(kc, expression: str):
    """The value of ``expression`` evaluated in the kernel (its ``text/plain`` repr, read back)."""
    cell = run(kc, expression)
    assert cell.ok, cell.text()
    return eval(cell.outputs[-1][1]["data"]["text/plain"])  # noqa: S307 - a repr the test itself asked for


def busy_seen(kc, msg_id: str) -> bool:
    """Whether the next IOPub message (within 0.1 s) is ``msg_id``'s ``execute_input``."""
    try:
        msg = kc.get_iopub_msg(timeout=0.1)
    except Exception:  # queue.Empty
        return False
    return msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input"


#: Cell code for a worker: stand-ins for GPU values (a device and a ``.to()``) where no GPU exists.
STAND_IN = """\
class FakeGPUArray:
    '''Stands in for a GPU array where no GPU exists: a device and a .to().'''
    def __init__(self, data, device):
        self.data, self.device = data, device
    def to(self, device):
        return FakeGPUArray(self.data, device)

on_gpu = FakeGPUArray([1, 2], 'cuda:0')
import torch
weights = torch.arange(4.0)
model = torch.nn.Linear(2, 1)
"""
