"""Sizes: a class of more than MAX_CLASS_LINES holds more than one job, a module of
more than MAX_MODULE_LINES more than one part; both are split by job. Counted as
`ruff format` lays the code out with `# fmt: skip` kept on tables only (a literal
dict, list, set or tuple assigned a name): a skip that packs calls onto fewer lines
only hides a size. `Metrics` declares every metric in one place (gateway/metrics.py),
on purpose."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gateway
import spark_sink

MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 500
LARGE_CLASSES = {"gateway.metrics.Metrics"}
TABLES = (ast.Dict, ast.List, ast.Set, ast.Tuple)
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"


def sources() -> list[tuple[str, Path]]:
    out = []
    for package in (gateway, spark_sink):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def is_table(node: ast.stmt) -> bool:
    """An assignment of a literal container (or a call on one: `frozenset({...})`)."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return False
    value = node.value
    if isinstance(value, ast.Call) and value.args:
        value = value.args[0]
    return isinstance(value, TABLES)


def without_code_skips(text: str) -> str:
    """`text` with `# fmt: skip` taken off every statement but tables."""
    tables = {
        node.end_lineno
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.stmt) and is_table(node)
    }
    lines = text.splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        if "# fmt: skip" in line and n not in tables:
            lines[n - 1] = line.replace("  # fmt: skip", "").replace("# fmt: skip", "")
    return "".join(lines)


def laid_out(text: str, name: str) -> str:
    """`text` as `ruff format` writes it, code skips removed."""
    return subprocess.run(
        [RUFF, "format", "--stdin-filename", name, "-"],
        input=without_code_skips(text),
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def class_sizes(module: str, text: str) -> dict[str, int]:
    """`module.Class` -> its lines, decorators included (nested classes too)."""
    sizes = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            sizes[f"{module}.{node.name}"] = node.end_lineno - first + 1
    return sizes


@pytest.fixture(scope="module")
def laid_out_sources() -> dict[str, str]:
    return {module: laid_out(path.read_text(), str(path)) for module, path in sources()}


def test_no_class_over_300_lines_but_metrics_and_no_module_over_500(laid_out_sources):
    found = {
        name: size
        for module, text in laid_out_sources.items()
        for name, size in class_sizes(module, text).items()
    }
    assert "gateway.quorum.quorum.Quorum" in found and "spark_sink.sink.SinkCounts" in found
    assert set(found) >= LARGE_CLASSES
    over = {n: s for n, s in found.items() if s > MAX_CLASS_LINES and n not in LARGE_CLASSES}
    assert over == {}
    lines = {module: len(text.splitlines()) for module, text in laid_out_sources.items()}
    assert {m: n for m, n in lines.items() if n > MAX_MODULE_LINES} == {}


def test_a_class_over_the_limit_is_seen():
    body = "".join(f"    x{n} = {n}\n" for n in range(MAX_CLASS_LINES))
    sizes = class_sizes("p.probe", f"@decorated\nclass Big:\n{body}\n\nclass Small:\n    pass\n")
    assert sizes == {"p.probe.Big": MAX_CLASS_LINES + 2, "p.probe.Small": 2}


def test_a_skip_on_code_is_taken_off_and_one_on_a_table_kept():
    text = (
        "TABLE = {\n    1: 2,  3: 4,\n}  # fmt: skip\ndef f():\n    g(1,\n      2)  # fmt: skip\n"
    )
    out = laid_out(text, "probe.py")
    assert "1: 2,  3: 4," in out and out.count("# fmt: skip") == 1
    assert "    g(1, 2)\n" in out
