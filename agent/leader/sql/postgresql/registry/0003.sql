-- What each application of a device runs, as its newest full heartbeat stated it (Heartbeat.apps).
ALTER TABLE devices ADD COLUMN apps BYTEA;
