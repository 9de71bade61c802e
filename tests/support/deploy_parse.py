"""Checks that deployment files (Kubernetes manifests, systemd units, Dockerfiles) name
command lines and settings the real ``gpupool`` accepts. Used by tests/test_deploy_*.py.

``check_command(argv)`` parses a ``gpupool ...`` command line with the real parsers and
runs nothing: the traitlets applications (``service``, ``agent``) through their
``parse_command_line``, whose unknown options only warn, so every option must land on a
known trait; the argparse commands through their own parser, stopped right after parsing.
``config_assignments(text)`` lists the ``c.Class.trait`` a config file sets.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import shlex
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]


class _Parsed(Exception):
    """Raised instead of running a command once its arguments parsed."""


@contextmanager
def _stop_after_parse() -> Iterator[None]:
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        real(self, args, namespace)  # SystemExit(2) on a bad command line
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real


def _traitlets_app(command: str):
    if command == "service":
        from gpupool.hub_plugin.app import ServiceApp

        return ServiceApp()
    from gpupool.node.agent import NodeAgent

    return NodeAgent()


def check_command(argv: list[str]) -> None:
    """Fail the test unless ``argv`` (``["gpupool", COMMAND, ...]``) parses."""
    from gpupool import cli

    assert argv and Path(argv[0]).name == "gpupool", f"not a gpupool command: {argv}"
    if argv[1:] in (["--version"], ["--help"]):
        return
    command, rest = argv[1], argv[2:]
    assert command in cli.COMMANDS, f"{argv}: unknown command {command!r}"
    if "--generate-config" in rest:
        assert rest == ["--generate-config"], f"{argv}: --generate-config takes nothing else"
        return
    if command in ("service", "agent"):
        app = _traitlets_app(command)
        app.parse_command_line(rest)  # a bad value: SystemExit
        assert not app.extra_args, f"{argv}: stray arguments {app.extra_args}"
        check_config_sections(app, {section: list(values) for section, values in app.config.items()}, argv)
        return
    module = importlib.import_module(cli.COMMANDS[command][0])
    with _stop_after_parse(), pytest.raises(_Parsed):
        try:
            (module.pool_main if command == "pool" else module.main)(rest)
        except SystemExit as exc:
            pytest.fail(f"{argv} does not parse (exit {exc.code})")


def check_config_sections(app, sections: dict[str, list[str]], where) -> None:
    """Every ``{Class: [trait, ...]}`` names a configurable trait of ``app``'s classes."""
    classes = {cls.__name__: cls for cls in app._classes_inc_parents()}
    for section, names in sections.items():
        assert section in classes, f"{where}: {section} is no class of gpupool {app.name} ({', '.join(classes)})"
        traits = classes[section].class_traits(config=True)
        for name in names:
            assert name in traits, f"{where}: {section}.{name} is no setting of gpupool {app.name}"


def config_assignments(text: str) -> dict[str, list[str]]:
    """``{Class: [trait, ...]}`` for each ``c.Class.trait = ...`` in a config file."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(text)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
                    and isinstance(target.value.value, ast.Name) and target.value.value.id == "c"):
                found.setdefault(target.value.attr, []).append(target.attr)
    return found


def gpupool_commands(shell: str) -> list[list[str]]:
    """The ``gpupool ...`` command lines in a shell snippet (split on ``&&``, ``;``, ``||``, ``|``)."""
    commands = []
    for part in re.split(r"&&|\|\||;|\|", shell):
        words = shlex.split(part)
        if words and Path(words[0]).name == "gpupool":
            commands.append(words)
    return commands


def environment_names_read() -> set[str]:
    """Environment variables gpupool (or JupyterHub's service auth, which it uses) reads:
    every upper-case string literal of their sources that is an environment variable name."""
    import jupyterhub.services.auth

    names: set[str] = set()
    sources = [*ROOT.glob("gpupool/*.py"), *ROOT.glob("node/**/*.py"), *ROOT.glob("hub_plugin/**/*.py"),
               *ROOT.glob("magics/*.py"), Path(jupyterhub.services.auth.__file__)]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"(GPUPOOL|JUPYTERHUB|CUDA)_[A-Z0-9_]+", node.value):
                names.add(node.value)
    return names


# -- Dockerfiles and their build context -----------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, rest)`` of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def _docker_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex over slash-separated paths (moby/patternmatcher):
    ``**`` any number of folders, ``*`` and ``?`` within one name."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_keeps(rules: str, path: str) -> bool:
    """Whether ``docker build`` sends ``path`` (relative, slash-separated) of its context under
    the .dockerignore text ``rules``: the last pattern that matches the path or one of its
    folders decides; ``!`` patterns take back in."""
    keep = True
    parts = path.split("/")
    for line in rules.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = _docker_pattern(os.path.normpath(line.lstrip("!").strip()).lstrip("/"))
        if any(pattern.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            keep = exception
    return keep


# -- Pod Security Standards ------------------------------------------------------------------------------------

#: Capabilities Pod Security `baseline` lets a container add (the container runtimes' default set).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
#: Sysctls `baseline` allows.
BASELINE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                    "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def baseline_violations(pod: dict, annotations: dict | None = None) -> list[str]:
    """What in the pod spec ``pod`` breaks the Pod Security Standards' `baseline` level
    (kubernetes.io/docs/concepts/security/pod-security-standards), each as words; empty: it passes."""
    found = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"{key}: true")
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            found.append(f"volume {volume['name']}: hostPath")
    for name, value in (annotations or {}).items():
        if name.startswith("container.apparmor.security.beta.kubernetes.io/") and value == "unconfined":
            found.append(f"annotation {name}: unconfined")
    contexts = [("pod", pod.get("securityContext", {}))]
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(kind, []):
            where = f"{kind[:-1]} {container['name']}"
            context = container.get("securityContext", {})
            contexts.append((where, context))
            if context.get("privileged"):
                found.append(f"{where}: privileged")
            added = set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
            if added:
                found.append(f"{where}: adds capabilities {sorted(added)}")
            if any(port.get("hostPort") for port in container.get("ports", [])):
                found.append(f"{where}: hostPort")
            if context.get("procMount", "Default") != "Default":
                found.append(f"{where}: procMount {context['procMount']}")
    for where, context in contexts:
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{where}: hostProcess")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{where}: seccomp Unconfined")
        if context.get("appArmorProfile", {}).get("type") == "Unconfined":
            found.append(f"{where}: AppArmor Unconfined")
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{where}: seLinuxOptions {selinux}")
    for sysctl in pod.get("securityContext", {}).get("sysctls", []):
        if sysctl["name"] not in BASELINE_SYSCTLS:
            found.append(f"sysctl {sysctl['name']}")
    return found


SYSTEMD = ROOT / "deploy" / "systemd"


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values...]}}`` of a unit file (keys may repeat)."""
    result: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = result.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return result
