"""A weight version that cannot be received is given up after a bound, and reported.

The rollout worker used to download a permanently bad version again every
poll, forever. Against a real nats-server: a version announced over NATS
whose chunks never come fails `max_attempts` times, is then given up (one
error, the metric), is not tried again, and a newer version is still taken.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proto.codec import encode
from proto.messages import WeightsPublished
from proto.streams import streams_for, weights_nats_uri
from proto.subjects import Subjects
from services.rollout.weights_fetch import WeightsFetcher
from services.runtime.nats_conn import connect, ensure_streams
from services.runtime.settings import NatsSettings
from services.weights import WeightsTransferError


def _announce(run: str, version: int) -> bytes:
    return encode(
        WeightsPublished(
            run=run,
            version=version,
            step=version,
            uri=weights_nats_uri(run, version),
            sha256="0" * 64,
            size_bytes=1,
        )
    )


def test_a_version_that_never_arrives_is_given_up_after_the_bound(
    nats_settings: NatsSettings, tmp_path: Path, run_async, caplog: pytest.LogCaptureFixture
) -> None:
    run = "giveup"
    given_up: list[int] = []

    async def body() -> None:
        nc = await connect(nats_settings, "giveup-test")
        try:
            js = nc.jetstream()
            await ensure_streams(js, streams_for(run))
            await js.publish(Subjects(run).weights_published, _announce(run, 3))
            fetcher = WeightsFetcher(
                js, nc, run, tmp_path / "w", poll_s=0.1, keep=2, idle_timeout_s=0.2,
                max_attempts=3, on_give_up=given_up.append,
            )  # fmt: skip
            fetcher.reset()
            for _ in range(3):  # each attempt fails: no chunk comes
                with pytest.raises(WeightsTransferError):
                    await fetcher.fetch_once()
            assert fetcher.given_up == 3 and given_up == [3]
            for _ in range(5):  # given up: not downloaded again (no error, nothing held)
                assert await fetcher.fetch_once() is None
            assert given_up == [3] and fetcher.held() == []
            # A newer version is tried again (and would be given up in its turn).
            await js.publish(Subjects(run).weights_published, _announce(run, 4))
            with pytest.raises(WeightsTransferError, match="v4"):
                await fetcher.fetch_once()
        finally:
            await nc.close()

    with caplog.at_level(logging.ERROR, logger="services.rollout.weights_fetch"):
        run_async(body())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "giving up weights v3 after 3 failed attempts" in errors[0]
