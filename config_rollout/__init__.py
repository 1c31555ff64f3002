"""Configuration rolled out in waves: the signed config release (`config_rollout.release`).

Layer 5: imports `agent.core` and the engine's keys and versions (`rollout_engine`), never its
peer `firmware_rollout`; the agents above host it.
"""
