"""What `check-config --connect` says: one `Finding` per check, and the exit code
of the worst (gateway/ops/connect_check.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Severity(IntEnum):
    """A finding's weight; the command's exit code is the worst one's `code`."""

    OK = 0
    WARN = 1  # it runs, but a setting should change
    ERROR = 3  # the gateway would not start, or not keep its guarantees

    @property
    def code(self) -> int:
        return int(self)


@dataclass(frozen=True)
class Finding:
    severity: Severity
    where: str  # "redis 127.0.0.1:6379/0", "kafka", "topic clean"
    message: str

    def line(self) -> str:
        return f"{self.severity.name:<5} {self.where}: {self.message}"


def ok(where: str, message: str) -> Finding:
    return Finding(Severity.OK, where, message)


def warn(where: str, message: str) -> Finding:
    return Finding(Severity.WARN, where, message)


def error(where: str, message: str) -> Finding:
    return Finding(Severity.ERROR, where, message)


def exit_code(findings: list[Finding]) -> int:
    """0: all reached and fit; 1: warnings only; 3: at least one error."""
    return max((f.severity.code for f in findings), default=0)
