"""Layer 6: the worker agent on every device: heartbeats, telemetry, jobs, the updater actor.
Imports nothing from the leader."""
