"""A process's signals: SIGTERM/SIGINT start a bounded drain, SIGUSR1 logs where
every asyncio task waits (`kill -USR1 <pid>`: for a process that will not stop)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger("gateway")

CANCEL_GRACE_S = 10.0  # a drain cut short: how long its cancel may take before os._exit


async def until_signalled(
    main: Coroutine[Any, Any, None], stop: asyncio.Event, drain_s: float | None = None
) -> bool:
    """Run `main`; the first SIGINT/SIGTERM sets `stop`, a second one exits at once.
    `drain_s` bounds the drain that follows (`[kafka] drain_timeout`): past it `main`
    is cancelled, and `os._exit(1)` follows if even that does not end it within
    `CANCEL_GRACE_S`. False when the drain was cut short so."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    overdue = False

    def cut_short() -> None:
        nonlocal overdue
        overdue = True
        logger.error(
            "not stopped %.0fs after the signal ([kafka] drain_timeout): leaving the work "
            "in flight, uncommitted (it is read again at the next start, as after a "
            "crash); the tasks that still wait follow", drain_s,
        )  # fmt: skip
        log_tasks()
        task.cancel()
        loop.call_later(CANCEL_GRACE_S, exit_now)

    def exit_now() -> None:
        logger.error("still not stopped %.0fs after the cancel: exiting", CANCEL_GRACE_S)
        logging.shutdown()
        os._exit(1)

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.error("second %s: exiting without draining", sig.name)
            os._exit(130)
        logger.info("%s: draining in-flight work, then stopping", sig.name)
        stop.set()
        if drain_s is not None:
            loop.call_later(drain_s, cut_short)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR1, log_tasks)
    try:
        await task
    except asyncio.CancelledError:
        if not overdue:
            raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
    return not overdue


def log_tasks() -> None:
    """SIGUSR1: log where every asyncio task waits (for a process that will not stop)."""
    tasks = asyncio.all_tasks()
    logger.warning("SIGUSR1: %d asyncio tasks", len(tasks))
    for task in tasks:
        out = io.StringIO()
        task.print_stack(file=out)
        logger.warning("task %s:\n%s", task.get_name(), out.getvalue().rstrip())
