"""Collapse made visible on the status line: flat groups and distinct completions from the
buffer's gauges, the policy's entropy from the trainer's (services/stack/status.py), read
from what each service's real metrics class exposes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from services.buffer.metrics import BufferMetrics
from services.stack.status import Status, parse, render_line, summarise
from services.trainer.metrics import TrainerMetrics


def test_the_line_shows_flat_share_distinct_completions_and_entropy() -> None:
    buf_registry = CollectorRegistry()
    buf = BufferMetrics(buf_registry)
    tr_registry = CollectorRegistry()
    tr = TrainerMetrics(tr_registry)
    buf.flat_share.set(0.875)
    buf.distinct.set(1.25)
    buf.group_samples.set(8)
    tr.step.set(17)
    tr.gauges["entropy"].set(0.0412)
    now = summarise({
        "buffer": parse(generate_latest(buf_registry).decode()),
        "trainer": parse(generate_latest(tr_registry).decode()),
    })  # fmt: skip
    assert (now.flat_share, now.distinct, now.group_samples) == (0.875, 1.25, 8)
    assert now.entropy == 0.0412
    line = render_line(now, None)
    assert "| flat 88% | distinct 1.2/8 | entropy 0.04 |" in line


def test_before_any_group_or_step_the_line_shows_dashes() -> None:
    buf_registry, tr_registry = CollectorRegistry(), CollectorRegistry()
    BufferMetrics(buf_registry)
    TrainerMetrics(tr_registry)
    now = summarise({
        "buffer": parse(generate_latest(buf_registry).decode()),
        "trainer": parse(generate_latest(tr_registry).decode()),
    })  # fmt: skip
    assert "| flat - | distinct - | entropy - |" in render_line(now, None)
    # an older buffer without these gauges, and no services at all: the same
    old = summarise({"buffer": parse("# TYPE flywheel_buffer_next_step gauge\n"
                                     "flywheel_buffer_next_step 3\n")})  # fmt: skip
    assert "| flat - | distinct - | entropy - |" in render_line(old, None)
    assert "| flat - | distinct - | entropy - |" in render_line(Status(), None)
