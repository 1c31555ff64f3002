CREATE TABLE devices (
    device_id TEXT PRIMARY KEY,
    hb_seq BIGINT NOT NULL DEFAULT -1,
    hb_at_ms BIGINT,
    last_seen_ms BIGINT,
    uptime_s DOUBLE PRECISION,
    firmware_version TEXT NOT NULL DEFAULT '',
    tags TEXT NOT NULL DEFAULT '[]',
    sample BYTEA,
    online INTEGER NOT NULL DEFAULT 0,
    offline_reason TEXT,
    first_seen_ms BIGINT NOT NULL,
    changed_ms BIGINT NOT NULL,
    telemetry_count BIGINT NOT NULL DEFAULT 0,
    boot TEXT NOT NULL DEFAULT '',
    presence_session TEXT NOT NULL DEFAULT '',
    outbox_pending BIGINT,
    interval_ms BIGINT NOT NULL DEFAULT 0,
    expires_ms BIGINT,
    slots BYTEA,
    configs BYTEA,
    served_by TEXT NOT NULL DEFAULT ''
) WITH (fillfactor = 70);
CREATE INDEX devices_online_expires ON devices(expires_ms) WHERE online = 1;
CREATE TABLE telemetry_last (
    device_id TEXT NOT NULL,
    name TEXT NOT NULL,
    seq BIGINT NOT NULL,
    ts_ms BIGINT NOT NULL,
    record BYTEA NOT NULL,
    PRIMARY KEY (device_id, name)
);
CREATE TABLE processed_messages (msg_id TEXT PRIMARY KEY, at_ms BIGINT NOT NULL);
CREATE INDEX processed_messages_at ON processed_messages(at_ms);
CREATE TABLE registry_meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
CREATE TABLE fleet_online (at_ms BIGINT PRIMARY KEY, devices BIGINT NOT NULL, online BIGINT NOT NULL);
CREATE TABLE registry_fleet (fleet TEXT PRIMARY KEY);
CREATE TABLE registry_leaders (name TEXT PRIMARY KEY, alive_ms BIGINT NOT NULL);
