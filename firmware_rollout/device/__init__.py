"""The device's side of an update: the durable `Updater` and its store, A/B slots behind the
`Installer` protocol, staging, chunk sources (a local artifact or the leader's ConfigServers over
MQTT), health checks and rebooters. Never imports `firmware_rollout.orchestration`."""
