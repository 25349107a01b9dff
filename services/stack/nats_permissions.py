"""Per-service NATS users and subject permissions, made from proto's streams and consumers.

One owner for what each service may do on the bus: the streams, durables and
subjects come from proto/streams.py and proto/subjects.py, so a new stream
(ADVISORIES) or consumer cannot be forgotten in a hand-kept list. Written out
as docs/security/nats-permissions.conf (the example, run "demo", passwords to
replace) and as the Kubernetes base's nats-auth.conf (passwords read by
nats-server from its environment, `$FLYWHEEL_NATS_<SERVICE>_PASSWORD`, which
the `flywheel-nats` Secret fills). A test checks both are up to date
(`python -m services.stack.nats_permissions --write` rewrites them) and runs
real services under these users against a real nats-server.

What every service needs from JetStream: look up / create / update the run's
streams at start-up (`ensure_streams`), create and read its own durable
consumers, pull from them (CONSUMER.MSG.NEXT, replies to _INBOX), ack
($JS.ACK), publish dead letters (dlq.>), hear and read the max-deliveries
advisories of its consumers (the ADVISORIES stream: its `<durable>-maxdeliver`
consumers) and read the message an advisory names (STREAM.MSG.GET). Beyond
that each publishes only the subjects it produces: a rollout worker cannot
forge a batch, the trainer cannot dispatch tasks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from proto.streams import (
    ConsumerSpec,
    advisory_consumer,
    consumers_for,
    kv_bucket,
    max_deliveries_subject,
    stream_name,
    streams_for,
)
from proto.subjects import Subjects

SERVICES = ("buffer", "rollout", "trainer", "sync")
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs/security/nats-permissions.conf"
K8S_AUTH = REPO / "deploy/k8s/base/nats-auth.conf"


@dataclass
class Grants:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=lambda: ["_INBOX.>"])


def _consumer(g: Grants, c: ConsumerSpec) -> None:
    """Create, read, pull from and ack durable `c`, and dead-letter what it gave up on."""
    for spec in (c, advisory_consumer(c)):
        s, d = spec.stream, spec.durable
        g.publish += [
            f"$JS.API.CONSUMER.*.{s}.{d}",
            f"$JS.API.CONSUMER.*.{s}.{d}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{s}.{d}",
            f"$JS.ACK.{s}.{d}.>",
        ]
    g.publish.append(f"$JS.API.STREAM.MSG.GET.{c.stream}")  # the message an advisory names
    g.subscribe.append(max_deliveries_subject(c.stream, c.durable))


def _reads(g: Grants, stream: str) -> None:
    """Read single messages of `stream` (the last on a subject, or by sequence)."""
    g.publish += [
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    ]


def _ephemeral(g: Grants, stream: str) -> None:
    """Unnamed consumers of `stream` (an ordered push consumer, a positioned pull)."""
    g.publish += [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.*.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def grants(run: str) -> dict[str, Grants]:
    """Each service's publish/subscribe allow-lists for run `run`."""
    sub, cons = Subjects(run), consumers_for(run)
    out: dict[str, Grants] = {}
    for service in SERVICES:
        g = Grants()
        g.publish += ["$JS.API.INFO", "$JS.API.STREAM.INFO.*"]
        for spec in streams_for(run):
            g.publish += [
                f"$JS.API.STREAM.CREATE.{spec.name}",
                f"$JS.API.STREAM.UPDATE.{spec.name}",
            ]
        g.publish.append(f"flywheel.{run}.dlq.>")
        out[service] = g

    b = out["buffer"]
    b.publish += [sub.tasks, sub.batches]
    for role in ("buffer", "buffer-ready", "buffer-dlq"):
        _consumer(b, cons[role])
    _reads(b, stream_name(run, "SAMPLES"))  # pending groups re-read by sequence
    kv = f"KV_{kv_bucket(run, 'buffer')}"  # its state: watched at start, purged by sequence
    b.publish += [
        f"$JS.API.STREAM.CREATE.{kv}",
        f"$JS.API.STREAM.PURGE.{kv}",
        f"$KV.{kv_bucket(run, 'buffer')}.>",
    ]
    _reads(b, kv)
    _ephemeral(b, kv)

    r = out["rollout"]
    r.publish += [sub.samples, f"flywheel.{run}.engines.*", f"flywheel.{run}.weightsnap"]
    _consumer(r, cons["rollout"])
    _reads(r, stream_name(run, "WEIGHTS"))  # the newest published version
    _ephemeral(r, stream_name(run, "WEIGHTDATA"))  # weights over NATS
    r.subscribe.append(sub.weights_published)  # woken at once when a version is announced

    t = out["trainer"]
    t.publish += [sub.weights_published, sub.eval_requested, f"flywheel.{run}.weightdata.>"]
    _consumer(t, cons["trainer"])
    _consumer(t, cons["trainer-evals"])  # the engines' evaluation results
    _ephemeral(t, stream_name(run, "BATCHES"))  # its reader starts at a sequence
    t.subscribe.append(f"flywheel.{run}.weightsnap")  # a delta's snapshot, asked for...
    t.publish.append("_INBOX.>")  # ...and answered

    s = out["sync"]
    s.publish += [sub.weights_ready, sub.eval_results]
    s.publish.append(f"$JS.API.STREAM.PURGE.{stream_name(run, 'WEIGHTDATA')}")
    _consumer(s, cons["sync"])
    _consumer(s, cons["sync-evals"])  # evaluations the trainer asks of the engines
    for what in ("WEIGHTS", "WEIGHTDATA"):
        _reads(s, stream_name(run, what))
    s.subscribe.append(f"flywheel.{run}.engines.*")
    for g in out.values():
        g.publish = list(dict.fromkeys(g.publish))
        g.subscribe = list(dict.fromkeys(g.subscribe))
    return out


