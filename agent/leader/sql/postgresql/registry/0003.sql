-- What each application of a device runs, and what the device is (arch, board, os), as its newest
-- full heartbeat stated them (Heartbeat.apps, Heartbeat.facts).
ALTER TABLE devices ADD COLUMN apps BYTEA;
ALTER TABLE devices ADD COLUMN facts BYTEA;
