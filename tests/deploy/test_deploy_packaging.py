"""Packaging: the wheel builds without isolation against the lowest setuptools pyproject.toml
allows, with no package left undeclared, and carries its data files; the version is written
once and every file that must repeat it agrees; the extras the command line names come from the
installed distribution's own requirements; ``kernelspec install`` refuses a Python without
ipykernel; ``gpupool demo`` finds its notebook in an install or says it needs a clone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile

import pytest
import yaml
from deploy_wheel import ROOT, build_wheel, floor_version, tracked_files, used_setuptools

import gpupool

K8S = ROOT / "deploy" / "kubernetes"


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_builds_against_the_setuptools_floor_without_isolation():
    [requirement] = pyproject()["build-system"]["requires"]
    floor = re.fullmatch(r"setuptools>=(\d+)", requirement)
    assert floor, f"build-system requires {requirement!r}: expected setuptools>=N"
    wheel, log = build_wheel()
    # The first release of the major version the floor names (77.0.0 was yanked, 77.0.1 is the first).
    assert used_setuptools(log) == floor_version() and floor_version().split(".")[0] == floor.group(1), log[:200]
    assert "is absent from the `packages` configuration" not in log, "a package folder is shipped undeclared"
    assert "Warning" not in log.replace("BuildBackendWarning: Editable", ""), log[-3000:]
    names = set(zipfile.ZipFile(wheel).namelist())
    data = f"gpupool-{gpupool.__version__}.data/data/"
    for needed in ("gpupool/hub_plugin/templates/admin.html", "gpupool/hub_plugin/migrations/script.py.mako",
                   data + "share/gpupool/examples/quickstart.ipynb", data + "share/doc/gpupool/CHANGELOG.md",
                   data + "share/doc/gpupool/deploy/systemd/README.md",
                   data + "share/doc/gpupool/deploy/systemd/gpupool-agent.service",
                   data + "share/jupyter/labextensions/gpupool-lab/package.json"):
        assert needed in names, needed


def test_the_version_is_written_once_and_repeated_alike():
    version = gpupool.__version__
    assert "version" in pyproject()["project"]["dynamic"] and "version" not in pyproject()["project"]
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gpupool.__version__"}
    # Files that must carry it themselves (npm, image tags, the changelog) agree with it.
    for name in ("labextension/package.json", "labextension/prebuilt/package.json"):
        assert json.loads((ROOT / name).read_text())["version"] == version, name
    for overlay in sorted((K8S / "overlays").glob("*/kustomization.yaml")):
        for image in yaml.safe_load(overlay.read_text()).get("images", []):
            assert image["newTag"] == version, f"{overlay}: {image['name']} tagged {image['newTag']}"
    values = yaml.safe_load((K8S / "z2jh" / "config.yaml").read_text())
    tags = [p["kubespawner_override"]["image"].rpartition(":")[2] for p in values["singleuser"]["profileList"]
            if "image" in p.get("kubespawner_override", {})]
    assert tags == [version]
    assert re.search(rf"^## {re.escape(version)}\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
    # ... and nobody else writes it by hand (tests read gpupool.__version__).
    allowed = {"gpupool/__init__.py", "CHANGELOG.md", "deploy/kubernetes/z2jh/config.yaml", "labextension/package.json",
               "labextension/package-lock.json", "labextension/prebuilt/package.json"}
    literal = re.compile(rf"(?<![\w.]){re.escape(version)}(?![\w.])")
    for name in tracked_files():
        if name in allowed or name.startswith("labextension/prebuilt/static/") or "/overlays/" in name:
            continue
        try:
            text = (ROOT / name).read_text()
        except UnicodeDecodeError:
            continue
        assert not literal.search(text), f"{name} writes the version {version} by hand"


def test_extra_names_come_from_the_distributions_requirements():
    from gpupool.extras import declared

    extras = pyproject()["project"]["optional-dependencies"]
    found = declared()
    assert set(found) == set(extras)
    for extra, requirements in extras.items():
        names = {re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requirements}
        own = {n for n in names if n == "gpupool"}
        from gpupool.extras import normalize

        assert found[extra][0] == {normalize(n) for n in names - own}, extra


def run_cli(code: str, *args: str) -> subprocess.CompletedProcess:
    script = f"import sys, runpy; {code}; sys.argv = ['gpupool', *sys.argv[1:]]; runpy.run_module('gpupool.cli', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)


def test_the_agent_on_a_kernel_only_install_names_the_agent_extra():
    # A kernel-only install lacks the agent's prometheus_client (and pynvml, psutil): the agent's extra, not the hub's.
    result = run_cli("sys.modules['prometheus_client'] = None", "agent", "--service-url=http://127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.strip() == ("gpupool agent needs the 'agent' extra: pip install 'gpupool[agent]' "
                                     "(missing module: prometheus_client)")


def test_kernelspec_install_refuses_a_python_without_ipykernel(tmp_path):
    result = run_cli("sys.modules['ipykernel'] = None", "kernelspec", "install", "--prefix", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().startswith("gpupool kernelspec: ipykernel is not installed in ")
    assert "pip install 'gpupool[kernel]'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.rglob("kernel.json"))  # nothing was installed


def test_demo_without_its_notebook_says_it_needs_a_clone(monkeypatch, capsys, tmp_path):
    from gpupool import demo

    monkeypatch.setattr(demo, "NOTEBOOKS", (tmp_path / "a.ipynb", tmp_path / "b.ipynb"))
    assert demo.main([]) == 1
    out = capsys.readouterr().out
    assert "FAILED: the quickstart notebook is neither in a source tree nor in this install" in out
    assert "run 'make demo' in a clone of the repository, or pass --notebook PATH" in out
    assert demo.default_notebook() is None
    monkeypatch.undo()
    assert demo.default_notebook() == ROOT / "examples" / "quickstart.ipynb"  # this clone's
