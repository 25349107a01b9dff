"""The tests' one free-port helper: the product's own (services/stack/localdev/ports.py).

Below the kernel's ephemeral range, as `flywheel up` picks its processes'
ports, so a port a test hands to a process it restarts is not meanwhile
the local end of some outgoing connection.
"""

from services.stack.localdev.ports import free_port

__all__ = ["free_port"]
