"""The ``gpupool`` kernel provisioner for notebook kernels (CPU side).

A kernelspec picks it with ``metadata.kernel_provisioner = {"provisioner_name":
"gpupool", "config": {"service_url": ..., "token_file": ...}}`` (``gpupool
kernelspec install`` writes one). The kernel itself runs locally as with
jupyter_client's ``LocalProvisioner``; this subclass

- gives it ``GPUPOOL_URL``, ``GPUPOOL_TOKEN``, ``GPUPOOL_KERNEL_ID`` and
  ``GPUPOOL_KERNEL_NAME`` (its kernelspec's name, from which ``%gpu acquire``
  picks the worker environment by default: :func:`gpupool.schema.kernel_environment`;
  a kernelspec's own ``env`` stanza may set it instead) and runs it as the
  gpupool kernel (:mod:`gpupool.magics.kernel`: the ``%gpu``
  magics built in, cells forwarded to the worker while attached);
- releases every lease of the kernel when it shuts down, restarts or dies,
  so that no slice outlives the notebook kernel that asked for it.

jupyter_client sends SIGINT before every shutdown and restart (and on each
interrupt), so a signal is never taken to mean "release"; only
``shutdown_requested`` and ``cleanup`` are.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Float, Unicode, default

from gpupool.api import ENV_TOKEN, ENV_URL, ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.kernelcmd import NOTEBOOK_KERNEL_APP, with_launcher
from gpupool.schema import ENV_KERNEL_NAME

ENV_KERNEL_ID = "GPUPOOL_KERNEL_ID"
KERNEL_CLASS = "gpupool.magics.kernel.GPUPoolKernel"
OUTSTREAM_CLASS = "gpupool.magics.outstream.QuietOutStream"


def gpupool_command(cmd: list[str]) -> list[str]:
    """A kernel command line that runs the gpupool kernel (pure): ``-m
    ipykernel_launcher`` (or ``-m ipykernel``) becomes ``-m`` NOTEBOOK_KERNEL_APP;
    any other launcher gets ``--IPKernelApp.kernel_class`` and
    ``--IPKernelApp.outstream_class`` unless it names them itself."""
    swapped = with_launcher(cmd, NOTEBOOK_KERNEL_APP)
    if swapped is not None:
        return swapped
    extra = [f"--IPKernelApp.{name}={value}" for name, value in
             (("kernel_class", KERNEL_CLASS), ("outstream_class", OUTSTREAM_CLASS))
             if not any(name in arg for arg in cmd)]
    return [*cmd, *extra]


class GPUPoolProvisioner(LocalProvisioner):
    """A local kernel that knows its gpupool service and gives its leases back.

    Entry point ``gpupool`` in group ``jupyter_client.kernel_provisioners``.
    Its traits come from the kernelspec's provisioner ``config`` (which beats
    the config file, as for any provisioner).
    """

    service_url = Unicode(
        help="""Base URL of the pool service, e.g. ``http://127.0.0.1:8765``. Default: the
        GPUPOOL_URL environment variable of the Jupyter server. In a kernelspec:
        ``"config": {"service_url": "http://pool:8765"}``.""",
    ).tag(config=True)

    @default("service_url")
    def _service_url_default(self) -> str:
        return os.environ.get(ENV_URL, "")

    token_file = Unicode(
        "", help="""File holding the user's API token for the service, read at each kernel
        launch (the token itself never goes into the kernelspec). Empty: the kernel
        uses GPUPOOL_TOKEN or, under JupyterHub, JUPYTERHUB_API_TOKEN from the server's
        environment. In a kernelspec: ``"config": {"token_file": "~/.gpupool/token"}``.""",
    ).tag(config=True)

    release_timeout = Float(
        5.0, help="""Seconds the kernel's shutdown waits for its leases to be released; after
        that the service's heartbeat TTL reclaims them. Default: 5.""",
    ).tag(config=True)

    _token: str | None = None
    _shutdown_requested = False

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Run the gpupool kernel's application (:mod:`gpupool.magics.kernelapp`)
        in place of ``ipykernel_launcher`` and add the ``GPUPOOL_*`` variables
        to its environment (called on each start and restart by
        ``KernelManager.pre_start_kernel``). A kernelspec that launches the
        kernel some other way gets the kernel and output stream classes on its
        command line instead (ipykernel's shell-channel thread then stays)."""
        self._shutdown_requested = False
        kwargs = await super().pre_launch(**kwargs)
        kwargs["cmd"] = gpupool_command(kwargs["cmd"])
        env = kwargs["env"]
        self._token = self._read_token()
        if self.service_url:
            env[ENV_URL] = self.service_url
        if self._token:
            env[ENV_TOKEN] = self._token
        if self.kernel_id:
            env[ENV_KERNEL_ID] = self.kernel_id
        if ENV_KERNEL_NAME not in ((self.kernel_spec.env if self.kernel_spec else None) or {}):
            env.pop(ENV_KERNEL_NAME, None)  # never one inherited from the server's own environment
            if self._kernel_name():
                env[ENV_KERNEL_NAME] = self._kernel_name()
        return kwargs

    def _kernel_name(self) -> str:
        """The kernelspec's name: the kernel manager's ``kernel_name``, else the
        name of the kernelspec's folder ("" when neither is known)."""
        name = getattr(self.parent, "kernel_name", "") or ""
        if not name and self.kernel_spec is not None and self.kernel_spec.resource_dir:
            name = Path(self.kernel_spec.resource_dir).name
        return name

    def _read_token(self) -> str | None:
        """The token from ``token_file``, else GPUPOOL_TOKEN of the server (the
        kernel falls back to JUPYTERHUB_API_TOKEN by itself). A missing file is
        logged, not raised: the kernel still starts and ``%gpu`` explains."""
        if self.token_file:
            path = Path(self.token_file).expanduser()
            try:
                return path.read_text().strip() or None
            except OSError as exc:
                self.log.error("gpupool: cannot read the token file %s (%s); %%gpu will not be authorized",
                               path, exc.strerror)
                return None
        return os.environ.get(ENV_TOKEN) or None

    async def shutdown_requested(self, restart: bool = False) -> None:
        """The kernel is asked to shut down (or restart): release its leases
        now, while it is still alive to notice."""
        await super().shutdown_requested(restart=restart)
        self._shutdown_requested = True
        await self.release_leases("the notebook kernel restarted" if restart else "the notebook kernel shut down")

    async def cleanup(self, restart: bool = False) -> None:
        """The kernel is gone. Also reached without ``shutdown_requested`` when
        it died on its own (the restarter's ``restart_kernel(now=True)``) or was
        killed with ``shutdown_kernel(now=True)``."""
        await super().cleanup(restart=restart)
        if self._shutdown_requested:
            reason = "the notebook kernel restarted" if restart else "the notebook kernel shut down"
        else:
            reason = "the notebook kernel died" if restart else "the notebook kernel was stopped"
        await self.release_leases(reason)

    async def release_leases(self, reason: str) -> None:
        """Release every lease whose ``kernel_id`` is this kernel's.

        Runs the blocking HTTP client in a thread, bounded by
        ``release_timeout``; every failure is logged and none is raised (the
        service's heartbeat TTL reclaims what is left).
        """
        if not self.service_url or not self.kernel_id:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._release_all, reason), self.release_timeout)
        except asyncio.TimeoutError:
            self.log.warning("gpupool: releasing the leases of kernel %s took over %gs; the service will reclaim "
                             "them", self.kernel_id, self.release_timeout)
        except Exception as exc:  # never let a release break the kernel's shutdown
            self.log.warning("gpupool: could not release the leases of kernel %s: %s", self.kernel_id, exc)

    def _release_all(self, reason: str) -> list[str]:
        # The same token the kernel uses: under JupyterHub, the server's API token.
        token = self._token or self._read_token() or os.environ.get("JUPYTERHUB_API_TOKEN")
        client = ServiceClient(self.service_url, token, timeout=self.release_timeout)
        try:
            leases = client.list_leases(kernel_id=self.kernel_id)
        except GPUPoolError as exc:
            self.log.warning("gpupool: cannot list the leases of kernel %s: %s", self.kernel_id, exc.message)
            return []
        released = []
        for lease in leases:
            try:
                client.release(lease.id, reason=reason)
            except GPUPoolError as exc:  # one failure must not keep the others
                self.log.warning("gpupool: could not release lease %s: %s", lease.id, exc.message)
            else:
                released.append(lease.id)
                self.log.info("gpupool: released lease %s of kernel %s (%s)", lease.id, self.kernel_id, reason)
        return released
