"""One section of bench/REPORT.md, replaced in place: the benchmarks' shared writer."""

from __future__ import annotations

from pathlib import Path

REPORT = Path(__file__).resolve().parent / "REPORT.md"


def write_section(heading: str, section: str, path: Path = REPORT) -> None:
    """Replace the section that starts with ``heading`` (e.g. ``"## Flood"``)
    up to the next ``## `` heading with ``section``, or append it; the other
    sections stay as they are."""
    text = path.read_text() if path.exists() else "# gpupool benchmarks\n"
    start = text.find(f"\n{heading}\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start + 1] + section.rstrip("\n") + "\n" + ("\n" + text[end + 1:] if end != -1 else "")
    path.write_text(text.rstrip("\n") + "\n")
