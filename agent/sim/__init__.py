"""Layer 8: the fleet simulator. One leader and N workers in one process (or spread over several,
`agent.sim.processes`), with the real actors, outboxes and relays, on an in-memory broker and a
virtual clock (`edge-agent simulate`)."""

from agent.sim.clock import SimClock
from agent.sim.options import SimOptions, parse_duration, parse_outage, parse_shard
from agent.sim.processes import SpreadSimulation, simulation
from agent.sim.report import Report, summary, to_json
from agent.sim.runner import Simulation
from agent.sim.scenarios import SCENARIOS, check

__all__ = ["SCENARIOS", "Report", "SimClock", "SimOptions", "Simulation", "SpreadSimulation", "check",
           "parse_duration", "parse_outage", "parse_shard", "simulation", "summary", "to_json"]
