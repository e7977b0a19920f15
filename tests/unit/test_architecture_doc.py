"""docs/architecture.md is held to the code: every module of `gateway/` and
`spark_sink/` is named in it, and what it says `spark_sink/` imports of the gateway is
what the code imports (and the gateway nothing of it: the two packages form no loop)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("gateway", "spark_sink")
SPARK_IMPORTS = re.compile(r"`spark_sink/` imports from the gateway: (.+?) \(", re.S)


def modules(root: Path = ROOT) -> list[str]:
    """Every module as a path under its package's folder, `gateway/quorum/link.py`;
    a package's `__init__.py` is its folder's, named with it."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name != "__init__.py":
                found.append(path.relative_to(root).as_posix())
    return found


def paragraphs(doc: str) -> list[tuple[set[str], str]]:
    """(the folders its bold opening names, e.g. {"raw", "delay"}, text) per paragraph."""
    out = []
    for text in re.split(r"\n\s*\n", doc):
        opening = re.match(r"\s*\*\*(.+?)\*\*", text)
        folders = set(re.findall(r"`([\w/]+)/`", opening.group(1))) if opening else set()
        out.append((folders, text))
    return out


def named(module: str, doc: str) -> bool:
    """A module is named by its path from any folder up (`quorum/link.py`,
    `native/__main__.py`), or by its file name in the paragraph that opens with its
    folder; a top-level module of the gateway by its file name anywhere."""
    package, *folders, name = module.split("/")
    if any("/".join([*folders, name][i:]) in doc for i in range(len(folders))):
        return True
    if not folders and package == "gateway":
        return f"`{name}`" in doc
    folder = "/".join(folders) if folders else package
    return any(folder in opened and f"`{name}`" in text for opened, text in paragraphs(doc))


def test_every_module_is_named_in_the_architecture_doc():
    doc = DOC.read_text()
    found = modules()
    assert "gateway/quorum/link.py" in found and "spark_sink/job.py" in found
    assert [m for m in found if not named(m, doc)] == []


# Modules that do not exist, named by their parts (a path written out whole would be
# a citation of a file that is not there: tests/deployment/test_doc_links.py).
@pytest.mark.parametrize(
    "parts", [("gateway", "quorum", "freshly_added.py"), ("gateway", "lonely.py"),
              ("spark_sink", "added.py")],
)  # fmt: skip
def test_a_module_added_without_a_line_is_seen(parts: tuple[str, ...]):
    assert not named("/".join(parts), DOC.read_text())


def gateway_imports(path: Path) -> set[str]:
    """The gateway modules and packages `path` imports, as the doc names them:
    `config.py`, `kafka/clients.py`, `contract/` (a package by its folder)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] != "gateway" or len(parts) == 1:
                continue
            if parts[1] == "contract":  # a package the doc names by its folder
                out.add("contract/")
            else:
                out.add("/".join(parts[1:]) + ".py")
    return out


def test_what_spark_sink_imports_of_the_gateway_is_what_the_doc_says():
    said = SPARK_IMPORTS.search(DOC.read_text())
    assert said, "docs/architecture.md lost its sentence on what spark_sink/ imports"
    listed = set(re.findall(r"`([^`]+)`", said.group(1)))
    code = set().union(*(gateway_imports(p) for p in (ROOT / "spark_sink").rglob("*.py")))
    assert code == listed


def test_the_gateway_imports_nothing_of_the_spark_job():
    importers = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module]
            if any(n and n.split(".")[0] == "spark_sink" for n in names):
                importers.add(path.relative_to(ROOT).as_posix())
    assert importers == set()
