"""``gpupool kernelspec install``: the "Python 3 (gpupool)" Jupyter kernel.

The kernelspec runs this interpreter's ipykernel under the ``gpupool``
kernel provisioner (:mod:`.kernel_provisioner`), which points the kernel at
the pool service and loads the ``%gpu`` magics. The token is never written
into the kernelspec: only the path of a file holding it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jupyter_client.kernelspec import KernelSpecManager

from gpupool.errors import GPUPoolError, Reason

DEFAULT_NAME = "gpupool"
DEFAULT_DISPLAY_NAME = "Python 3 (gpupool)"


def kernel_json(display_name: str, service_url: str | None, token_file: str | None,
                python: str = sys.executable) -> dict[str, Any]:
    """The ``kernel.json`` of a gpupool kernel (pure)."""
    config = {}
    if service_url:
        config["service_url"] = service_url
    if token_file:
        config["token_file"] = token_file
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "metadata": {"debugger": True,
                     "kernel_provisioner": {"provisioner_name": "gpupool", "config": config}},
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool kernelspec",
        description="Install the Jupyter kernelspec whose kernels can attach to pooled GPUs with %gpu. "
                    "It runs this Python's ipykernel under the 'gpupool' kernel provisioner, which tells the "
                    "kernel where the pool service is and releases the kernel's GPU leases when it stops.")
    commands = parser.add_subparsers(dest="command", metavar="install")
    install = commands.add_parser(
        "install", help="install (or replace) the kernelspec",
        description="Install (or replace) the gpupool kernelspec. By default it goes into this Python's "
                    f"prefix ({sys.prefix}), so only this environment's Jupyter sees it.")
    install.add_argument("--name", default=DEFAULT_NAME, help=f"kernelspec name (default: {DEFAULT_NAME})")
    install.add_argument("--display-name", default=DEFAULT_DISPLAY_NAME,
                         help=f"name shown in Jupyter's launcher (default: {DEFAULT_DISPLAY_NAME!r})")
    install.add_argument("--url", help="the pool service's base URL (default: GPUPOOL_URL of the Jupyter server)")
    install.add_argument("--token-file", help="file holding the user's service token, read at each kernel start "
                                              "(default: GPUPOOL_TOKEN or JUPYTERHUB_API_TOKEN of the server)")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true", help=f"install into sys.prefix ({sys.prefix}); the default")
    where.add_argument("--prefix", help="install into PREFIX/share/jupyter/kernels")
    return parser


def install(name: str = DEFAULT_NAME, display_name: str = DEFAULT_DISPLAY_NAME, service_url: str | None = None,
            token_file: str | None = None, *, user: bool = False, prefix: str | None = None) -> str:
    """Write the kernelspec and return the directory it was installed in.

    ``prefix`` None and ``user`` False: ``sys.prefix``. Raises GPUPoolError for
    a bad name, a ``service_url`` that is no http(s) URL, a Python without
    ipykernel (its kernels could not start), or an unwritable destination.
    """
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise GPUPoolError(Reason.bad_request,
                           f"kernelspec name {name!r} may only hold letters, digits, '.', '_' and '-'")
    if service_url:
        parts = urlsplit(service_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GPUPoolError(Reason.bad_request, f"{service_url!r} is not a service URL; it should look like "
                               "http://HOST:PORT (--url); the kernelspec was left as it was")
    if token_file:
        token_file = str(Path(token_file).expanduser().resolve())
    if not _has_ipykernel():
        raise GPUPoolError(Reason.not_configured,
                           f"ipykernel is not installed in {sys.executable}, so the kernelspec's kernels could not "
                           "start: pip install 'gpupool[kernel]' there first; nothing was installed")
    if not user and prefix is None:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kernel.json").write_text(json.dumps(kernel_json(display_name, service_url, token_file), indent=1))
        _copy_logos(Path(tmp))
        _readable_by_all(Path(tmp))
        try:
            return KernelSpecManager().install_kernel_spec(tmp, name, user=user, prefix=prefix, replace=None)
        except OSError as exc:
            raise GPUPoolError(Reason.install_failed, f"cannot install the kernelspec: {exc} "
                               "(try --user or --prefix)") from None


def _has_ipykernel() -> bool:
    """True when this Python (the one the kernelspec runs) can import ipykernel."""
    try:
        import ipykernel  # noqa: F401
    except ImportError:
        return False
    return True


def _readable_by_all(folder: Path) -> None:
    """``folder`` 0755 and its files 0644, as ``jupyter kernelspec install`` leaves a kernelspec:
    install_kernel_spec copies the folder with its mode, and a temporary folder is 0700, which made
    a ``--sys-prefix`` install by root a kernel no other user could see. Nothing in it is secret
    (the token stays in its own file)."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _copy_logos(dest: Path) -> None:
    # ipykernel's own Python logos, so the launcher shows a familiar icon.
    try:
        from ipykernel.kernelspec import RESOURCES
    except ImportError:
        return
    for logo in Path(RESOURCES).glob("logo-*"):
        shutil.copy(logo, dest / logo.name)


def main(argv: list[str] | None = None) -> int:
    """``gpupool kernelspec install [...]``; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "install":
        parser.print_help()
        return 2
    where = install(args.name, args.display_name, args.url, args.token_file, user=args.user, prefix=args.prefix)
    print(f"Installed kernelspec {args.name} ({args.display_name!r}) in {where}")
    if not args.url and not os.environ.get("GPUPOOL_URL"):
        print("note: no --url given; kernels will use GPUPOOL_URL from the Jupyter server's environment")
    if args.token_file and not os.access(Path(args.token_file).expanduser(), os.R_OK):
        # Read at each kernel start, so it may come later; but say so now, not at the first %gpu acquire.
        print(f"warning: the token file {args.token_file} cannot be read now; kernels read it when they "
              "start, and %gpu will be refused until it can")
    return 0
