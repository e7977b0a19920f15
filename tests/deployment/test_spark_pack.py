"""scripts/pack-spark-env.sh: the venv-pack archive a cluster gets with
`spark-submit --archives env.tar.gz#environment`. Built once (about 1.5 min
here: the product plus pyarrow, pandas and confluent-kafka), then unpacked
the way YARN and Kubernetes do (plain tar into ./environment) and run with
its own bin/python, pyspark coming from "the cluster" (PYTHONPATH), and run
for real under spark-submit with the command line docs/operations.md gives,
on a `local-cluster` master: a Worker and a separate executor JVM that
unpacks the archive into its working directory, as on a cluster."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deployment.conftest import REPO

# Minutes (the pack built, then spark-submit on a local-cluster): `make test-long` runs it,
# beside the standalone cluster's tests.
pytestmark = [pytest.mark.timeout(600), pytest.mark.spark_cluster]

SCRIPT = REPO / "scripts" / "pack-spark-env.sh"
PYVER = f"python{sys.version_info[0]}.{sys.version_info[1]}"


def script_env(**extra: str) -> dict[str, str]:
    """The caller's environment with this venv's bin (venv-pack) first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.pop("PYTHON_PREFIX", None)
    env.update(extra)
    return env


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def nodes_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where "the nodes" have Python (PYTHON_PREFIX): another prefix than the
    one that builds, made of links to this machine's Python so it runs."""
    prefix = tmp_path_factory.mktemp("nodes-python")
    (prefix / "bin").mkdir()
    (prefix / "bin" / PYVER).symlink_to(Path(sys.base_prefix) / "bin" / PYVER)
    (prefix / "lib").symlink_to(Path(sys.base_prefix) / "lib")
    return prefix


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, nodes_python: Path) -> Path:
    archive = tmp_path_factory.mktemp("pack") / "env.tar.gz"
    build = subprocess.run(
        ["bash", str(SCRIPT), "-o", str(archive)],
        capture_output=True, text=True, timeout=540,
        env=script_env(PYTHON_PREFIX=str(nodes_python)),
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    return archive


@pytest.fixture(scope="module")
def cluster_pythonpath(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with only pyspark and py4j, as spark-submit puts its own
    pyspark.zip and py4j zip on the executors' PYTHONPATH."""
    folder = tmp_path_factory.mktemp("cluster-python")
    for name in ("pyspark", "py4j"):
        (folder / name).symlink_to(package_dir(name))
    return str(folder)


def test_dry_run_lists_the_spark_extra_without_pyspark() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True, text=True, timeout=60, env=script_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    names = [line.split(">")[0].split("<")[0].split("=")[0] for line in result.stdout.split()]
    assert "pyspark" not in names
    assert {"pyarrow", "pandas", "confluent-kafka"} <= set(names)


def test_archive_carries_the_job_and_its_dependencies_but_not_pyspark(packed: Path) -> None:
    listing = subprocess.run(["tar", "-tzf", str(packed)], capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    site = f"lib/{PYVER}/site-packages"
    for module in ("spark_sink/transforms.py", "spark_sink/__main__.py", "gateway/config.py",
                   "pyarrow/__init__.py", "confluent_kafka/__init__.py"):  # fmt: skip
        assert f"{site}/{module}" in listing, module
    assert not [n for n in listing if n.startswith(f"{site}/pyspark/")], "pyspark is the cluster's"
    assert not (REPO / "build").exists(), "the build must leave the checkout alone"


def test_unpacked_environment_runs_the_job_with_the_clusters_pyspark(
    packed: Path, cluster_pythonpath: str, nodes_python: Path, tmp_path: Path
) -> None:
    work = tmp_path / "container"  # a YARN/Kubernetes working directory
    (work / "environment").mkdir(parents=True)
    subprocess.run(["tar", "-xzf", str(packed), "-C", str(work / "environment")], check=True)
    # Every link out of the venv goes to PYTHON_PREFIX/bin/pythonX.Y.
    links = [os.readlink(p) for p in (work / "environment/bin").glob("python*") if p.is_symlink()]
    outside = [target for target in links if os.path.isabs(target)]
    assert outside and set(outside) == {str(nodes_python / "bin" / PYVER)}, links

    def run(*args: str, pythonpath: str | None) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin"} | ({"PYTHONPATH": pythonpath} if pythonpath else {})
        return subprocess.run(["./environment/bin/python", *args], capture_output=True,
                              text=True, timeout=120, cwd=work, env=env)  # fmt: skip

    check = "import spark_sink.transforms, gateway.config; print(spark_sink.__file__)"
    ran = run("-c", check, pythonpath=cluster_pythonpath)
    assert ran.returncode == 0, ran.stderr
    assert Path(ran.stdout.strip()).is_relative_to(work / "environment")
    usage = run("-m", "spark_sink", "--help", pythonpath=cluster_pythonpath)
    assert usage.returncode == 0 and "--config" in usage.stdout, usage.stderr
    # Without the cluster's pyspark the job cannot start: it is not in the archive.
    alone = run("-c", check, pythonpath=None)
    assert alone.returncode != 0 and "No module named 'pyspark'" in alone.stderr


PROBE_APP = """
import json, os, sys
from pyspark.sql import SparkSession

def probe(_):
    import pyspark, spark_sink.kafka_source, spark_sink.transforms
    yield {"executable": sys.executable, "spark_sink": spark_sink.transforms.__file__,
           "pyspark": pyspark.__file__, "cwd": os.getcwd(),
           "config_here": os.path.isfile("gateway.toml")}

spark = SparkSession.builder.appName("pack-probe").getOrCreate()
(result,) = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
print("PROBE " + json.dumps(result), flush=True)
spark.stop()
"""


@pytest.mark.spark
def test_spark_submit_runs_the_executors_python_from_the_archive(
    packed: Path, tmp_path: Path
) -> None:
    (tmp_path / "probe.py").write_text(PROBE_APP)
    (tmp_path / "gateway.toml").write_text("[kafka]\n")
    # SPARK_HOME is pyspark's package folder, seen through links: the
    # local-cluster Worker puts executor folders in SPARK_HOME/work, which must
    # not land in the venv.
    spark_home = tmp_path / "spark-home"
    spark_home.mkdir()
    for entry in package_dir("pyspark").iterdir():
        (spark_home / entry.name).symlink_to(entry)
    env = {k: v for k, v in script_env().items() if not k.startswith(("PYSPARK_", "PYTHONPATH"))}
    env |= {"SPARK_HOME": str(spark_home)}
    argv = [
        str(spark_home / "bin" / "spark-submit"),
        "--master", "local-cluster[1,1,1024]",
        # The documented line:
        "--archives", f"{packed}#environment",
        "--conf", "spark.pyspark.python=./environment/bin/python",
        "--files", "gateway.toml",
        # Client mode: the driver runs here, with this venv's Python.
        "--conf", f"spark.pyspark.driver.python={sys.executable}",
        "probe.py",
    ]  # fmt: skip
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=tmp_path, env=env)
    lines = [line for line in ran.stdout.splitlines() if line.startswith("PROBE ")]
    assert ran.returncode == 0 and lines, ran.stdout[-3000:] + ran.stderr[-5000:]
    probe = json.loads(lines[0].removeprefix("PROBE "))
    executor_dir = Path(probe["cwd"])
    assert executor_dir.is_relative_to(spark_home / "work"), "a separate executor"
    assert probe["executable"] == str(executor_dir / "environment" / "bin" / "python")
    assert Path(probe["spark_sink"]).is_relative_to(executor_dir / "environment")
    assert "pyspark.zip" in probe["pyspark"], "pyspark comes from the cluster"
    assert probe["config_here"], "--files puts gateway.toml in the working directory"
