-- One row a singleton of the fleet's leaders (the rollout orchestrator, the job queue): who
-- holds it, under which fencing token, until when and since when (the server's time, ms), and
-- when its holder last finished a round of its work (agent/core/lease.py).
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    token BIGINT NOT NULL,
    expires_ms BIGINT NOT NULL,
    acquired_ms BIGINT NOT NULL,
    ticked_ms BIGINT
);
