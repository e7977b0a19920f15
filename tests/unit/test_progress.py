"""Progress of long operator commands: JSON lines off a terminal (what a log or CI
job keeps), a bar redrawn in place on one."""

from __future__ import annotations

import io
import json

from gateway.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_off_a_terminal_a_json_line_every_interval_with_count_rate_and_eta_and_a_last_one():
    out, clock = io.StringIO(), Clock()
    progress = Progress("redrive", 1000, stream=out, every_s=10, clock=clock)
    for _ in range(4):  # 4 x 100 records, 4 s apart: one line at 12 s... none before 10 s
        clock.now += 4
        progress.advance(100)
    assert len(lines(out)) == 1
    (first,) = lines(out)
    assert first == {"progress": "redrive", "done": 300, "total": 1000, "rate_per_s": 25.0,
                     "eta_s": 28.0, "elapsed_s": 12.0}  # fmt: skip
    clock.now += 1
    progress.finish()
    last = lines(out)[-1]
    assert (last["done"], last["elapsed_s"], last["rate_per_s"]) == (400, 17.0, 23.5)
    assert last["eta_s"] == round(17 * 600 / 400, 1)


def test_without_a_total_a_fraction_gives_the_eta_and_never_goes_back():
    out, clock = io.StringIO(), Clock()
    progress = Progress("rebuild", stream=out, every_s=0, clock=clock)
    clock.now += 10
    progress.advance(50, fraction=0.25)
    clock.now += 10
    progress.advance(50, fraction=0.2)  # an estimate that dipped
    first, second = lines(out)
    assert (first["total"], first["eta_s"]) == (None, 30.0)
    assert second["eta_s"] == 60.0  # 20 s for a quarter: the fraction held at 0.25
    progress.finish()
    assert lines(out)[-1]["eta_s"] == 0.0


def test_unknown_total_and_fraction_leave_the_eta_null():
    out = io.StringIO()
    progress = Progress("inspect", stream=out, every_s=0, clock=Clock())
    progress.advance(7)
    assert lines(out)[-1]["eta_s"] is None


def test_on_a_terminal_one_line_redrawn_with_a_bar():
    out, clock = Tty(), Clock()
    progress = Progress("rebuild", 200, stream=out, clock=clock)
    clock.now += 1
    progress.advance(50)
    progress.finish()
    text = out.getvalue()
    assert text.startswith("\rrebuild: [") and text.endswith("\n")
    assert "25% 50/200 at 50.0/s, ETA 3s" in text
    assert "{" not in text
