"""The documentation site: Sphinx + MyST over README.md, docs/ and the deploy READMEs.

    make docs      # docs/_build/html, warnings as errors (tests/deploy/test_docs_site.py builds it too)

Pages outside docs/ come in through docs/site/*.md (MyST ``include``), so each stays where
people read it on the repository. A link to a file that is no page of the site (a manifest,
a test) points at that file in the repository instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes

ROOT = Path(__file__).resolve().parent.parent
_version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "gpupool" / "__init__.py").read_text(), re.M).group(1)

project = "gpupool"
author = "The gpupool developers"
copyright = "the gpupool developers"  # noqa: A001 (Sphinx's name)
version = release = _version
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"
html_title = f"gpupool {_version}"
#: Where a repository file that is no page of the site is linked to.
SOURCE = "https://github.com/gpupool/gpupool/blob/main/"
#: Pages that stand for a repository file (docs/site/*.md include them).
PAGES = {"README.md": "site/readme", "CHANGELOG.md": "site/changelog",
         "deploy/kubernetes/README.md": "site/kubernetes", "deploy/systemd/README.md": "site/systemd",
         "deploy/jupyterhub/README.md": "site/jupyterhub"}


def _page_of(path: str) -> str | None:
    """The site's page (``/name.md``, from the source folder) for repository file ``path``."""
    if path in PAGES:
        return "/" + PAGES[path] + ".md"
    if path.startswith("docs/") and path.endswith(".md") and "/" not in path[len("docs/"):]:
        return "/" + path[len("docs/"):]
    return None


def link_repository_files(app, doctree):
    """Links to repository files (relative to the file the text is in, README.md's or a
    deploy README's when included): to their page of the site, else to the file in the repository."""
    from sphinx.addnodes import pending_xref

    for node in list(doctree.findall(pending_xref)):
        target = node.get("reftarget", "")
        if node.get("reftype") != "myst" or "://" in target or target.startswith(("#", "/")):
            continue
        where = Path(node.source or app.env.doc2path(app.env.docname)).parent
        try:
            path = str((where / target.split("#")[0]).resolve().relative_to(ROOT))
        except ValueError:
            continue
        if not (ROOT / path).exists():
            continue  # a broken link: MyST's warning stays
        page = _page_of(path)
        if page is not None:  # a :doc: reference, from the source folder
            node.update_all_atts({"refdomain": "std", "reftype": "doc", "reftarget": page.removesuffix(".md"),
                                  "refexplicit": True}, replace=True)
            continue
        reference = nodes.reference("", "", refuri=SOURCE + path, internal=False)
        reference += node.children
        node.replace_self(reference)


def setup(app):
    app.connect("doctree-read", link_repository_files)
