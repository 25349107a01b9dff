"""Sync: brings every live engine to the newest weight version and says when it is ready.

`core` (pure: the engine registry and what is due), `app` (updates,
heartbeats, announcements), `metrics`, `settings`, `cli`.
"""
