"""The docs match the product: every command README.md and docs/*.md show is parsed
by the program it names (the real argparse parsers, the Makefile's targets), every
test a guarantee table names exists, and every repository path they cite is there.

A command is found in three places: lines of fenced code blocks, indented code
lines, and inline code spans. Inline spans such as `dedup-gateway rebuild` name a
command without all its arguments, so for them only the verb and every `--flag`
must exist; lines of code blocks are parsed whole, with the docs' placeholders
(`[--dry-run]`, `N`, `MEMBER`) read as an example would be typed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import re
import runpy
import shlex
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.cli import build_parser
from tests.deployment.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TESTS = REPO / "tests"

# Programs that code blocks may show besides the ones parsed here, and the test
# that runs each. Anything else in a code block fails the test until it is added.
RUN_ELSEWHERE = {
    "kubectl": "tests/deployment/test_kubernetes.py renders the kustomizations",
    "helm": "tests/deployment/test_helm.py lints and renders the chart",
    ".venv/bin/twine": "tests/deployment/test_release.py runs twine check --strict",
    "pip": "tests/deployment/test_release.py installs the wheel by name in a fresh venv",
    "spark-submit": "tests/deployment/test_spark_pack.py submits with the documented options",
    "docker": "not run here (no Docker engine); tests/deployment/test_dockerfiles.py and "
    "tests/deployment/test_manifests.py check the files it reads",
    "cd": "a shell step",
    "mkdir": "a shell step (tests/integration/spark/test_cluster.py runs docs/spark-cluster.md's)",
    "scripts/pack-spark-env.sh": "tests/deployment/test_spark_pack.py",
    "python": "python deploy/loadgen/loadgen.py: tests/deployment/test_loadgen.py",
}
# Pages a test runs block by block, in order, against real servers: their blocks
# (commands, heredocs, expected output) are that test's business.
RUN_WHOLE = {"docs/quickstart.md": "tests/integration/test_quickstart.py"}
# How the docs write a value the reader fills in, as an example would be typed.
PLACEHOLDERS = {"N": "3", "SEED": "7", "MINUTES": "10"}
# Make targets whose ARGS (and variables) go to a Python module's parser.
MAKE_MODULES = {
    "demo": "devtools.demo",
    "bench": "bench",
    "chaos": "devtools.chaos",
    "localstack": "devtools.localstack",
}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    whole: bool  # a line of a code block (parsed whole), not an inline mention

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _fenced(text: str) -> Iterator[tuple[int, str, str]]:
    """(line, language, body) of every fenced code block."""
    for match in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M):
        yield _line_of(text, match.start(2)), match[1], match[2]


def _outside_fences(text: str) -> str:
    """The text with fenced blocks blanked (line numbers kept)."""
    return re.sub(r"^ *```.*?^ *```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)


def _block_lines(body: str, first: int) -> Iterator[tuple[int, str]]:
    """The logical lines of a code block: `\\` continuations joined, comments cut."""
    pending, start = "", first
    for offset, raw in enumerate(body.splitlines()):
        if not pending:
            start = first + offset
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if (pending + line).strip():
            yield start, (pending + line).strip()
        pending = ""


ENV_ASSIGNMENT = re.compile(r"([A-Z_]+)=(\$\([^)]*\)|\"[^\"]*\"|'[^']*'|\S+)\s+")
COMMAND_START = re.compile(
    r"^(?:[A-Z_]+=\S+ )*"
    r"((?:dedup-gateway|python -m|make|pytest)(?= |$)|(?:\.venv/bin/)?python scripts/)"
)


def commands() -> list[Command]:
    found: list[Command] = []
    for path in DOCS:
        text, doc = path.read_text(), path.relative_to(REPO).as_posix()
        if doc in RUN_WHOLE:
            continue
        for first, language, body in _fenced(text):
            if language not in ("", "sh", "text", "console", "bash"):
                continue
            for line, command in _block_lines(body, first):
                found.append(Command(doc, line, command, whole=True))
        prose = _outside_fences(text)
        for match in re.finditer(r"^ {4,}(\S.*)$", prose, re.M):
            if COMMAND_START.match(match[1]):
                found.append(Command(doc, _line_of(prose, match.start(1)), match[1], whole=True))
        for match in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)*)`", prose):
            span = " ".join(match[1].split())
            if COMMAND_START.match(span) and not re.match(r"^ {4,}", match[0]):
                found.append(Command(doc, _line_of(prose, match.start()), span, whole=False))
    return found


def _tokens(text: str) -> tuple[dict[str, str], list[str]]:
    """Leading VAR=value assignments, then the words, with `[...]` and placeholders read."""
    env: dict[str, str] = {}
    while match := ENV_ASSIGNMENT.match(text):
        env[match[1]] = match[2].strip("\"'")
        text = text[match.end() :]
    words = shlex.split(text.replace("[", " ").replace("]", " "))
    return env, [PLACEHOLDERS.get(word, word) for word in words]


class _Parsed(Exception):
    pass


def _run_to_parser(module: str, argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    """Run `python -m module argv` up to its argument parsing: its parser, and None
    when the arguments parse (or ask for --help), else the parser's error."""
    original = argparse.ArgumentParser.parse_args
    parsers: list[argparse.ArgumentParser] = []

    def parse_then_stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parsers.append(self)
        original(self, *args, **kwargs)
        raise _Parsed

    saved_argv = sys.argv
    err = io.StringIO()
    sys.argv = [module, *argv]
    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[assignment,method-assign]
    problem: str | None = f"python -m {module} never parsed its arguments"
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            # Another command may have imported the module already: runpy runs it anew.
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            if module.endswith(".py"):  # a script the docs run with python
                runpy.run_path(str(REPO / module), run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed:
        problem = None
    except SystemExit as exit_:
        problem = None if exit_.code == 0 else err.getvalue().strip().splitlines()[-1]
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = saved_argv
    assert parsers, problem
    return parsers[0], problem


def parse_module_args(module: str, argv: list[str]) -> str | None:
    return _run_to_parser(module, argv)[1]


@functools.cache
def module_flags(module: str) -> frozenset[str]:
    """Every `--flag` of `python -m module`, its subcommands' included."""
    parsers, flags = [_run_to_parser(module, [])[0]], set()
    while parsers:
        parser = parsers.pop()
        flags |= {f for f in parser._option_string_actions if f.startswith("--")}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
    return frozenset(flags)


def _gateway_mention(words: list[str]) -> str | None:
    """An inline `dedup-gateway VERB --flag ...`: the verb and each flag exist."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = set(parser._option_string_actions)
    if words and not words[0].startswith("-"):
        verb = sub.choices.get(words[0])
        if verb is None:
            return f"no command {words[0]!r} (commands: {', '.join(sub.choices)})"
        flags |= set(verb._option_string_actions)
    unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in flags]
    return f"no option {', '.join(unknown)}" if unknown else None


def _makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, re.M))


def check(command: Command) -> str | None:
    """None if the command is what the product accepts, else why not."""
    env, words = _tokens(command.text)
    program, args = words[0], words[1:]
    if program == "dedup-gateway" or words[:3] == ["python", "-m", "gateway"]:
        args = words[3:] if program == "python" else args
        if not command.whole:
            return _gateway_mention(args)
        return parse_module_args("gateway", args)
    if words[:2] == ["python", "-m"]:
        return parse_module_args(words[2], words[3:])
    if program in ("python", ".venv/bin/python") and args and args[0].startswith("scripts/"):
        return parse_module_args(args[0], args[1:]) if command.whole else None
    if program == "make":
        targets = [w for w in args if "=" not in w]
        make_vars = dict(w.split("=", 1) for w in args if "=" in w) | env
        missing = set(targets) - _makefile_targets()
        if missing:
            return f"no Makefile target {', '.join(sorted(missing))}"
        for target in targets:
            if target in MAKE_MODULES:
                extra = shlex.split(make_vars.get("ARGS", ""))
                if target == "chaos":
                    seed, minutes = make_vars.get("SEED", "1"), make_vars.get("MINUTES", "10")
                    extra = ["--seed", seed, "--minutes", minutes, *extra]
                if problem := parse_module_args(MAKE_MODULES[target], extra):
                    return problem
        return None
    if program == "pytest":
        paths = [w.split("::")[0] for w in args if w.startswith("tests/")]
        missing_paths = [p for p in paths if not (REPO / p).exists()]
        return f"no such test path {', '.join(missing_paths)}" if missing_paths else None
    if not command.whole:
        return None
    return None if program in RUN_ELSEWHERE else f"no test runs or parses {program!r}"


def test_pages_run_whole_have_their_test() -> None:
    for doc, test in RUN_WHOLE.items():
        assert (REPO / doc).exists() and (REPO / test).exists(), (doc, test)
        assert doc in (REPO / test).read_text(), f"{test} does not read {doc}"


def test_the_docs_show_commands_at_all() -> None:
    found = commands()
    assert sum(c.text.startswith("dedup-gateway") and c.whole for c in found) >= 8
    assert any(c.text.startswith("python -m spark_sink") for c in found)


@pytest.mark.parametrize("command", commands(), ids=str)
def test_every_command_the_docs_show_is_what_the_program_accepts(command: Command) -> None:
    problem = check(command)
    assert problem is None, f"{command}\n  {problem}"


def test_a_wrong_flag_or_verb_is_caught() -> None:
    """The checks above can fail: the mismatches the docs once had."""
    assert check(Command("x", 1, "dedup-gateway rebuild M --source N", whole=True))
    assert check(Command("x", 1, "dedup-gateway rebuild --source", whole=False))
    assert check(Command("x", 1, "dedup-gateway member pause", whole=False))
    assert check(Command("x", 1, "python -m spark_sink --until-empty", whole=True))
    assert check(Command("x", 1, "make no-such-target", whole=True))
    assert check(Command("x", 1, "rm -rf .state", whole=True))
    assert check(Command("x", 1, "dedup-gateway rebuild M --from N", whole=True)) is None


# Modules whose flags the docs may name on their own (`--from`), and flags of other
# tools the docs mention in passing.
FLAG_MODULES = (
    "gateway",
    "spark_sink",
    "devtools.demo",
    "devtools.chaos",
    "devtools.localstack",
    "bench",
    "bench.datapath",
)
OTHER_TOOLS_FLAGS = {
    "--python-prefix": "venv-pack",
    "--files": "spark-submit",
    "--conf": "spark-submit",
    "--archives": "spark-submit",
    "--py-files": "spark-submit",
    "--packages": "spark-submit",
    "--deploy-mode": "spark-submit",
}


def bare_flags() -> list[tuple[str, int, str]]:
    """(doc, line, flag) of every inline span that starts with a `--flag`."""
    found = []
    for path in DOCS:
        prose = _outside_fences(path.read_text())
        for match in re.finditer(r"`(--[a-z][a-z0-9-]*)", prose):
            found.append((path.name, _line_of(prose, match.start()), match[1]))
    return found


def test_every_flag_the_docs_name_on_its_own_exists() -> None:
    known = set(OTHER_TOOLS_FLAGS).union(*(module_flags(m) for m in FLAG_MODULES))
    assert {"--from", "--dry-run", "--until-idle", "--cluster"} <= known
    unknown = [f"{doc}:{line}: {flag}" for doc, line, flag in bare_flags() if flag not in known]
    assert len(bare_flags()) >= 10
    assert not unknown, unknown


# --- the guarantee tables ---------------------------------------------------------


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def _files_named(name: str) -> list[Path]:
    if "/" in name:
        return [REPO / name] if (REPO / name).is_file() else []
    return sorted(TESTS.rglob(name))


def named_tests(cell: str) -> tuple[list[str], list[str]]:
    """(what a Test cell names, what of it does not exist). `file.py` bare or with its
    path; `::name` and `…_suffix` refer to the last file named before them."""
    named: list[str] = []
    problems: list[str] = []
    files: list[Path] = []
    for span in re.findall(r"`([^`]+)`", cell):
        path, sep, name = span.partition("::")
        if path and not path.startswith("…"):
            if not re.fullmatch(r"[\w/.]+\.py|tests/[\w/]+/", path):
                continue
            if path.endswith("/"):
                named.append(span)
                if not (REPO / path).is_dir():
                    problems.append(f"{span}: no such folder")
                continue
            files = _files_named(path)
            if not files:
                problems.append(f"{span}: no such test file")
                continue
        elif not sep and not span.startswith("…"):
            continue
        named.append(span)
        if not sep and not span.startswith("…"):
            continue
        if not files:
            problems.append(f"{span}: names no file before it")
            continue
        wanted = name or span
        defined = {f: _test_functions(f) for f in files}
        if wanted.startswith("…"):
            holders = [f for f, fs in defined.items() if any(t.endswith(wanted[1:]) for t in fs)]
        else:
            holders = [f for f, fs in defined.items() if wanted in fs]
        if not holders:
            problems.append(f"{span}: not a test in {', '.join(str(f.name) for f in files)}")
        else:
            files = holders
    return named, problems


@dataclass(frozen=True)
class Row:
    doc: str
    line: int
    situation: str
    tests: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.situation[:60]}"


def guarantee_rows() -> list[Row]:
    """Rows of every docs table whose last column is headed `Test`."""
    rows: list[Row] = []
    for path in DOCS:
        lines = _outside_fences(path.read_text()).splitlines()
        doc = path.relative_to(REPO).as_posix()
        header: list[str] | None = None
        for number, line in enumerate(lines, 1):
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if header is None:
                header = cells
            elif header[-1] == "Test" and not set(line) <= set("|- :"):
                rows.append(Row(doc, number, cells[0], cells[-1]))
    return rows


def test_the_docs_have_a_guarantee_table() -> None:
    assert len(guarantee_rows()) >= 40


@pytest.mark.parametrize("row", guarantee_rows(), ids=str)
def test_every_guarantee_row_names_tests_that_exist(row: Row) -> None:
    named, problems = named_tests(row.tests)
    assert named, f"{row}: names no test"
    assert not problems, f"{row}: {problems}"


def test_a_missing_test_file_or_function_is_caught() -> None:
    ok = (
        "`tests/integration/test_crash.py`, "
        "`test_group.py::test_a_gateway_stops_promptly_while_the_broker_holds_its_group_join`"
    )
    assert named_tests(ok)[1] == []
    assert named_tests("`tests/integration/test_nothing.py`")[1]
    assert named_tests("`test_group.py::test_that_does_not_exist`")[1]
    assert named_tests("`test_group.py` (`…_no_such_suffix`)")[1]


# --- paths the docs cite ----------------------------------------------------------

# Pages other branches of this wave write; the links to them stand once they are merged.
# Delete this set after the merge.
PAGES_OF_OTHER_BRANCHES = {
    "docs/spark-performance.md",
    "docs/spark-cluster.md",
    "docs/architecture.md",
}
TOP_DIRS = ("gateway", "spark_sink", "devtools", "tests", "deploy", "bench", "scripts", "grafana")


def test_every_repository_path_the_docs_cite_exists() -> None:
    missing = []
    for path in DOCS:
        prose = _outside_fences(path.read_text())
        for match in re.finditer(r"`([\w.-]+/[\w./-]*)(?::[^`]*)?`", prose):
            cited = match[1].rstrip(".")
            if cited.split("/")[0] in TOP_DIRS and not (REPO / cited).exists():
                missing.append(f"{path.name}:{_line_of(prose, match.start())}: {cited}")
        for match in re.finditer(r"\]\((?!https?:|#)([^)#]+)", prose):
            target = (path.parent / match[1]).resolve()
            if not target.exists() and str(target.relative_to(REPO)) not in PAGES_OF_OTHER_BRANCHES:
                missing.append(f"{path.name}:{_line_of(prose, match.start())}: link {match[1]}")
    assert not missing, "\n".join(missing)


def test_no_doc_cites_files_a_user_does_not_have() -> None:
    cited = [
        f"{path.name}:{number}"
        for path in DOCS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"ENVIRONMENT\.md|SEEDS\.md|STYLE\.md|\.\./shared", line)
    ]
    assert not cited, cited


# --- the configuration page -------------------------------------------------------


def test_the_configuration_page_lists_every_key_of_every_section() -> None:
    from pydantic import BaseModel

    from gateway.config import LaneSettings, Settings
    from spark_sink.config import SparkSettings

    rows = {
        cells[0].strip("` []"): cells[1]
        for line in (REPO / "docs" / "configuration.md").read_text().splitlines()
        if line.startswith("| `[") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    sections: dict[str, type[BaseModel]] = {"lanes": LaneSettings, "spark": SparkSettings}
    for name, field in Settings.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            sections[name] = field.annotation
    assert len(sections) >= 10
    for section, model in sections.items():
        assert section in rows, f"docs/configuration.md has no row for [{section}]"
        keys = {f.alias or name for name, f in model.model_fields.items()}
        missing = {key for key in keys if f"`{key}`" not in rows[section]}
        assert not missing, f"[{section}] keys missing from docs/configuration.md: {missing}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of `path`."""
    headings = re.findall(r"^#+ (.+)$", _outside_fences(path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_to_a_section_finds_its_heading() -> None:
    broken = []
    for path in DOCS:
        prose = _outside_fences(path.read_text())
        for match in re.finditer(r"\]\((?!https?:)([^)#]*)#([^)]+)\)", prose):
            target = (path.parent / match[1]).resolve() if match[1] else path
            if str(target.relative_to(REPO)) in PAGES_OF_OTHER_BRANCHES:
                continue
            if match[2] not in _anchors(target):
                broken.append(f"{path.name}:{_line_of(prose, match.start())}: {match[0]}")
    assert not broken, broken
