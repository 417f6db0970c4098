-- Audits of completed jobs, and each node's audit record (see
-- coordinator/src/audit.rs). Times are milliseconds since the Unix epoch.

CREATE TABLE audits (
    job_id        TEXT PRIMARY KEY NOT NULL REFERENCES jobs (id),
    node_id       TEXT NOT NULL,                -- the node whose claim is audited
    state         TEXT NOT NULL CHECK (state IN ('pending', 'passed', 'failed', 'missed')),
    auditor       TEXT,                         -- the node that re-scored it
    verdict       BLOB,                         -- SignedVerdict
    created_at_ms INTEGER NOT NULL,
    ended_at_ms   INTEGER
);
CREATE INDEX audits_node ON audits (node_id);

CREATE TABLE node_records (
    node_id       TEXT PRIMARY KEY NOT NULL,    -- lowercase hex ed25519 public key
    clean_audits  INTEGER NOT NULL DEFAULT 0 CHECK (clean_audits >= 0),
    failed_audits INTEGER NOT NULL DEFAULT 0 CHECK (failed_audits >= 0),
    banned_at_ms  INTEGER                       -- set: never placed again
);
