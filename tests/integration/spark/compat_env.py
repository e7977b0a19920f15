"""A virtualenv with the project's dependencies and another pyspark (3.5.x, 4.0.x...),
for the Spark compatibility runs: `make spark-compat SPARK=3.5.7` (the tests marked
`spark_compat`, run in that venv) and tests/integration/spark/test_compat.py (one whole
loop on Spark 3.5, part of `make test`).

The venv holds third-party packages only: the checkout's code comes from PYTHONPATH
(pytest's `pythonpath`, or the job's subprocess environment), so one venv per Spark
version serves every checkout. It lives under `DEDUP_VENV_CACHE` (default
`~/.cache/dedup-gateway/venvs`) and is rebuilt only when what it should hold changes
(pyproject.toml's dependencies, constraints.txt, the version).

    python -m tests.integration.spark.compat_env 3.5.7            # prints the venv's python
    python -m tests.integration.spark.compat_env 3.5.7 --pytest -- -x   # the compat tests there
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[3]
# pyspark pins its py4j exactly (3.5: 0.10.9.7, 4.x: 0.10.9.9): both come from pyspark.
REPINNED = ("pyspark", "py4j")
# What tests/conftest.py and the Spark tests need besides the product (pytest's plugins
# named in pyproject.toml's ini options: asyncio mode, timeout; xdist for `-n`).
TEST_TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist")
INSTALL_TIMEOUT_S = 900.0
# Where the tests marked spark_compat are.
TEST_PATHS = ("tests/unit/spark", "tests/integration/spark")
READY = ".complete"


class CompatEnvError(RuntimeError):
    """The venv could not be built (no network, a version PyPI does not serve...)."""


def cache_root() -> Path:
    return Path(os.environ.get("DEDUP_VENV_CACHE", "~/.cache/dedup-gateway/venvs")).expanduser()


def venv_folder(spark_version: str) -> Path:
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / f"spark-{spark_version}-py{py}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def requirements(spark_version: str) -> list[str]:
    """The product's dependencies and its `spark` extra with `pyspark==<version>`, plus
    the test tools pinned by the `dev` extra's bounds."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["spark"]]
    wanted += [r for r in extras["dev"] if Requirement(r).name in TEST_TOOLS]
    kept = [r for r in wanted if Requirement(r).name not in REPINNED]
    return [*kept, f"pyspark=={spark_version}"]


def constraints() -> str:
    """constraints.txt without the lines `REPINNED` packages take from pyspark."""
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return "\n".join(
        line
        for line in lines
        if not line.strip() or line.lstrip().startswith("#")
        or Requirement(line).name not in REPINNED
    ) + "\n"  # fmt: skip


def fingerprint(spark_version: str) -> str:
    text = "\n".join([*requirements(spark_version), constraints(), sys.version])
    return hashlib.sha256(text.encode()).hexdigest()


def ready(spark_version: str) -> bool:
    marker = venv_folder(spark_version) / READY
    return marker.is_file() and marker.read_text().strip() == fingerprint(spark_version)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One builder per venv at a time (two test workers, or a test and `make`)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f"{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def compat_venv(spark_version: str) -> Path:
    """The venv for `spark_version`, built once (a second call finds it ready)."""
    folder = venv_folder(spark_version)
    with _locked(folder):
        if ready(spark_version):
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        print(f"compat: building {folder} (pyspark {spark_version})", file=sys.stderr)
        _run([sys.executable, "-m", "venv", str(folder)])
        pins = folder / "constraints.txt"
        pins.write_text(constraints())
        pip = [str(python_of(folder)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "-c", str(pins), *requirements(spark_version)])
        (folder / READY).write_text(fingerprint(spark_version) + "\n")
    return folder


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise CompatEnvError(f"{argv[:4]} took over {INSTALL_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise CompatEnvError(f"{' '.join(argv[:6])} ... failed:\n{tail}")


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process of the compat venv: this checkout on PYTHONPATH,
    none of this session's PYSPARK_* settings (they name this venv's Python)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "PYTHONPATH"))}
    return env | {"PYTHONPATH": str(REPO)} | (extra or {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.integration.spark.compat_env",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spark_version", help="a pyspark version PyPI serves, e.g. 3.5.7")
    parser.add_argument("--pytest", action="store_true",
                        help="run the tests marked spark_compat in the venv (after --, pytest's"
                        " own arguments)")  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    from devtools.jars import JarFetchError, spark_kafka_jars

    try:
        venv = compat_venv(args.spark_version)
        jars = spark_kafka_jars(args.spark_version)
    except (CompatEnvError, JarFetchError) as exc:
        print(f"compat: {exc}", file=sys.stderr)
        return 1
    if not args.pytest:
        print(python_of(venv))
        return 0
    print(f"compat: pyspark {args.spark_version} in {venv}, connector {jars}", file=sys.stderr)
    rest = [a for a in rest if a != "--"]
    command = [str(python_of(venv)), "-m", "pytest", "-m", "spark_compat", "-p",
               "no:cacheprovider", *TEST_PATHS, *rest]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=job_env()).returncode


if __name__ == "__main__":
    raise SystemExit(main())
