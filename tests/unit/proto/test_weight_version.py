"""A weight version's names: the engine's text, directory names, spans (proto/weight_version.py)."""

from __future__ import annotations

from proto.weight_version import (
    VersionSpan,
    dir_name,
    from_engine,
    parse_name,
    spans_from_engine,
    to_engine,
)


def test_engine_versions() -> None:
    assert from_engine("12") == 12
    assert from_engine(3) == 3
    assert from_engine("default") == 0  # SGLang's initial weights
    assert from_engine(None) == 0
    assert from_engine(to_engine(7)) == 7


def test_names_sort_like_versions_and_read_back() -> None:
    assert dir_name(12) == "v000012" and parse_name("v000012") == 12
    assert sorted(dir_name(v) for v in (10, 9, 100)) == [dir_name(v) for v in (9, 10, 100)]
    assert parse_name("v12") == 12  # a WEIGHTDATA subject token
    assert parse_name("best") is None and parse_name("v12.delta") is None


def test_spans_from_the_engines_text() -> None:
    raw = [{"version": "3", "start": 0, "end": 1}, {"version": "default", "start": 1, "end": 2}]
    assert spans_from_engine(raw) == (
        VersionSpan(version=3, start=0, end=1),
        VersionSpan(version=0, start=1, end=2),
    )
    assert spans_from_engine(None) == ()
