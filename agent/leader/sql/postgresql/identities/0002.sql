ALTER TABLE device_identities ADD COLUMN asked_ms BIGINT NOT NULL DEFAULT 0;
UPDATE device_identities SET asked_ms = requested_ms;
ALTER TABLE enrol_allow ADD COLUMN device TEXT;
ALTER TABLE enrol_allow ADD COLUMN used_ms BIGINT;
