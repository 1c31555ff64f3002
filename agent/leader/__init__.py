"""Layer 6: the leader agent on the gateway: registry, intake, jobs, the rollout service. Imports
nothing from the worker."""
