-- The spine schema: nodes that have registered, jobs, and one row per job attempt.
-- Times are milliseconds since the Unix epoch. Binary columns hold prost encodings
-- of the mlxnet.v1 messages named in their comments.

CREATE TABLE nodes (
    id            TEXT PRIMARY KEY NOT NULL,   -- lowercase hex ed25519 public key
    name          TEXT NOT NULL,
    hardware      TEXT NOT NULL,               -- JSON of the node's HardwareProfile
    models        TEXT NOT NULL,               -- JSON list of the cached models it reported
    version       TEXT NOT NULL,
    status        TEXT NOT NULL CHECK (status IN ('online', 'offline')),
    first_seen_ms INTEGER NOT NULL,
    last_seen_ms  INTEGER NOT NULL
);

CREATE TABLE jobs (
    id                TEXT PRIMARY KEY NOT NULL,  -- UUIDv7
    model             TEXT NOT NULL,              -- catalogue id
    input             BLOB NOT NULL,              -- JobInput
    sampling          BLOB NOT NULL,              -- SamplingParams, seed always set
    state             TEXT NOT NULL CHECK (state IN ('queued', 'assigned', 'running', 'completed', 'failed', 'cancelled')),
    attempt           INTEGER NOT NULL CHECK (attempt >= 1),
    node_id           TEXT,                       -- node of the current or last attempt
    output_text       TEXT NOT NULL DEFAULT '',
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    claim             BLOB,                       -- ResultClaim, set once completed and verified
    signature         BLOB,                       -- ed25519 signature over the claim's canonical bytes
    error             TEXT,
    created_at_ms     INTEGER NOT NULL,
    updated_at_ms     INTEGER NOT NULL
);

CREATE INDEX jobs_state_created ON jobs (state, created_at_ms);
CREATE INDEX jobs_created ON jobs (created_at_ms);

CREATE TABLE job_attempts (
    job_id        TEXT NOT NULL REFERENCES jobs (id),
    attempt       INTEGER NOT NULL,
    node_id       TEXT NOT NULL,
    outcome       TEXT NOT NULL CHECK (outcome IN ('assigned', 'running', 'completed', 'failed', 'cancelled')),
    error         TEXT,
    started_at_ms INTEGER NOT NULL,
    ended_at_ms   INTEGER,
    PRIMARY KEY (job_id, attempt)
);
