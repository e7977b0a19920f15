"""Every log line a runbook tells operators to look for is one the code writes.

A runbook quotes a line with placeholders (`Redis member HOST:PORT/DB lost its data
(epoch ...)`); the gateway's own messages are read from its source with `ast` (each
logging call's format, its `%s` filled with what the argument can be when that is
written out, else any text; and every f-string). A quote no message matches fails:
the rebuild runbook once had operators grep for `Redis instance ... lost its data`
while the log said `Redis member ... lost its data`, and the grep found nothing.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

import gateway

REPO = Path(gateway.__file__).parent.parent
RUNBOOKS = [REPO / "docs" / "runbooks.md", REPO / "docs" / "operations.md"]
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
ANY = "\x00"  # what a placeholder of the message stands for
PLACEHOLDERS = re.compile(r"\.\.\.|HOST:PORT/DB|<[^>]+>|\b(?:REF|REASON|ID)\b")
# A quoted log line: a span in backticks with a placeholder, that is not a command,
# a metric, a key or a setting.
LOG = re.compile(r"\blog\b|log line|logs|prints|says")
NOT_A_LINE = re.compile(r"^(?:dedup[-_]gateway|GATEWAY_|redis-cli|<prefix>|ARGS|F\.|-XX)")


def _text(node: ast.AST) -> list[str]:
    """What an expression can be, written out: a literal, either literal of a
    conditional, else anything."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _text(node.body) + _text(node.orelse)
    if isinstance(node, ast.JoinedStr):
        return ["".join(_text(v)[0] if isinstance(v, ast.Constant) else ANY for v in node.values)]
    return [ANY]


def _format(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _format(node.left), _format(node.right)
        return None if left is None or right is None else left + right
    return None


def messages() -> list[str]:
    """The gateway's log messages and f-strings, placeholders as ANY."""
    found: list[str] = []
    for path in sorted((REPO / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                found += _text(node)
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS
                and node.args
            ):
                continue
            fmt = _format(node.args[0])
            if fmt is None:
                continue
            parts = re.split(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgix]", fmt)
            choices = [_text(arg) for arg in node.args[1:]][: len(parts) - 1]
            choices += [[ANY]] * (len(parts) - 1 - len(choices))
            for filled in itertools.islice(itertools.product(*choices), 64):
                found.append("".join(p + v for p, v in zip(parts, [*filled, ""], strict=True)))
    return found


def quoted_lines(text: str) -> list[str]:
    """The log lines a page quotes: a quote in backticks or double quotes (it may run
    over lines of a paragraph) with a placeholder, that the sentence before it says the
    log holds or start-up prints. Code blocks are commands, not quotes."""
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)
    quotes = []
    for pattern in (r"`([^`]+?)`", r"\"([^\"]+?)\""):
        for found in re.finditer(pattern, text):
            quote = " ".join(found[1].split())
            before = text[max(0, found.start() - 100) : found.start()].split("\n\n")[-1]
            if PLACEHOLDERS.search(quote) and not NOT_A_LINE.match(quote) and LOG.search(before):
                quotes.append(quote)
        text = re.sub(pattern, "", text)  # double quotes inside backticks are not quotes
    return quotes


def matches(quote: str, message: str) -> bool:
    pattern = ".+?".join(
        re.escape(piece) for piece in PLACEHOLDERS.split(quote)
    )  # a placeholder is any text
    return re.search(pattern, " ".join(message.replace(ANY, "X").split())) is not None


QUOTES = [
    (page.name, quote)
    for page in RUNBOOKS
    if page.exists()
    for quote in quoted_lines(page.read_text())
]


def test_the_runbooks_quote_log_lines():
    assert len(QUOTES) >= 4


@pytest.mark.parametrize(("page", "quote"), QUOTES, ids=[q for _, q in QUOTES])
def test_a_log_line_a_runbook_quotes_is_one_the_code_writes(page: str, quote: str):
    assert any(matches(quote, m) for m in MESSAGES), f"{page}: no message matches `{quote}`"


MESSAGES = messages()


def test_the_check_can_fail():
    """The rebuild runbook's old quote matches no message; its fix does."""
    assert not any(matches("Redis instance HOST:PORT/DB lost its data (epoch ...)", m)
                   for m in MESSAGES)  # fmt: skip
    assert any(matches("Redis member HOST:PORT/DB lost its data (epoch ...)", m) for m in MESSAGES)
