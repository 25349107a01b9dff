"""The sync service's pure core: the engine registry and what to do next.

State: which engines exist (from heartbeats), which version each one
serves (confirmed by sync's own successful updates, or reported by its
heartbeat), the newest published version, and the newest version announced
ready. Decisions:

- `updates_due`: every live engine behind the newest published version
  that is not being updated and is not backing off after a failure gets an
  update. The same rule brings a newly joined engine up to date and retries
  a failed one; nothing else is special-cased.
- Where an engine loads a version from is the version's `source`, which
  its transport gave (services/weights/base.py): a shared
  directory, or the engine's own copy that the worker beside it received
  into the directory its heartbeat names. An engine whose copy is not
  there yet is not due; it just stays behind, holding up `ready_version`
  like any engine that is not updated yet.
- `ready_version`: the newest version that every live, healthy engine serves.
  An engine that keeps failing (`max_failures` in a row) is reported and
  left out of that minimum until it succeeds again, so one broken engine
  cannot stall the run; the rollout worker beside it refuses tasks newer
  than its engine (`PromptTask.min_weight_version`), so it cannot serve
  beyond the staleness bound either.
- Held-out evaluations on the engines (`EvalRequest`s the trainer sends,
  services/sync/evaluating.py): an engine that serves a version wanted for
  evaluation is *held* there (no update is due for it) until that
  evaluation ran; once it runs on one engine, the others go on. `evals_due`
  starts the oldest wanted version that some engine serves, one at a time,
  and gives up (skips) a wanted version no engine serves while a newer one
  is published: every engine behind it will load the newest, never it.
  Holding, rather than evaluating whatever the engine serves, is what ties a
  figure to one version: each answer it counts came from that version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.weights import WeightsSource


@dataclass
class Engine:
    engine_id: str
    url: str
    version: int  # newest version known to be served
    last_seen: float  # time of the last heartbeat
    failures: int = 0  # consecutive failed updates
    retry_at: float = 0.0  # no new attempt before this time
    updating: bool = False
    weights_dir: str | None = None  # engine-local dir of versions its worker received
    downloaded: int | None = None  # newest version complete there
    adapters: set[int] = field(default_factory=set)  # LoRA versions loaded there
    adapters_read: bool = False  # `adapters` read from the engine (once per sync process)


@dataclass(frozen=True)
class Published:
    version: int
    source: WeightsSource  # where each engine loads it from (its transport says)
    published_at: float  # when the trainer announced it (for publish→ready latency)
    adapter: bool = False  # a LoRA adapter loaded by name beside the others (no pause)


@dataclass
class Registry:
    liveness_s: float = 10.0  # an engine silent this long is gone
    max_failures: int = 3  # then it is left out of the ready minimum
    backoff_s: float = 1.0  # first retry delay, doubled per failure
    max_backoff_s: float = 30.0
    engines: dict[str, Engine] = field(default_factory=dict)
    latest: Published | None = None
    announced: int = -1  # newest version published as WeightsReady
    wanted: dict[int, float] = field(default_factory=dict)  # version to evaluate -> asked at
    evaluating: tuple[int, str] | None = None  # (version, engine id) of the one running

    def heartbeat(
        self,
        engine_id: str,
        url: str,
        version: int,
        now: float,
        weights_dir: str | None = None,
        downloaded: int | None = None,
    ) -> None:
        e = self.engines.get(engine_id)
        if e is None or e.url != url:  # new, or restarted elsewhere: trust its report
            self.engines[engine_id] = Engine(
                engine_id, url, version, now, weights_dir=weights_dir, downloaded=downloaded
            )
            return
        e.last_seen = now
        e.weights_dir, e.downloaded = weights_dir, downloaded
        if not e.updating:
            # A restarted engine reports a lower version than we confirmed; believe it.
            e.version = version

    def live(self, now: float) -> list[Engine]:
        return [e for e in self.engines.values() if now - e.last_seen <= self.liveness_s]

    def forget_dead(self, now: float) -> list[str]:
        dead = [k for k, e in self.engines.items() if now - e.last_seen > self.liveness_s]
        for k in dead:
            del self.engines[k]
        return dead

    def publish(self, p: Published) -> bool:
        """Record a newly published version; False if it is not newer."""
        if self.latest is not None and p.version <= self.latest.version:
            return False
        self.latest = p
        return True

    def updates_due(self, now: float) -> list[Engine]:
        if self.latest is None:
            return []
        p = self.latest
        return [
            e
            for e in self.live(now)
            if e.version < p.version
            and not e.updating
            and now >= e.retry_at
            and has_copy(e, p)
            and not self.held(e)
        ]

    def held(self, e: Engine) -> bool:
        """`e` serves a version wanted for evaluation and must stay on it: until the
        evaluation runs, every such engine; while it runs, the engine it runs on."""
        if e.version not in self.wanted:
            return False
        ev = self.evaluating
        return ev is None or ev[0] != e.version or ev[1] == e.engine_id

    def evals_due(self, now: float) -> tuple[list[int], tuple[int, Engine] | None]:
        """(versions to give up evaluating, (version, engine) to evaluate now or None).

        A wanted version is given up when no live engine serves it and a newer one is
        published (engines behind it will load the newest); one is started, the oldest
        wanted version served by an engine not being updated, when none is running.
        """
        serving = {e.version for e in self.live(now)}
        newest = self.latest.version if self.latest is not None else -1
        skip = [v for v in sorted(self.wanted) if v not in serving and newest > v]
        for v in skip:
            del self.wanted[v]
        if self.evaluating is not None:
            return skip, None
        for v in sorted(self.wanted):
            ready = [e for e in self.healthy(now) if e.version == v and not e.updating]
            if ready:
                engine = min(ready, key=lambda e: e.engine_id)
                self.evaluating = (v, engine.engine_id)
                return skip, (v, engine)
        return skip, None

    def evaluated(self, version: int) -> None:
        """The evaluation of `version` ended (whatever its outcome): its engine may move on."""
        self.wanted.pop(version, None)
        if self.evaluating is not None and self.evaluating[0] == version:
            self.evaluating = None

    def awaiting_copy(self, now: float) -> list[Engine]:
        """Live engines behind the newest version only because their copy is not there yet."""
        p = self.latest
        if p is None:
            return []
        return [e for e in self.live(now) if e.version < p.version and not has_copy(e, p)]

    def started(self, e: Engine) -> None:
        e.updating = True

    def succeeded(self, e: Engine, version: int) -> None:
        e.updating = False
        e.version = max(e.version, version)
        e.failures = 0
        e.retry_at = 0.0

    def failed(self, e: Engine, now: float) -> None:
        e.updating = False
        e.failures += 1
        e.retry_at = now + min(self.max_backoff_s, self.backoff_s * 2 ** (e.failures - 1))

    def healthy(self, now: float) -> list[Engine]:
        return [e for e in self.live(now) if e.failures < self.max_failures]

    def ready_version(self, now: float) -> int | None:
        """The newest version every live, healthy engine serves (None: no such engine)."""
        engines = self.healthy(now)
        if not engines:
            return None
        return min(e.version for e in engines)

    def to_announce(self, now: float) -> int | None:
        """A version to publish as WeightsReady now, if there is a new one."""
        v = self.ready_version(now)
        if v is None or v <= self.announced:
            return None
        return v


def has_copy(e: Engine, p: Published) -> bool:
    """Can `e` load version `p` now (a shared directory, or its own copy received)?"""
    return p.source.engine_path(e.weights_dir, e.downloaded) is not None


def path_for(e: Engine, p: Published) -> str:
    """The directory `e` loads version `p` from."""
    path = p.source.engine_path(e.weights_dir, e.downloaded)
    if path is None:
        why = "reports no local weights directory" if e.weights_dir is None else "has no copy"
        raise ValueError(f"engine {e.engine_id} {why} of v{p.version}")
    return path
