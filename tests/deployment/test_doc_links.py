"""Docs that cannot drift: every relative link and `#anchor` of README.md and docs/*.md
leads somewhere (GitHub's anchor rules), the example config's pointers to pages and
sections hold, and no file in the repository (docs, comments, configs, scripts)
cites a repository path or a page section that is not there. The checker itself
(tests/deployment/doc_links.py) is run on small bad examples: one that finds nothing fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.deployment.conftest import DASHBOARD, REPO
from tests.deployment.doc_links import (
    Problem,
    anchors,
    broken_links,
    broken_path_citations,
    broken_section_citations,
    github_anchor,
    markdown_links,
    repository_files,
)

DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE_CONFIG = REPO / "deploy" / "config" / "gateway.example.toml"
# Paths cited on purpose as missing: a checker's own bad example (file -> path).
NOT_CITATIONS = {
    ("tests/deployment/test_docs.py", "tests/integration/test_nothing.py"),
    # Vendored from Redis 7.0 unchanged: a path in Redis's repository, not ours.
    ("gateway/quorum/native/redismodule.h", "tests/debugging"),
}
# The checker and this file: their bad examples are fixtures, not citations.
CHECKER = {"tests/deployment/doc_links.py", "tests/deployment/test_doc_links.py"}


def _scanned() -> list[Path]:
    """Every text file of the repository but the checker's own."""
    return [p for p in repository_files(REPO) if _rel(p) not in CHECKER]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _markdown_names() -> set[str]:
    return {p.name for p in repository_files(REPO) if p.suffix == ".md"}


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        return None


# --- the repository -------------------------------------------------------------------


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    problems = [str(p) for page in DOC_PAGES for p in broken_links(page, REPO)]
    assert not problems, "\n".join(problems)


def test_the_docs_link_and_the_checker_sees_the_links() -> None:
    """A checker that saw no link would pass everything."""
    found = [t for page in DOC_PAGES for _, t in markdown_links(page.read_text())]
    assert len(found) > 100 and sum("#" in t for t in found) > 40, len(found)


def test_the_example_config_points_at_pages_and_sections_that_exist() -> None:
    text = EXAMPLE_CONFIG.read_text()
    problems = broken_path_citations(_rel(EXAMPLE_CONFIG), text, REPO, _markdown_names())
    problems += broken_section_citations(_rel(EXAMPLE_CONFIG), text, EXAMPLE_CONFIG, REPO)
    assert not problems, "\n".join(map(str, problems))
    assert len(re.findall(r'docs/[\w-]+\.md, "', text)) >= 4, "its section pointers are read"


def test_no_file_cites_a_repository_path_that_does_not_exist() -> None:
    """Docs, comments, docstrings, configs and scripts: a path under one of the top
    folders (gateway/, docs/, deploy/, ...) exists, and an upper-case Markdown name
    (a NOTES.md-like file) is one the repository has."""
    names = _markdown_names()
    problems = []
    for path in _scanned():
        text = _text(path)
        if text is None:
            continue
        for problem in broken_path_citations(_rel(path), text, REPO, names):
            cited = problem.what.split()[1].rstrip(",")
            if (problem.path, cited) not in NOT_CITATIONS:
                problems.append(str(problem))
    assert not problems, "\n".join(problems)


def test_no_file_cites_a_section_its_page_does_not_have() -> None:
    """`docs/operations.md, "Sizing Redis"`, `README, "Measured"`: anywhere in the
    repository, the page has that section (a heading, the start of one, or a
    paragraph's bold title)."""
    problems = []
    for path in _scanned():
        text = _text(path)
        if text is not None:
            problems += [str(p) for p in broken_section_citations(_rel(path), text, path, REPO)]
    assert not problems, "\n".join(problems)


def test_the_operations_guide_lists_every_row_of_the_dashboard() -> None:
    rows = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    text = (REPO / "docs" / "operations.md").read_text()
    table = text.split("| Row | Panels |", 1)[1].split("\n\n", 1)[0]
    listed = [line.split("|")[1].strip() for line in table.strip().splitlines()[1:]]
    assert listed == rows


# --- the checker, on bad examples -------------------------------------------------------


