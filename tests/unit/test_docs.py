"""The docs hold together: every relative link and #anchor resolves, the README stays short, and
docs/metrics.md lists exactly the metrics the operator serves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 200

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def prose(text: str) -> str:
    """The text without fenced code blocks (their brackets are code, not links)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = prose(path.read_text())
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(CODE_SPAN.sub("", prose(path.read_text())))


def test_the_documents_exist() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in DOCS}
    for name in ("README.md", "CONTRIBUTING.md", "docs/testing.md", "docs/benchmarks.md", "docs/metrics.md"):
        assert name in names


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_reads_in_five_minutes() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def served_metrics() -> set[str]:
    """The names operator/phalanx/metrics.py exposes: counters with ``_total`` as prometheus_client
    writes them."""
    tree = ast.parse((ROOT / "operator" / "phalanx" / "metrics.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        kind = node.func.id if isinstance(node.func, ast.Name) else None
        if kind not in ("Counter", "Gauge", "Histogram", "CounterMetricFamily", "GaugeMetricFamily"):
            continue
        name = str(node.args[0].value)
        if kind.startswith("Counter") and not name.endswith("_total"):
            name += "_total"
        names.add(name)
    return names


def test_metrics_doc_lists_every_metric() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\|\s*`((?:phalanx|controller_runtime)_[a-z_]+)`", text, re.MULTILINE))
    served = served_metrics()
    assert len(served) > 20
    assert documented == served, f"undocumented: {sorted(served - documented)}; gone: {sorted(documented - served)}"
