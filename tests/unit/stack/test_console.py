"""What of a service's output the console of `flywheel up` shows (without --verbose)."""

from __future__ import annotations

from services.stack.supervisor import for_console


def shown(lines: list[str]) -> list[str]:
    out, last = [], False
    for line in lines:
        last = for_console(line, last)
        if last:
            out.append(line)
    return out


def test_a_service_s_info_lines_stay_in_its_log_its_warnings_and_errors_show() -> None:
    lines = [
        "2026-11-27T09:20:00.123Z buffer INFO services.buffer.app: dispatched 8 tasks",
        "2026-11-27T09:20:01.456Z buffer WARNING services.buffer.app: 3 samples stale",
        "2026-11-27T09:20:02.000Z trainer DEBUG services.trainer.loop: step 3",
        "2026-11-27T09:20:03.000Z sync ERROR services.sync.app: engine-0 failed to load v3",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: bad weights",
        "2026-11-27T09:20:04.000Z sync INFO services.sync.app: engine-0 serves v3 (ERROR gone)",
        "  a continued INFO message",
    ]
    assert shown(lines) == [lines[1], *lines[3:7]]


def test_lines_that_are_not_records_show_when_they_ask_for_action() -> None:
    assert for_console("flywheel buffer: [task] source.path: Field required", False)
    assert for_console("Traceback (most recent call last):", False)
    assert for_console("WARNING:torch.distributed.run: setting OMP_NUM_THREADS", False)
    assert not for_console("/x/modeling.py:12: UserWarning: a library's note", False)
    assert not for_console("Loading checkpoint shards: 100%", False)