def _block(name: str, g: Grants) -> str:
    def allow(subjects: list[str]) -> str:
        return "\n".join(f'        "{s}"' for s in subjects)

    return (
        f"  {name.upper()} = {{\n"
        f"    publish = {{\n      allow = [\n{allow(g.publish)}\n      ]\n    }}\n"
        f"    subscribe = {{\n      allow = [\n{allow(g.subscribe)}\n      ]\n    }}\n  }}\n"
    )


def authorization(run: str, passwords: dict[str, str]) -> str:
    """The `authorization {}` block: a user per service, named after it."""
    blocks = "\n".join(_block(name, g) for name, g in grants(run).items())
    users = "\n".join(
        f"    {{ user: {name}, password: {passwords[name]}, permissions: ${name.upper()} }}"
        for name in SERVICES
    )
    return f"authorization {{\n{blocks}\n  users = [\n{users}\n  ]\n}}\n"


def env_password(service: str) -> str:
    """The nats-server environment variable that holds `service`'s password (Kubernetes)."""
    return f"FLYWHEEL_NATS_{service.upper()}_PASSWORD"


def example_conf() -> str:
    header = "\n".join(f"# {ln}".rstrip() for ln in _EXAMPLE_HEADER.strip().splitlines())
    passwords = {s: f'"change-me-{s}"' for s in SERVICES}
    return f"{header}\n\njetstream {{}}\n\n{authorization('demo', passwords)}"


def k8s_auth_conf(run: str) -> str:
    passwords = {s: f"${env_password(s)}" for s in SERVICES}
    return _K8S_HEADER + authorization(run, passwords)


_EXAMPLE_HEADER = """
Per-service NATS users and subject permissions for the run "demo".
GENERATED by services/stack/nats_permissions.py (which says what each grant is
for): `python -m services.stack.nats_permissions --write` after a change to
proto/streams.py. For another run: `--run <name> --print`. Replace the
passwords with secrets (or turn the users into nkey users: `nkey: U...`).
Each service sets `[nats] user` / `password` (or FLYWHEEL_<SECTION>_NATS__PASSWORD).
tests/integration/runtime/test_nats_security.py runs real services under
these users and checks a rollout user cannot publish train batches.
Hardening left to the operator: create the streams with an admin user and
drop STREAM.CREATE/UPDATE from the services' permissions.
"""

_K8S_HEADER = """# NATS users, one per service, each limited to its own subjects, for the
# base's run ("demo"; another run name: regenerate with `--run`), included by
# nats.conf. GENERATED by services/stack/nats_permissions.py:
# `python -m services.stack.nats_permissions --write`. The passwords are read
# from the server's environment (`$FLYWHEEL_NATS_<SERVICE>_PASSWORD`, from the
# `flywheel-nats` Secret, which deploy/k8s/make-secrets.sh generates).

"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the example and the k8s conf")
    p.add_argument("--run", default="demo", help="the run name (with --print)")
    p.add_argument("--print", action="store_true", help="print the authorization block")
    a = p.parse_args(argv)
    if a.write:
        EXAMPLE.write_text(example_conf())
        K8S_AUTH.write_text(k8s_auth_conf("demo"))
    if a.print:
        print(authorization(a.run, {s: f'"change-me-{s}"' for s in SERVICES}), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
