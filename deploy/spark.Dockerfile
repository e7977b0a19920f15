# syntax=docker/dockerfile:1.7
# The Spark job (spark_sink) on the official Apache Spark image, with Spark's
# own Kafka connector on the classpath (so the job uses the native Kafka source).
# Build from the repository root (the context):
#   docker build -f deploy/spark.Dockerfile -t dedup-spark-sink .
#
# The official image runs Python 3.10 (Ubuntu jammy) and this project needs 3.11,
# so a standalone CPython 3.11 is installed by uv into /opt/venv and PySpark
# is taken from the image's own /opt/spark/python (the same version as the jars).
# The Spark version is the pyspark pinned in constraints.txt (the one tested;
# tests/deployment/test_constraints.py), and the venv's packages are pinned by it too:
# the `spark` extra minus pyspark, plus py4j for the image's pyspark.

ARG SPARK_IMAGE=apache/spark:4.2.0-scala2.13-java17-python3-ubuntu
ARG KAFKA_CONNECTOR=org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0

# --- connector: resolve the Kafka connector and its dependencies once ---------
FROM ${SPARK_IMAGE} AS connector
ARG KAFKA_CONNECTOR
# Running the bundled SparkPi with --packages makes Ivy fetch the connector and
# its transitive jars (kafka-clients, commons-pool2, token provider) at build time.
RUN /opt/spark/bin/spark-submit --master "local[1]" \
        --conf spark.jars.ivy=/tmp/ivy --packages "${KAFKA_CONNECTOR}" \
        --class org.apache.spark.examples.SparkPi \
        /opt/spark/examples/jars/spark-examples.jar 1 \
 && ls /tmp/ivy/jars/

# --- builder: the project as a wheel ------------------------------------------
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY gateway/ gateway/
COPY spark_sink/ spark_sink/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && cp constraints.txt /wheels/

# --- uv, pinned ----------------------------------------------------------------
FROM ghcr.io/astral-sh/uv:0.9.30 AS uv

# --- runtime --------------------------------------------------------------------
FROM ${SPARK_IMAGE}
# root (uid 0) only to install; the image's spark user (uid 185) runs the job.
USER 0
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    uv venv --python 3.11 /opt/venv \
 && uv pip install --python /opt/venv/bin/python --constraints /wheels/constraints.txt \
        /wheels/dedup_gateway-*.whl pyarrow pandas confluent-kafka py4j \
 && mkdir -p /var/lib/spark/checkpoint /var/lib/spark/output /etc/dedup-gateway \
 && chown -R spark:spark /var/lib/spark

COPY --from=connector /tmp/ivy/jars/ /opt/spark/jars/
COPY deploy/config/gateway.toml /etc/dedup-gateway/gateway.toml

# Driver and executors use the 3.11 venv; `pyspark` comes from the image.
ENV PATH=/opt/venv/bin:${PATH} \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/venv/bin/python \
    PYTHONPATH=/opt/spark/python

USER 185:185
WORKDIR /opt/spark/work-dir
VOLUME ["/var/lib/spark"]
# The image's entrypoint passes unknown commands through (exec "$@").
CMD ["/opt/venv/bin/python", "-m", "spark_sink", "--config", "/etc/dedup-gateway/gateway.toml"]
