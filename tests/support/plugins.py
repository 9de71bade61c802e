"""Plugins from tests/ alone, registered the way an installed package registers
them: one ``*.dist-info/entry_points.txt`` on ``sys.path`` (this process's, and
its children's through ``PYTHONPATH``); nothing in gpupool names them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def install_plugin(root: Path, group: str, line: str) -> Path:
    """The one registration, ``line`` (``name = module:Class``) in the entry point
    ``group``, in a dist-info under ``root/site``. Returns that folder."""
    name = "gpupool-demo-" + group.rsplit(".", 1)[-1].replace("_", "-")
    dist = root / "site" / f"{name.replace('-', '_')}-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{line}\n")
    return root / "site"


def children_path(site: Path) -> str:
    """The ``PYTHONPATH`` that finds ``site``'s registration and tests/'s modules in a child process."""
    return os.pathsep.join([str(site), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])


def use_plugin(monkeypatch, site: Path, module: str):
    """Make ``site`` and tests/ importable here and in children; yields, then forgets ``module``
    (for a fixture: ``yield from use_plugin(...)``)."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", children_path(site))
    yield
    sys.modules.pop(module, None)
