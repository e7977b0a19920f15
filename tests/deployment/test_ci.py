"""CI runs the README's own test command, then `make test-long`: `.ci/run` and the
README cannot drift apart."""

from __future__ import annotations

import re

from tests.deployment.conftest import REPO


def first_code_block(markdown: str) -> list[str]:
    match = re.search(r"^```sh\n(.*?)^```", markdown, re.S | re.M)
    assert match, "the README has no sh code block"
    return match[1].splitlines()


def test_ci_runs_the_readme_test_command_as_written() -> None:
    readme = first_code_block((REPO / "README.md").read_text())
    test_command = next(line for line in readme if line.startswith("make test"))
    assert test_command == "make test", "the README's test command is a line of its own"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line and not line.startswith(("#", "set ", "cd "))]
    assert commands == [test_command, "make test-long"]
    # The long runs are documented beside it, as a command a user can run.
    assert "make test-long" in (REPO / "README.md").read_text()
