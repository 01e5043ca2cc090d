"""The per-node drain daemon: moves committed steps from the node-local tier to a durable tier, commits
them there across nodes, applies retention on both tiers and keeps the local tier under its free-space
watermark. ``drain`` owns one step's transfer and the durable commit; ``service`` owns the loop, the
lock, eviction and status. Standard library, watchdog and the storage tiers only: no torch."""

from .drain import DrainResult, LocalStep, StepDrainer, drain_order, durable_steps, scan_local
from .service import Daemon, DaemonRunningError, daemon_running, read_status, status_path

__all__ = ["Daemon", "DaemonRunningError", "DrainResult", "LocalStep", "StepDrainer", "daemon_running",
           "drain_order", "durable_steps", "read_status", "scan_local", "status_path"]
