"""Configuration rolled out in waves: the signed config release (`config_rollout.release`).

Layer 5: imports `agent.core` and the firmware library's keys and versions (`firmware_rollout`);
the agents above host it.
"""
