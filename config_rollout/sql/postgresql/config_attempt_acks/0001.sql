-- Operators' acknowledgements of configuration attempts that did not commit: the attempt seen
-- (its number on the device, how it ended, the version held after it), who and when.
CREATE TABLE config_attempt_acks (
    device_id TEXT NOT NULL,
    target TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    outcome TEXT NOT NULL,
    version TEXT NOT NULL,
    acknowledged_by TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (device_id, target, attempt)
);
CREATE INDEX config_attempt_acks_at ON config_attempt_acks(at_ms);
