"""Demo traffic for the compose stack: JSON orders with a `message-id` header,
a share of them sent again as duplicates (same id, same value).

    docker compose --profile loadgen up          # with the rest of the stack
    python loadgen.py --bootstrap localhost:29092 --rate 500 --duplicates 0.3

Self-contained (only aiokafka, which the gateway image has): compose mounts
this file into a container of the gateway image. Records have no key, so the
copies of one id land on different partitions, as producer retries from
different clients would. Runs until SIGTERM, or until --records are sent;
prints what it sent as one JSON line at the end. Settings also come from
LOADGEN_* environment variables (LOADGEN_BOOTSTRAP, LOADGEN_RATE, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer

CUSTOMERS = [f"customer-{i:03d}" for i in range(50)]
# Ids sent recently, from which duplicates are drawn.
RECENT = 10_000


def parse(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default=env("LOADGEN_BOOTSTRAP", "kafka:9092"))
    parser.add_argument("--topic", default=env("LOADGEN_TOPIC", "raw"))
    parser.add_argument(
        "--rate", type=float, default=float(env("LOADGEN_RATE", "200")),
        help="records per second; 0 = as fast as the broker takes them",
    )  # fmt: skip
    parser.add_argument(
        "--duplicates", type=float, default=float(env("LOADGEN_DUPLICATES", "0.2")),
        help="share of records that repeat an earlier id, 0 to <1",
    )  # fmt: skip
    parser.add_argument(
        "--records", type=int, default=int(env("LOADGEN_RECORDS", "0")),
        help="stop after this many records; 0 = until SIGTERM",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    if not 0 <= args.duplicates < 1:
        parser.error("--duplicates must be in [0, 1)")
    if args.rate < 0 or args.records < 0:
        parser.error("--rate and --records must not be negative")
    return args


def order(message_id: str, rng: random.Random) -> bytes:
    body = {
        "order_id": message_id,
        "customer": rng.choice(CUSTOMERS),
        "amount": f"{rng.uniform(1, 500):.2f}",
    }
    return json.dumps(body).encode()


async def run(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    rng = random.Random(args.seed)
    run_id = uuid.UUID(int=rng.getrandbits(128)).hex[:8]
    recent: list[tuple[str, bytes]] = []
    sent = duplicates = 0
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, linger_ms=5, acks="all")
    await producer.start()
    started = time.monotonic()
    try:
        pending: list[asyncio.Future[Any]] = []
        while not stop.is_set() and (args.records == 0 or sent < args.records):
            if recent and rng.random() < args.duplicates:
                message_id, value = rng.choice(recent)
                duplicates += 1
            else:
                message_id = f"{run_id}-{sent - duplicates}"
                value = order(message_id, rng)
                if len(recent) < RECENT:
                    recent.append((message_id, value))
                else:
                    recent[rng.randrange(RECENT)] = (message_id, value)
            headers = [("message-id", message_id.encode())]
            pending.append(await producer.send(args.topic, value, headers=headers))
            sent += 1
            if len(pending) >= 1000:
                await asyncio.gather(*pending)
                pending.clear()
            if args.rate:  # pace: record n is due at n / rate seconds
                ahead = sent / args.rate - (time.monotonic() - started)
                if ahead > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), ahead)
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return {"topic": args.topic, "sent": sent, "duplicates": duplicates, "run_id": run_id}


async def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    summary = await run(args, stop)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
