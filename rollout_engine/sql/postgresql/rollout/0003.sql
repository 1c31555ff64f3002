-- The log lines a device's newest failure report in a rollout carried (its excerpt, redacted on
-- the device): one row per device and rollout, kept and pruned with the device's row.
CREATE TABLE rollout_device_logs (
    rollout_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    state TEXT NOT NULL,
    lines TEXT NOT NULL,
    PRIMARY KEY (rollout_id, device_id)
);
