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
    {"errors", "masking"},
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
    {"settings"},  # the settings file's values and sections
    {"config"},
    {"rules"},
    {"logs", "metrics"},
    {"kafka", "quorum"},
    {"raw", "delay", "failures"},
    {"ops", "service"},
    {"cli"},
    {"__main__"},
]
# Units of one layer that may import each other (none: the raw pipeline's route through
# the delay tiers is handed to it by the composition root, gateway/raw/routes.py).
SIDEWAYS: set[tuple[str, str]] = set()
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


def imports(path: Path, type_checking: bool = False) -> list[tuple[str, list[str]]]:
    """(module, names) of every import that runs, nested ones included; with
    `type_checking`, those under `if TYPE_CHECKING:` too."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking(node) and not type_checking:
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


def import_graph(found: list[tuple[str, Path]], type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports (`from pkg import module` counts as
    the module; a name from a module as that module)."""
    names = {m for m, _ in found}
    graph: dict[str, set[str]] = {}
    for module, path in found:
        edges = graph.setdefault(module, set())
        for target, imported in imports(path, type_checking):
            submodules = {f"{target}.{n}" for n in imported} & names
            edges.update(submodules or ({target} & names))
        edges.discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_type_checking_included():
    """A part that takes the facade it is built by (an import under TYPE_CHECKING
    too) is a circle: it takes values instead (gateway/quorum/calls.py)."""
    assert cycles(import_graph(MODULES)) == []


def test_a_cycle_under_type_checking_is_seen(tmp_path: Path):
    one, two = tmp_path / "one.py", tmp_path / "two.py"
    one.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.two import T\n")
    two.write_text("from p.one import O\n")
    graph = import_graph([("p.one", one), ("p.two", two)])
    assert cycles(graph) == [{"p.one", "p.two"}]
    assert cycles(import_graph([("p.one", one), ("p.two", two)], type_checking=False)) == []


# The raw, delay and failure loops are steps on the one consumer loop
# (gateway/kafka/loop.py): none of their packages fetches, gets past an unparseable
# record or commits on its own. `inspect`'s scan of the tiers (an operator's one-off
# read, no group) is the exception.
STEPS_ONLY = ("raw", "delay", "failures")
STEPS_ONLY_EXCEPT = {"gateway.delay.scan"}
OWN_LOOP_TEXT = ("getmany(", "except UnicodeDecodeError")
# Kafka calls that commit; `self.commits.commit(...)` and `self.completion.commit(...)`
# are the shared paths (kafka/commits.py, kafka/completion.py).
COMMIT_CALLS = {"commit", "commit_transaction", "send_offsets_to_transaction", "begin_transaction"}


def own_loop_parts(path: Path) -> list[str]:
    """What in `path` fetches, salvages or commits on its own, as (line: what)."""
    text = path.read_text()
    found = [f"{n}: {s}" for n, line in enumerate(text.splitlines(), 1)
             for s in OWN_LOOP_TEXT if s in line]  # fmt: skip
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.strip("_") in (
            "commit",
            "salvage",
        ):
            found.append(f"{node.lineno}: def {node.name}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in COMMIT_CALLS
            and not (
                isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in ("commits", "completion")
            )
        ):
            found.append(f"{node.lineno}: .{node.func.attr}(")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_raw_delay_and_failure_loops_do_not_fetch_salvage_or_commit_on_their_own():
    checked = [(m, p) for m, p in MODULES
               if unit_of(m) in STEPS_ONLY and m not in STEPS_ONLY_EXCEPT]  # fmt: skip
    assert {unit_of(m) for m, _ in checked} == set(STEPS_ONLY)
    found = {m: own_loop_parts(p) for m, p in checked}
    assert {m: parts for m, parts in found.items() if parts} == {}
    assert own_loop_parts(PACKAGE / "delay" / "scan.py")  # the exception is one indeed


def test_a_loop_of_its_own_is_seen(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "async def run(self):\n"
        "    try:\n"
        "        batch = await self.consumer.getmany(timeout_ms=1)\n"
        "    except UnicodeDecodeError:\n"
        "        pass\n"
        "    await self.commits.commit({})\n"
        "    await self.consumer.commit({})\n"
        "async def _commit(self): ...\n"
    )
    assert own_loop_parts(probe) == [
        "3: getmany(", "4: except UnicodeDecodeError", "7: .commit(", "8: def _commit",
    ]  # fmt: skip


