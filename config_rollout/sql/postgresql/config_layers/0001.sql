CREATE TABLE config_layers (
    target TEXT NOT NULL,
    scope TEXT NOT NULL CHECK (scope IN ('tag', 'device')),
    selector TEXT NOT NULL,
    document TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    expires_ms BIGINT,
    set_by TEXT NOT NULL,
    set_ms BIGINT NOT NULL,
    PRIMARY KEY (target, scope, selector, document, key)
);
CREATE TABLE config_group_order (
    target TEXT NOT NULL,
    tag TEXT NOT NULL,
    position INTEGER NOT NULL,
    PRIMARY KEY (target, tag)
);
