"""The rollout engine's library: what every rollout kind (firmware, configuration) signs,
versions and schedules with.

Layer 4: imports `agent.core` only; every kind imports it, it imports no kind (the import
contracts in `pyproject.toml` say so).

    keys      ed25519 signing keys as PEM files; the key id an artifact or release carries
    trust     the fleet's signed trust document: which keys may sign, until when, rotatable
    version   strict semantic versions
    windows   maintenance windows (device-local time ranges)
    errors    the signing, trust and version errors
"""
