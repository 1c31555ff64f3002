-- Who runs the queue is a row of the fleet's one `leases` table now (agent/core/lease.py), as
-- every singleton of the leaders is; the queue's epoch stays in jobqueue_meta and fences its
-- writes as before.
DROP TABLE jobqueue_lease;
