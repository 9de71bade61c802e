"""Which extra of the installed gpupool brings a module, read from the distribution's own
requirements (its ``Requires-Dist: NAME...; extra == "hub"`` lines), so the words a missing
package gets cannot drift from pyproject.toml's ``[project.optional-dependencies]``."""

from __future__ import annotations

import re
from importlib import metadata

#: Import names whose distribution is called otherwise (compared after :func:`normalize`).
DISTRIBUTION_OF = {"pynvml": "nvidia-ml-py", "yaml": "pyyaml", "zmq": "pyzmq", "sklearn": "scikit-learn"}
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def normalize(name: str) -> str:
    """A distribution or module name as PEP 503 compares them: ``IPython`` -> ``ipython``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(distribution: str = "gpupool") -> dict[str, tuple[set[str], set[str]]]:
    """``{extra: (distributions it requires, other extras of the same distribution it includes)}``
    of the installed ``distribution``; empty when it is not installed (a source tree on sys.path)."""
    try:
        lines = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return {}
    extras: dict[str, tuple[set[str], set[str]]] = {}
    for line in lines:
        extra, name = _EXTRA.search(line), _NAME.match(line)
        if extra is None or name is None:
            continue  # a requirement of every install
        needs, includes = extras.setdefault(extra.group(1), (set(), set()))
        if normalize(name.group(1)) == normalize(distribution):
            includes.update(e.strip() for e in (name.group(2) or "").split(",") if e.strip())
        else:
            needs.add(normalize(name.group(1)))
    return extras


def extras_providing(module: str, distribution: str = "gpupool") -> list[str]:
    """The extras that install the top-level ``module`` (directly or through an extra they
    include), those that name it directly first, each group in declaration order."""
    wanted = normalize(DISTRIBUTION_OF.get(module, module))
    extras = declared(distribution)

    def provides(extra: str, seen: frozenset = frozenset()) -> bool:
        needs, includes = extras.get(extra, (set(), set()))
        return wanted in needs or any(provides(e, seen | {extra}) for e in includes - seen)

    direct = [e for e, (needs, _) in extras.items() if wanted in needs]
    return direct + [e for e in extras if e not in direct and provides(e)]
