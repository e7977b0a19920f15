"""A release's package, as docs/operations.md ("Releases") cuts it: `python -m build`
makes the sdist and, from it, the wheel (so the sdist is complete); `twine check
--strict` accepts both; the wheel carries every module, the Lua scripts and the
`dedup-gateway` command; and the version has one source, pyproject.toml, which the
installed package reports at run time (importlib.metadata)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.deployment.conftest import REPO, tool

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


def _copy_of_the_checkout(into: Path) -> Path:
    """The files git would commit (tracked and new, not ignored): a build here would
    leave build/ and egg-info folders in the shared checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make dist` in a copy of the checkout, with this venv and no set-up: python -m
    build, then twine check --strict."""
    source = _copy_of_the_checkout(tmp_path_factory.mktemp("src"))
    venv = Path(sys.executable).parent.parent
    # -o: the venv's stamp is taken as up to date whatever the copy's file times say
    # (else make would run the set-up, installing this venv's package from the copy).
    result = subprocess.run(
        ["make", "-C", str(source), "-o", f"{venv}/.installed", "dist", f"VENV={venv}"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("PASSED") == 2, result.stdout[-3000:]
    return source / "dist"


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    return wheel


def test_build_makes_one_wheel_and_one_sdist_of_the_pyproject_version(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    assert names == [
        f"dedup_gateway-{VERSION}-py3-none-any.whl",
        f"dedup_gateway-{VERSION}.tar.gz",
    ]


def test_twine_check_accepts_both(dist: Path) -> None:
    result = subprocess.run(
        [tool("twine"), "check", "--strict", *map(str, sorted(dist.iterdir()))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_wheel_carries_every_module_the_scripts_and_the_command(dist: Path) -> None:
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        names = set(wheel.namelist())
        info = f"dedup_gateway-{VERSION}.dist-info"
        metadata = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    for package in ("gateway", "spark_sink"):
        for module in (REPO / package).rglob("*.py"):
            assert module.relative_to(REPO).as_posix() in names, module
    lua = {p.relative_to(REPO).as_posix() for p in (REPO / "gateway/quorum/lua").glob("*.lua")}
    assert lua and lua <= names
    assert "spark_sink/log4j2.properties" in names  # the job's driver logging
    assert not [n for n in names if n.startswith(("tests/", "devtools/", "bench/"))]
    assert "dedup-gateway = gateway.cli:main" in entry_points
    assert metadata["Version"] == VERSION
    assert metadata["Name"] == PROJECT["name"]
    assert metadata["Description-Content-Type"] == "text/markdown"
    required = {str(Requirement(r)) for r in metadata.get_all("Requires-Dist") if ";" not in r}
    assert {str(Requirement(d)) for d in PROJECT["dependencies"]} == required


def test_the_installed_wheel_reports_its_version_at_run_time(dist: Path, tmp_path: Path) -> None:
    """Installed alone (its dependencies from this venv), `dedup-gateway --version` is the
    built package's version, read from its metadata, not a literal in the code."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", str(target), str(_wheel(dist))],
        check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    site = sysconfig.get_paths()["purelib"]
    result = subprocess.run(
        [sys.executable, "-I", "-c",
         f"import sys; sys.path[:0] = [{str(target)!r}, {site!r}]; "
         "import gateway.cli, importlib.metadata as m; "
         "print(gateway.cli.__file__); print(m.version('dedup-gateway')); "
         "sys.argv = ['dedup-gateway', '--version']; gateway.cli.main()"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(target)), "the installed wheel's code ran"
    assert lines[1:] == [VERSION, f"dedup-gateway {VERSION}"], result.stdout + result.stderr


def test_no_code_states_the_version_itself() -> None:
    """One source: pyproject.toml. The code asks importlib.metadata
    (gateway.metrics.package_version); the chart and the kustomize tags are checked
    against it by test_helm.py and test_kubernetes.py."""
    literal = re.compile(r"""(__version__\s*=|version\s*=\s*["']\d+\.\d+)""")
    for package in ("gateway", "spark_sink"):
        for module in (REPO / package).rglob("*.py"):
            assert not literal.search(module.read_text()), module
    assert 'version("dedup-gateway")' in (REPO / "gateway" / "metrics.py").read_text()


@pytest.mark.release_install
def test_the_wheel_installs_by_name_in_a_fresh_venv_with_its_extras(
    dist: Path, tmp_path: Path
) -> None:
    """What docs/development.md tells a user: `pip install --find-links dist
    "dedup-gateway[local]"` in a venv of their own (dependencies from the package
    index, at constraints.txt's versions), then the command runs from that venv."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--find-links", str(dist),
         "-c", str(REPO / "constraints.txt"), "dedup-gateway[local]"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    command = venv / "bin" / "dedup-gateway"
    version = subprocess.run([str(command), "--version"], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)  # fmt: skip
    assert version.stdout.strip() == f"dedup-gateway {VERSION}", version.stderr
    checked = subprocess.run(
        [str(command), "check-config", "--config", str(REPO / "deploy/config/gateway.k8s.toml")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert "[kafka]" in checked.stdout
    extra = subprocess.run(
        [str(python), "-c", "import confluent_kafka, gateway, sys; print(gateway.__file__)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert extra.stdout.startswith(str(venv)), extra.stdout + extra.stderr


def test_the_changelog_names_the_version() -> None:
    """The release's section heads the changelog (Keep a Changelog: `## [0.1.0] - ...`)."""
    changelog = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert headings and headings[0] == VERSION, headings[:3]
