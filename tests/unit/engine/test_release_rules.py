"""When SGLang's scheduler lets `/release_memory_occupation` through, per release
(`Capabilities.release_refused`; read from each release's scheduler source)."""

from __future__ import annotations

import pytest

from services.engine_api.sglang_api import RELEASE_ASSERT, RELEASE_ASSERT_OLD, Capabilities

# (release, running, waiting, paused) -> the assertion, or None where it releases
CASES = [
    ("0.5.4", 3, 2, False, None),  # checks nothing
    ("0.5.5", 0, 1, False, RELEASE_ASSERT_OLD),  # _is_no_request counts the waiting queue
    ("0.5.5", 0, 0, False, None),
    ("0.5.6", 0, 1, True, None),  # _is_no_request: the running batch only
    ("0.5.9", 1, 0, True, RELEASE_ASSERT_OLD),
    ("0.5.10", 0, 1, True, RELEASE_ASSERT),  # is_fully_idle(): waiting counts, paused or not
    ("0.5.21", 0, 1, True, RELEASE_ASSERT),
    ("0.5.22", 0, 1, True, None),  # ignore_waiting while paused (retracted requests)
    ("0.5.22", 0, 1, False, RELEASE_ASSERT),
    ("0.5.23", 1, 0, True, RELEASE_ASSERT),  # in_place keeps the running batch
    ("0.5.23", 0, 0, False, None),
]


@pytest.mark.parametrize(("release", "running", "waiting", "paused", "want"), CASES)
def test_release_refused_as_each_release_asserts(
    release: str, running: int, waiting: int, paused: bool, want: str | None
) -> None:
    assert Capabilities.of(release).release_refused(running, waiting, paused) == want


def test_default_tags_grew_cuda_graph_in_0_5_5() -> None:
    assert Capabilities.of("0.5.4").default_memory_tags == ("weights", "kv_cache")
    assert Capabilities.of("0.5.5").default_memory_tags == ("kv_cache", "weights", "cuda_graph")
