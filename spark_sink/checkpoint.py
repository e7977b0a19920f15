"""Where the job keeps Spark's checkpoint, and what is checked of it before a Spark
session starts (`check_checkpoint`), each in one line naming `[spark] checkpoint_dir`:
a local path that is a file, and a checkpoint left by a run on another clean topic
(Spark would fail the query with "Some data may have been lost", its stack, and no
word of the setting). Checkpoints on Hadoop URIs (hdfs://, s3a://) are Spark's to check.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config import ConfigError
from spark_sink.config import SinkSettings


def spark_checkpoint(settings: SinkSettings) -> str:
    """Spark's own checkpoint (offsets, commits, state) inside `spark.checkpoint_dir`
    (a local path or a Hadoop URI)."""
    return f"{str(settings.spark.checkpoint_dir).rstrip('/')}/query"


def local_checkpoint(settings: SinkSettings) -> bool:
    """Whether `spark.checkpoint_dir` is on the local file system (a path or file:)."""
    scheme = urlsplit(str(settings.spark.checkpoint_dir)).scheme
    return scheme in ("", "file")


def topics_read(offsets_file: Path) -> set[str]:
    """The topics a Kafka-source offsets entry names (Spark's `offsets/<batch>` file:
    a version line, the batch's metadata, then one JSON line per source holding
    `{"topic": {"partition": offset}}`); empty when the file says otherwise."""
    topics: set[str] = set()
    for line in offsets_file.read_text(errors="replace").splitlines()[2:]:
        try:
            source = json.loads(line)
        except ValueError:
            continue
        if isinstance(source, dict):
            topics |= {name for name, value in source.items() if isinstance(value, dict)}
    return topics


def check_checkpoint(settings: SinkSettings) -> None:
    """ConfigError, one line naming `spark.checkpoint_dir`, for a local checkpoint this
    job cannot use: a file, or the offsets of another clean topic."""
    if not local_checkpoint(settings):
        return
    where = str(settings.spark.checkpoint_dir)
    folder = Path(urlsplit(where).path if where.startswith("file:") else where)
    setting = f'spark.checkpoint_dir = "{where}"'
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"{setting}: a file, not a folder: point it at a folder (created if missing)"
        )
    offsets = folder / "query" / "offsets"
    batches = (
        [int(p.name) for p in offsets.iterdir() if p.name.isdigit()] if offsets.is_dir() else []
    )
    if not batches:
        return
    topics = topics_read(offsets / str(max(batches)))
    clean = settings.kafka.clean_topic
    if topics and clean not in topics:
        names = ", ".join(repr(name) for name in sorted(topics))
        raise ConfigError(
            f"{setting}: holds a run's offsets of topic {names}, not of kafka.clean_topic = "
            f'"{clean}": give each clean topic a checkpoint_dir of its own (a new one starts '
            "from [spark] starting_offsets), or set clean_topic back"
        )
