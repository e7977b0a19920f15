"""Offered load for the latency runs: raw records at a fixed rate, from its own process.

Runs as `python -m bench.loader ...` so that producing does not share the
gateway's event loop (only the machine's two cores). librdkafka stamps each
record's CreateTime when `produce()` is called, which is the "raw append time"
the latency is measured from (a slight overestimate: the append comes later).
Prints one JSON line at the end: what was produced.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import threading
import time

from confluent_kafka import Producer

from devtools.traffic import order_value

TICK_S = 0.005  # produce in 5 ms slices: the pacing error stays far below the 25 ms target


def produce_at_rate(
    bootstrap: str, topic: str, rate: float, seconds: float, duplicate_share: float,
    value_size: int, seed: int, stop: threading.Event | None = None, id_prefix: str = "lat",
) -> dict[str, int]:  # fmt: skip
    """Produce at `rate` for `seconds` or until `stop` is set (bench/restart.py runs it
    in a thread); ids `<id_prefix>-<n>`."""
    rng = random.Random(seed)
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 1, "acks": "all", "enable.idempotence": False}
    )
    # One padded order as a template: the loader's own CPU competes with the gateway.
    template = order_value("%s", rng, value_size).replace(b"%s", b"%b", 1)
    issued: list[str] = []
    produced = duplicates = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds and not (stop and stop.is_set()):
        due = int(rate * elapsed) - produced
        for _ in range(max(due, 0)):
            if issued and rng.random() < duplicate_share:
                message_id = rng.choice(issued)
                duplicates += 1
            else:
                message_id = f"{id_prefix}-{produced}"
                issued.append(message_id)
            send = functools.partial(
                producer.produce,
                topic,
                key=b"k-%d" % rng.randrange(1000),
                value=template % message_id.encode(),
                headers=[("message-id", message_id.encode())],
            )
            while True:
                try:
                    send()
                    break
                except BufferError:  # the client's queue is full: wait for acks to drain it
                    producer.poll(0.05)
            produced += 1
        producer.poll(0)
        time.sleep(max(0.0, TICK_S - (time.monotonic() - started - elapsed)))
    if producer.flush(30):
        raise RuntimeError("loader: records still unacknowledged after 30 s")
    return {"produced": produced, "duplicates": duplicates, "unique": len(issued)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--rate", type=float, required=True, help="records per second")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--duplicates", type=float, default=0.2)
    parser.add_argument("--value-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    result = produce_at_rate(
        args.bootstrap, args.topic, args.rate, args.seconds, args.duplicates, args.value_size,
        args.seed,
    )  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
