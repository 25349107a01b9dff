"""Local-development tooling of the stack: what `flywheel up` and `flywheel nats`
start on one machine (an embedded nats-server, a local NATS cluster, free ports).
Services never import it; in Kubernetes none of it runs.
"""
