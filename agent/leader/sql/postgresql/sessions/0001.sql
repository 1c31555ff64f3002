CREATE TABLE remote_sessions (
    sid TEXT PRIMARY KEY,
    leader TEXT NOT NULL,
    device_id TEXT NOT NULL,
    operator TEXT NOT NULL,
    op TEXT NOT NULL,
    target TEXT NOT NULL,
    opened_ms BIGINT NOT NULL,
    closed_ms BIGINT,
    state TEXT NOT NULL,
    bytes_to_device BIGINT NOT NULL DEFAULT 0,
    bytes_from_device BIGINT NOT NULL DEFAULT 0,
    exit_code INTEGER,
    reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX remote_sessions_opened ON remote_sessions(opened_ms);
CREATE TABLE remote_session_input (
    sid TEXT NOT NULL,
    seq BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (sid, seq)
);
