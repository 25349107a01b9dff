"""The local stack: `flywheel up` (plan, supervisor, status line), `demo`, `status`, `eval`."""
