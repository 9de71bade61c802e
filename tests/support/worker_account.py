"""The unprivileged user the tests run workers as (created when missing), and
the folders it must reach."""

from __future__ import annotations

import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpupool.node.worker_user import WorkerUser


USER = "gpupool-test-worker"


def worker_account() -> pwd.struct_passwd:
    """The test's worker user, created (``useradd --system``) when missing."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not available to create the worker user")
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True,
                   capture_output=True)
    return pwd.getpwnam(USER)


@pytest.fixture
def shared_root():
    """A directory others may enter (0711) but not list: a worker user must
    reach its connection file under the agent's state dir, and pytest's
    tmp_path (under a 0700 directory) does not allow that."""
    root = Path(tempfile.mkdtemp(prefix="gpupool-worker-user-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def python_reachable():
    """Let the worker user run this Python: where a folder on its path is closed
    to others (CI's Python lives under /root, mode 0700), add only the others'
    search bit (enter, not list) for the test's length, and put it back."""
    user, python = WorkerUser.lookup(worker_account().pw_name), Path(sys.executable).resolve()
    opened: list[tuple[Path, int]] = []
    try:
        while (blocked := user.blocked_at(python)) is not None and len(opened) < 10:
            mode = blocked.stat().st_mode & 0o7777
            if mode & 0o001:
                break  # not a search bit that is missing: leave it as it is
            opened.append((blocked, mode))
            blocked.chmod(mode | 0o001)
        if blocked is not None:
            pytest.skip(f"{USER} cannot run this Python ({python}): {blocked} is closed to it")
        yield
    finally:
        for folder, mode in reversed(opened):
            folder.chmod(mode)
