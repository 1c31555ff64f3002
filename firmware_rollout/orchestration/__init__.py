"""The leader's side of firmware as a rollout kind: the kind itself (`kind`: admit, offer,
describe), the artifact store of verified copies, the artifact HTTP server and the chunk server
(ConfigServer actors). The rollout (spec, waves, gates, orchestrator, store) is the engine's
(`rollout_engine`). Never imports `firmware_rollout.device`."""
