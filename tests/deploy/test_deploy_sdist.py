"""The sdist carries what its tests need (tests, examples, deploy files, LICENSE), the lab
extension's TypeScript source, and no
secrets, and its tests run from the unpacked tree (against the installed gpupool; one quick
test file, with the suite's conftest, stands for the rest)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    work = tmp_path_factory.mktemp("tree") / "gpupool"
    # From a copy of the tracked files: the build must not write egg-info into the checkout.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout: nothing to copy")
    for name in files:
        if (ROOT / name).is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, work / name)
    (work / "deploy" / "kubernetes" / "overlays" / "evaluation" / "tokens.env").write_text("agent_token=secret\n")
    code = "from setuptools import build_meta; import sys; print(build_meta.build_sdist(sys.argv[1]))"
    name = subprocess.run([sys.executable, "-c", code, str(out)], cwd=work, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    return out / name


def test_sdist_holds_tests_deploy_files_and_licence_but_no_secrets(sdist):
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("LICENSE", "tests/conftest.py", "tests/support/fakenvml.py", "tests/deploy/test_deploy_k8s.py",
                   "examples/quickstart.ipynb", "deploy/kubernetes/base/kustomization.yaml",
                   "deploy/kubernetes/make-secrets.sh", "deploy/systemd/gpupool-agent.service",
                   "hub_plugin/migrations/script.py.mako", "hub_plugin/templates/admin.html",
                   # the lab extension's source, to rebuild labextension/prebuilt/ from (`make labextension`)
                   "labextension/src/index.ts", "labextension/src/status.ts", "labextension/package.json",
                   "labextension/package-lock.json", "labextension/tsconfig.json", "labextension/style/index.css",
                   "labextension/prebuilt/package.json", "CHANGELOG.md", ".dockerignore", "docs/conf.py"):
        assert needed in names, needed
    assert not [n for n in names if n.endswith(".env")]
    assert not [n for n in names if n.startswith(("labextension/node_modules/", "labextension/lib/"))]


def test_sdist_tests_run_from_the_unpacked_tree(sdist, tmp_path):
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    tree = next(tmp_path.iterdir())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/deploy/test_deploy_systemd.py"],
                         cwd=tree, capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert " passed" in ran.stdout