def test_github_anchors_are_lower_case_without_punctuation_with_hyphens() -> None:
    assert github_anchor("Raw Kafka client properties: `[kafka.client]`") == (
        "raw-kafka-client-properties-kafkaclient"
    )
    assert github_anchor("Compose (one host: trials, demos)") == "compose-one-host-trials-demos"
    assert github_anchor("Why this and not X") == "why-this-and-not-x"
    assert github_anchor("The [link](x.md) and *emphasis*") == "the-link-and-emphasis"
    assert github_anchor("snake_case stays, 1.5 + ttl") == "snake_case-stays-15--ttl"
    page = "# Title\n\n## Setup\n\n```md\n## Not a heading\n```\n\n## Setup\n"
    assert anchors(page) == {"title", "setup", "setup-1"}


def _page(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_link_checker_finds_a_missing_page_a_missing_anchor_and_a_way_out(
    tmp_path: Path,
) -> None:
    _page(tmp_path, "docs/other.md", "# Other\n\n## Its section\n")
    page = _page(
        tmp_path,
        "docs/page.md",
        "# Page\n\n## Here\n\n"
        "[ok](other.md) [ok](other.md#its-section) [ok](#here) [ok](../docs/)\n"
        "[web](https://example.com/x#y) [mail](mailto:a@b)\n"
        "[gone](missing.md) [no anchor](other.md#nowhere) [own](#not-here)\n"
        "[out](../../outside.md)\n"
        "`[in code](missing-in-code.md)`\n"
        "```\n[in a block](missing-in-block.md)\n```\n"
        "[ref]: also-missing.md\n",
    )
    problems = broken_links(page, tmp_path)
    assert [(p.line, p.what.split(":")[0]) for p in problems] == [
        (7, "missing.md"), (7, "other.md#nowhere"), (7, "#not-here"), (8, "../../outside.md"),
        (13, "also-missing.md"),
    ]  # fmt: skip
    assert all(p.path == "docs/page.md" for p in problems)


def test_the_path_checker_finds_a_missing_path_and_an_unknown_markdown_file(
    tmp_path: Path,
) -> None:
    _page(tmp_path, "gateway/real.py", "")
    _page(tmp_path, "deploy/compose.yaml", "")
    missing = "gate" + "way/gone.py"  # built, so this file cites no missing path itself
    text = (
        f"see gateway/real.py and {missing}\n"
        "deploy/compose (a stem) and deploy/<name>.Dockerfile (a pattern), docs/*.md\n"
        "image: grafana/grafana:12.2.1\n"
        "the broker's quirks (" + "ENVIRON" + "MENT.md) and RESULTS.md\n"
    )
    problems = broken_path_citations("x.py", text, tmp_path, markdown={"RESULTS.md"})
    assert problems == [
        Problem("x.py", 1, f"cites {missing}, which does not exist"),
        Problem("x.py", 4, "cites " + "ENVIRON" + "MENT.md, which the repository does not have"),
    ]


def test_the_section_checker_finds_a_section_its_page_lacks(tmp_path: Path) -> None:
    _page(tmp_path, "README.md", "# Tool\n\n## Measured\n")
    _page(
        tmp_path,
        "docs/ops.md",
        "# Ops\n\n## Redis persistence and memory policy\n\n- **Clocks.** Text.\n",
    )
    citing = _page(tmp_path, "deploy/x.toml", "")
    text = (
        '# (README, "Measured") (docs/ops.md, "Redis persistence") (ops.md, "Clocks")\n'
        '# (README, "Scheduled delivery") (docs/ops.md, "Sizing") (docs/none.md, "X")\n'
    )
    problems = broken_section_citations("deploy/x.toml", text, citing, tmp_path)
    assert [p.what for p in problems] == [
        'README.md has no section "Scheduled delivery"',
        'docs/ops.md has no section "Sizing"',
        "cites docs/none.md, which does not exist",
    ]
    assert {p.line for p in problems} == {2}


@pytest.mark.parametrize("page", DOC_PAGES, ids=_rel)
def test_every_doc_page_is_markdown_the_checker_reads(page: Path) -> None:
    assert anchors(page.read_text()), f"{_rel(page)} has no heading"
