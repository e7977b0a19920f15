"""The package's layers: no module imports upward (docs/architecture.md draws them).

Read from the source with ast, so an import inside a function counts too; an
import under `if TYPE_CHECKING:` does not (it names a type, it runs nothing).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway

PACKAGE = Path(gateway.__file__).parent

# Lowest first. A module may import its own unit and any unit of a lower layer;
# units of one layer do not import each other unless SIDEWAYS allows it.
LAYERS: list[set[str]] = [
    {"errors"},
    {
        "sizing",
        "member_urls",
        "contract",
        "waits",
        "client_properties",
        "settings_text",
        "progress",
        "faults",
    },
    {"config"},
    {"rules"},
    {"logs", "metrics"},
    {"kafka", "quorum"},
    {"raw", "delay", "failures"},
    {"ops", "service"},
    {"cli"},
    {"__main__"},
]
# The raw path hands decided-new records due later to the delay tiers (delay.router)
# and coalesced ones to the coalescer: the one sideways edge between the loops.
SIDEWAYS = {("raw", "delay")}
# What a pure rule may not import: anything that does I/O or keeps time.
NO_IO = ("asyncio", "redis", "aiohttp", "prometheus_client", "socket", "subprocess", "time")
# aiokafka's plain data types are values, not I/O.
AIOKAFKA_VALUES = {"TopicPartition", "ConsumerRecord"}


def unit_of(module: str) -> str:
    """`gateway.quorum.link` -> `quorum`; `gateway.config` -> `config`."""
    return module.split(".")[1]


def layer_of(unit: str) -> int:
    for n, units in enumerate(LAYERS):
        if unit in units:
            return n
    raise AssertionError(f"gateway/{unit} belongs to no layer: add it to LAYERS")


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            out.append((".".join(parts), path))
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import that runs, nested ones included."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            if node.module == "gateway":  # `from gateway import sizing`
                found.extend((f"gateway.{n}", []) for n in names)
            else:
                found.append((node.module, names))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


MODULES = modules()


def test_every_module_of_the_package_is_in_a_layer():
    assert len(MODULES) > 40
    for module, _ in MODULES:
        layer_of(unit_of(module))


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_no_module_imports_a_layer_above_its_own(module: str, path: Path):
    mine = unit_of(module)
    for target, _ in imports(path):
        if not target.startswith("gateway."):
            continue
        theirs = unit_of(target)
        if theirs == mine or (mine, theirs) in SIDEWAYS:
            continue
        assert layer_of(theirs) < layer_of(mine), (
            f"{module} imports {target}: gateway/{theirs} is not below gateway/{mine}"
        )


@pytest.mark.parametrize(
    ("module", "path"),
    [(m, p) for m, p in MODULES if unit_of(m) in ("rules", "contract")],
    ids=[m for m, _ in MODULES if unit_of(m) in ("rules", "contract")],
)
def test_pure_rules_and_the_contract_do_no_io(module: str, path: Path):
    for target, names in imports(path):
        assert target.split(".")[0] not in NO_IO, f"{module} imports {target}"
        if target == "aiokafka":
            assert set(names) <= AIOKAFKA_VALUES, f"{module} imports {names} from aiokafka"


def test_the_rule_can_fail(tmp_path: Path):
    """An upward import is seen, even inside a function: quorum importing the raw loop."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from gateway.raw.pipeline import Pipeline\n")
    ((found, names),) = imports(probe)
    assert (found, names) == ("gateway.raw.pipeline", ["Pipeline"])
    assert layer_of(unit_of(found)) > layer_of("quorum")
