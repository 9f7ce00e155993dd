"""A local Mastodon-compatible platform for the demo and the fault tests.

``World`` holds the state and the fault knobs, ``build_app`` serves it over
Starlette, ``SimServer`` runs it on an ephemeral port (thread or child
process) and ``python -m replyd.sim`` runs it standalone.
"""

from replyd.sim.app import build_app
from replyd.sim.server import SimServer
from replyd.sim.world import (
    CREATE_FAULTS,
    READ_FAULTS,
    Account,
    Knobs,
    Notification,
    SimError,
    Status,
    Traffic,
    World,
)

__all__ = [
    "CREATE_FAULTS",
    "READ_FAULTS",
    "Account",
    "Knobs",
    "Notification",
    "SimError",
    "SimServer",
    "Status",
    "Traffic",
    "World",
    "build_app",
]