# Exactly-once is a completion class chosen once (gateway/kafka/completion.py, picked in
# service/app.py): no other module reads `[kafka] exactly_once`, holds a `Transactions`
# or asks which completion it has. `check-config --connect` reports the setting.
EXACTLY_ONCE_DECIDED_IN = {
    "gateway.kafka.completion", "gateway.kafka.exactly_once", "gateway.service.app",
    "gateway.ops.check_kafka", "gateway.config",
}  # fmt: skip
OUTPUT_MODE_NAMES = {"exactly_once", "Transactions", "PlainCompletion", "TransactionalCompletion"}


def output_mode_checks(path: Path) -> list[str]:
    """Where `path` reads the output mode, as (line: name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = (
            node.attr if isinstance(node, ast.Attribute)
            else node.id if isinstance(node, ast.Name)
            else node.name if isinstance(node, ast.alias)
            else None
        )  # fmt: skip
        if name in OUTPUT_MODE_NAMES:
            found.append(f"{getattr(node, 'lineno', 0)}: {name}")
    return found


def test_no_loop_asks_whether_exactly_once_is_on():
    checked = [(m, p) for m, p in MODULES
               if m not in EXACTLY_ONCE_DECIDED_IN and unit_of(m) != "settings"]  # fmt: skip
    found = {m: output_mode_checks(p) for m, p in checked}
    assert {m: names for m, names in found.items() if names} == {}


def test_an_output_mode_check_is_seen(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from gateway.kafka.exactly_once import Transactions\n"
        "if settings.kafka.exactly_once == 'on':\n"
        "    pass\n"
    )
    assert output_mode_checks(probe) == ["1: Transactions", "2: exactly_once"]


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph as one of units: `gateway.rules.classify` -> `rules`."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = units.setdefault(unit_of(module), set())
        edges.update(unit_of(target) for target in targets)
        edges.discard(unit_of(module))
    return units


def test_no_two_packages_import_each_other_type_checking_included():
    """A package that names another's type under TYPE_CHECKING while that one imports
    it (rules <-> kafka, once: `Decided` carried produce batches) is one part in two."""
    assert cycles(unit_graph(import_graph(MODULES))) == []


def test_a_loop_between_packages_is_seen():
    graph = {"gateway.rules.a": {"gateway.kafka.b"}, "gateway.kafka.b": {"gateway.rules.c"}}
    assert cycles(unit_graph(graph)) == [{"rules", "kafka"}]


# The Spark job leans on the settings, the record contract, the Kafka clients' options
# and the admin client's checks; never on a loop, an operator command or the machinery
# of exactly-once output. The gateway imports nothing of the job.
SPARK_SINK = PACKAGE.parent / "spark_sink"
SPARK_SINK_MAY_NOT_IMPORT = (
    "gateway.ops",
    "gateway.service",
    "gateway.raw",
    "gateway.delay",
    "gateway.failures",
    "gateway.quorum",
    "gateway.cli",
    "gateway.kafka.transactions",
    "gateway.kafka.exactly_once",
    "gateway.kafka.completion",
    "gateway.kafka.loop",
)


def leaning_on_the_gateway(path: Path) -> list[str]:
    """What of the gateway's loops, commands and transactions `path` imports."""
    found = imports(path, type_checking=True)
    return [target for target, _ in found if target.startswith(SPARK_SINK_MAY_NOT_IMPORT)]


def test_the_spark_job_does_not_lean_on_the_gateways_loops_or_commands():
    found = {p.name: leaning_on_the_gateway(p) for p in sorted(SPARK_SINK.glob("*.py"))}
    assert len(found) > 10
    assert {name: targets for name, targets in found.items() if targets} == {}


def test_leaning_on_the_gateway_is_seen(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text("from gateway.ops.topics import existing_topics\nimport gateway.config\n")
    assert leaning_on_the_gateway(probe) == ["gateway.ops.topics"]


def test_the_gateway_imports_nothing_of_the_spark_job():
    found = {
        module: [t for t, _ in imports(path, type_checking=True) if t.split(".")[0] == "spark_sink"]
        for module, path in MODULES
    }
    assert {module: targets for module, targets in found.items() if targets} == {}
