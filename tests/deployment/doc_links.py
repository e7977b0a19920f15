"""What a doc or a comment points at, and whether it is there: Markdown links and their
`#anchor`s (GitHub's rules), repository paths cited in prose and comments, and
section citations such as `docs/operations.md, "Sizing Redis"`.

Used by tests/deployment/test_doc_links.py, which runs it over the repository and over small
bad examples (so a checker that finds nothing fails too).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The repository's top-level folders: a citation of a path starts with one of them.
TOP_DIRS = ("gateway", "spark_sink", "devtools", "tests", "deploy", "bench", "scripts",
            "grafana", "docs")  # fmt: skip
# Files whose paths name what a run creates, not what the repository holds.
NOT_PROSE = {".gitignore"}
BINARY = {".png", ".jpg", ".gz", ".jar", ".pyc"}

_FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_HTML_ID = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""", re.I)
_LINK = re.compile(
    r"(?<!\\)!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_PATH = re.compile(
    r"(?<![\w./<>$@-])((?:%s)/(?:[\w.-]+/)*[\w.-]*)" % "|".join(TOP_DIRS)  # noqa: UP031
)
_MARKDOWN_NAME = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_-]*\.md)\b")
_SECTION = re.compile(
    r"(?<![\w/.-])(README(?:\.md)?|(?:[\w-]+/)*[\w.-]+\.md)(?:'s)?,? (?:section )?\"([^\"]+)\""
)


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def blank_fences(text: str) -> str:
    """`text` with fenced code blocks blanked, line numbers kept."""
    return _FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, punctuation
    dropped (letters, digits, `_`, `-` and spaces stay), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a Markdown page: its headings' (a repeated one gets -1, -2, ...
    as on GitHub) and explicit `<a name=...>` / `id=` ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in _HEADING.finditer(blank_fences(text)):
        anchor = github_anchor(match[2])
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    found.update(_HTML_ID.findall(text))
    return found


def headings(text: str) -> list[str]:
    return [github_anchor(m[2]) for m in _HEADING.finditer(blank_fences(text))]


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _without_code(text: str) -> str:
    """Prose only: fenced blocks and inline code spans blanked (links in code are code)."""
    prose = blank_fences(text)
    return _INLINE_CODE.sub(lambda m: " " * len(m[0]), prose)


def markdown_links(text: str) -> Iterator[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition."""
    prose = _without_code(text)
    for pattern in (_LINK, _REFERENCE):
        for match in pattern.finditer(prose):
            yield _line(prose, match.start()), match[1]


def broken_links(page: Path, repo: Path, text: str | None = None) -> list[Problem]:
    """Every relative link of a Markdown page that leads nowhere: a missing file or
    folder, a path outside the repository, or an `#anchor` its page does not have."""
    text = page.read_text() if text is None else text
    where = page.relative_to(repo).as_posix() if page.is_relative_to(repo) else page.name
    problems = []
    for line, target in markdown_links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if path and not resolved.is_relative_to(repo.resolve()):
            problems.append(Problem(where, line, f"{target}: outside the repository"))
        elif not resolved.exists():
            problems.append(Problem(where, line, f"{target}: no such file"))
        elif anchor and resolved.suffix == ".md":
            page_text = text if resolved == page else resolved.read_text()
            if anchor not in anchors(page_text):
                problems.append(Problem(where, line, f"{target}: no heading #{anchor}"))
    return problems


def _cited_exists(cited: str, repo: Path) -> bool:
    """A cited path is there as a file or folder, or as the stem of one
    (`deploy/compose` for deploy/compose.yaml)."""
    target = repo / cited
    if target.exists():
        return True
    return target.parent.is_dir() and any(target.parent.glob(f"{target.name}.*"))


def broken_path_citations(where: str, text: str, repo: Path, markdown: set[str]) -> list[Problem]:
    """Repository paths `text` cites (`gateway/ops/topics.py`, `docs/spark.md`) that do
    not exist, and upper-case Markdown names (`NAME.md`) the repository has nowhere
    (`markdown`: the names of the ones it has)."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _PATH.finditer(line):
            cited = match[1].rstrip(".")
            rest = line[match.end() :]
            if rest[:1] in ("<", "*", "{", "$", "%"):  # a pattern, not a path
                continue
            if re.match(r":\d+\.\d+", rest) and "." not in cited.rsplit("/", 1)[-1]:
                continue  # an image reference, grafana/grafana:12.2.1
            if not _cited_exists(cited, repo):
                problems.append(Problem(where, number, f"cites {cited}, which does not exist"))
        for match in _MARKDOWN_NAME.finditer(line):
            if match[1] not in markdown:
                problems.append(
                    Problem(where, number, f"cites {match[1]}, which the repository does not have")
                )
    return problems


def _section_found(cited: str, text: str) -> bool:
    """A cited section is a heading of the page (or the start of one: "Redis
    persistence" for "Redis persistence and memory policy"), or a paragraph's bold
    title (`**Clocks.**`)."""
    anchor = github_anchor(cited)
    if any(h == anchor or h.startswith(anchor + "-") for h in headings(text)):
        return True
    return f"**{cited.lower()}" in text.lower()


def broken_section_citations(where: str, text: str, citing: Path, repo: Path) -> list[Problem]:
    """`docs/operations.md, "Sizing Redis"` or `README, "Measured"`: the page exists (as
    written, under docs/, or beside the citing file) and has that section. An
    upper-case name the repository lacks is left to broken_path_citations."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _SECTION.finditer(line):
            name, section = match[1], match[2]
            if name.startswith("README"):
                candidates = [repo / "README.md"]
            else:
                candidates = [repo / name, repo / "docs" / name, citing.parent / name]
            page = next((c for c in candidates if c.is_file()), None)
            if page is None and _MARKDOWN_NAME.fullmatch(name):
                continue
            if page is None:
                problems.append(Problem(where, number, f"cites {name}, which does not exist"))
            elif not _section_found(section, page.read_text()):
                shown = page.relative_to(repo).as_posix()
                problems.append(Problem(where, number, f'{shown} has no section "{section}"'))
    return problems


def repository_files(repo: Path) -> list[Path]:
    """The tracked files and the new ones git does not ignore, text only."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=repo, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.splitlines()  # fmt: skip
    files = []
    for name in sorted(set(listed)):
        path = repo / name
        if path.is_file() and path.suffix not in BINARY and path.name not in NOT_PROSE:
            files.append(path)
    return files
