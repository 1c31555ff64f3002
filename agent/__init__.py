"""edge-agent: an actor-based agent for device fleets."""

__version__ = "0.1.0"
