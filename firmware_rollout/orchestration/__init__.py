"""The leader's side of a rollout: the spec, the wave plan, gates, the durable orchestrator,
the rollout store and its schema, status views and the chunk server (ConfigServer actors).
Never imports `firmware_rollout.device`."""
