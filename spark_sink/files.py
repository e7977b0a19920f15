"""Small files and directories under a root URI through Hadoop's FileSystem API: the
sink's markers and stored outcomes (`spark_sink.sink`), on a local path or any Hadoop
URI (file:, hdfs:, s3a:...)."""

from __future__ import annotations

import logging
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

CHECKSUM_EXCEPTION = "org.apache.hadoop.fs.ChecksumException"


class CheckpointFiles:
    """Small files and directories under a root URI, through Hadoop's FileSystem API
    (the same one Spark uses for its checkpoint), never Python file calls: the
    root may be a local path or any Hadoop URI (file:, hdfs:, s3a:...)."""

    def __init__(self, spark: SparkSession, root: str) -> None:
        jvm: Any = spark._jvm
        jsc: Any = spark._jsc
        # Looked up once: each step of `jvm.org.apache...` is a round trip over py4j.
        self._path_class: Any = jvm.org.apache.hadoop.fs.Path
        self.root = root.rstrip("/") or "/"
        self._fs: Any = self._path_class(self.root).getFileSystem(jsc.hadoopConfiguration())

    def uri(self, relative: str) -> str:
        """The URI of `relative` (slash-separated) under the root."""
        return f"{self.root}/{relative}"

    def _path(self, relative: str) -> Any:
        return self._path_class(self.uri(relative))

    def exists(self, relative: str) -> bool:
        return bool(self._fs.exists(self._path(relative)))

    def read_text(self, relative: str) -> str | None:
        """The file's text (UTF-8); None when it does not exist, or fails its checksum
        (a local file cut short by a crash: its .crc sidecar no longer matches)."""
        path = self._path(relative)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            # One call over py4j (not one a line); bytes that are not UTF-8 read as U+FFFD.
            return bytes(stream.readAllBytes()).decode(errors="replace")
        except Py4JJavaError as exc:
            if exc.java_exception.getClass().getName() == CHECKSUM_EXCEPTION:
                logger.warning("%s fails its checksum; treating it as absent", self.uri(relative))
                return None
            raise
        finally:
            stream.close()

    def write_text(self, relative: str, text: str) -> None:
        """Create or replace the file (creating its directories) with `text`."""
        path = self._path(relative)
        self._fs.mkdirs(path.getParent())
        out = self._fs.create(path, True)
        try:
            out.write(bytearray(text.encode()))
        finally:
            out.close()

    def names(self, relative: str) -> list[str]:
        """Names of the entries of a directory; empty when it does not exist."""
        path = self._path(relative)
        if not self._fs.exists(path):
            return []
        return [str(status.getPath().getName()) for status in self._fs.listStatus(path)]

    def delete(self, relative: str) -> None:
        """Delete a file or a whole directory (nothing when absent)."""
        self._fs.delete(self._path(relative), True)

    def replace(self, source: str, target: str) -> None:
        """Move `source` (a file or directory) to `target`, replacing what is there."""
        self._fs.delete(self._path(target), True)
        destination = self._path(target)
        self._fs.mkdirs(destination.getParent())
        if not self._fs.rename(self._path(source), destination):
            raise OSError(f"could not move {self.uri(source)} to {self.uri(target)}")
