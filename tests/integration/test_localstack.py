"""`python -m devtools.localstack`: the stack a user without Kafka or Redis starts for
the quickstart. Run as a user would (a subprocess), on free ports."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from devtools.topics import create_topics
from tests.deployment.conftest import REPO

READY_WITHIN_S = 120.0


def _ports_closed(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True


async def test_the_local_stack_serves_kafka_and_three_members_until_sigterm(tmp_path: Path):
    proc = subprocess.Popen(  # noqa: ASYNC220 (read line by line from a thread below)
        [sys.executable, "-m", "devtools.localstack", "--free-ports", "--state-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while not lines or "ready" not in lines[-1]:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), READY_WITHIN_S)
            assert line, f"exited before ready: {lines}"
            lines.append(line.strip())
        text = "\n".join(lines)
        bootstrap = re.search(r'bootstrap_servers = "([^"]+)"', text)
        assert bootstrap, text
        urls = re.findall(r'"(redis://[^"]+)"', text)
        assert len(urls) == 3, text

        # Like a careful production broker, it creates no topic a client only names.
        properties = (tmp_path / "broker" / "server.properties").read_text().splitlines()
        assert "auto.create.topics.enable=false" in properties
        topic = TopicPartition("localstack-check", 0)
        await create_topics(bootstrap[1], {topic.topic: 1})
        async with AIOKafkaProducer(bootstrap_servers=bootstrap[1]) as producer:
            await producer.send_and_wait(topic.topic, b"v", partition=0)
        async with AIOKafkaConsumer(bootstrap_servers=bootstrap[1]) as consumer:
            consumer.assign([topic])
            await consumer.seek_to_beginning(topic)
            got = await consumer.getmany(topic, timeout_ms=10_000)
            assert [r.value for r in got[topic]] == [b"v"]
        for url in urls:
            client = aioredis.Redis.from_url(url)
            assert await client.ping()
            await client.aclose()
        ports = [int(bootstrap[1].rsplit(":", 1)[1])] + [
            int(u.split(":")[2].split("/")[0]) for u in urls
        ]

        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(asyncio.to_thread(proc.communicate), 60)
        assert proc.returncode == 0, rest
        assert "localstack: stopped" in rest[0]
        assert _ports_closed(ports)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
