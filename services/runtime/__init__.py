"""The service runtime: plumbing every service shares, and nothing else.

Settings (TOML run file + environment overrides + `--print-config`), process
life (health and metrics server, connect, drain, signals), the typed errors,
NATS connection and streams, publishing, the message loop, the local-run
record. It imports no domain (tasks, weights, engine API, models) and no
service: a domain registers what the runtime must know about it.
"""
