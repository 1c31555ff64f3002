-- Who runs the orchestrator is a row of the fleet's one `leases` table now (agent/core/lease.py),
-- as every singleton of the leaders is.
DROP TABLE rollout_lease;
