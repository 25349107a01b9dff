"""`flywheel sandbox`: a server that starts sandboxed reward and tool processes for the
services beside it (services/sandbox/server.py)."""
