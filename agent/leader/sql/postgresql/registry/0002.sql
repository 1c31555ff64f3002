-- A heartbeat changes expires_ms (and hb_seq, last_seen_ms, ...): with no index on a column it
-- changes, its update is HOT (the new row version on the same page, no index entry written).
-- The deadline scans go without the index (watch_deadlines runs them at most once a second).
-- A device going offline changes online and changed_ms, which the job queue's holder looks up.
DROP INDEX devices_online_expires;
CREATE INDEX devices_offline_changed ON devices(changed_ms) WHERE online = 0;
-- How often each leader beats its own row (LEADER_BEAT_S on PostgreSQL), so that a reader tells
-- a dead one by its own pace.
ALTER TABLE registry_leaders ADD COLUMN every_ms BIGINT NOT NULL DEFAULT 30000;
