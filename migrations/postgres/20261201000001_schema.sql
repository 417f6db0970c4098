-- The PostgreSQL schema: the same tables, columns and guards as
-- migrations/sqlite (read those files for each column's meaning), in
-- PostgreSQL's types. Integers are BIGINT (times in ms since the Unix
-- epoch, money in integer micro-MLX); binary columns are BYTEA holding the
-- same prost encodings. Where SQLite orders by rowid, a `seq` identity
-- column keeps insertion order.

CREATE TABLE nodes (
    id            TEXT PRIMARY KEY NOT NULL,
    name          TEXT NOT NULL,
    hardware      TEXT NOT NULL,
    models        TEXT NOT NULL,
    version       TEXT NOT NULL,
    status        TEXT NOT NULL CHECK (status IN ('online', 'offline')),
    first_seen_ms BIGINT NOT NULL,
    last_seen_ms  BIGINT NOT NULL
);

CREATE TABLE jobs (
    id                TEXT PRIMARY KEY NOT NULL,
    model             TEXT NOT NULL,
    input             BYTEA NOT NULL,
    sampling          BYTEA NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('queued', 'assigned', 'running', 'completed', 'failed', 'cancelled')),
    attempt           BIGINT NOT NULL CHECK (attempt >= 1),
    node_id           TEXT,
    output_text       TEXT NOT NULL DEFAULT '',
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    claim             BYTEA,
    signature         BYTEA,
    error             TEXT,
    created_at_ms     BIGINT NOT NULL,
    updated_at_ms     BIGINT NOT NULL,
    priority          BIGINT NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 3)
);

CREATE INDEX jobs_state_created ON jobs (state, created_at_ms);
CREATE INDEX jobs_created ON jobs (created_at_ms);
-- The queue: claims read only queued rows, oldest first.
CREATE INDEX jobs_queued ON jobs (created_at_ms, id) WHERE state = 'queued';

CREATE TABLE job_attempts (
    job_id        TEXT NOT NULL REFERENCES jobs (id),
    attempt       BIGINT NOT NULL,
    node_id       TEXT NOT NULL,
    outcome       TEXT NOT NULL CHECK (outcome IN ('assigned', 'running', 'completed', 'failed', 'cancelled')),
    error         TEXT,
    started_at_ms BIGINT NOT NULL,
    ended_at_ms   BIGINT,
    PRIMARY KEY (job_id, attempt)
);

CREATE TABLE accounts (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL,
    kind            TEXT NOT NULL CHECK (kind IN ('client', 'operator', 'fee', 'reward_pool', 'escrow', 'treasury')),
    no_overdraft    BIGINT NOT NULL CHECK (no_overdraft IN (0, 1)),
    debits_pending  BIGINT NOT NULL DEFAULT 0 CHECK (debits_pending >= 0),
    debits_posted   BIGINT NOT NULL DEFAULT 0 CHECK (debits_posted >= 0),
    credits_pending BIGINT NOT NULL DEFAULT 0 CHECK (credits_pending >= 0),
    credits_posted  BIGINT NOT NULL DEFAULT 0 CHECK (credits_posted >= 0),
    created_at_ms   BIGINT NOT NULL,
    CHECK (no_overdraft = 0 OR debits_pending + debits_posted <= credits_posted)
);

INSERT INTO accounts (id, name, kind, no_overdraft, created_at_ms) VALUES
    ('system:treasury', 'treasury', 'treasury', 0, 0),
    ('system:escrow', 'job escrow', 'escrow', 1, 0),
    ('system:fee', 'network fee', 'fee', 1, 0),
    ('system:reward_pool', 'availability reward pool', 'reward_pool', 1, 0);

CREATE TABLE transfers (
    seq            BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id             TEXT PRIMARY KEY NOT NULL,
    kind           TEXT NOT NULL CHECK (kind IN ('posted', 'pending', 'post_pending', 'void_pending', 'expire_pending')),
    debit_account  TEXT NOT NULL REFERENCES accounts (id),
    credit_account TEXT NOT NULL REFERENCES accounts (id),
    amount         BIGINT NOT NULL CHECK (amount >= 0),
    pending_id     TEXT REFERENCES transfers (id),
    deadline_ms    BIGINT,
    job_id         TEXT,
    node_id        TEXT,
    tokens         BIGINT NOT NULL DEFAULT 0 CHECK (tokens >= 0),
    memo           TEXT NOT NULL,
    created_at_ms  BIGINT NOT NULL,
    CHECK (debit_account <> credit_account),
    CHECK ((kind = 'pending') = (deadline_ms IS NOT NULL)),
    CHECK ((kind IN ('post_pending', 'void_pending', 'expire_pending')) = (pending_id IS NOT NULL))
);

-- A pending transfer is resolved (posted, voided or expired) at most once.
CREATE UNIQUE INDEX transfers_resolved_once ON transfers (pending_id) WHERE pending_id IS NOT NULL;
CREATE INDEX transfers_debit ON transfers (debit_account, created_at_ms);
CREATE INDEX transfers_credit ON transfers (credit_account, created_at_ms);
CREATE INDEX transfers_job ON transfers (job_id) WHERE job_id IS NOT NULL;

-- Transfer rows are immutable, whatever the caller.
CREATE FUNCTION transfers_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'transfers are immutable';
END;
$$;
CREATE TRIGGER transfers_no_update BEFORE UPDATE ON transfers
    FOR EACH ROW EXECUTE FUNCTION transfers_immutable();
CREATE TRIGGER transfers_no_delete BEFORE DELETE ON transfers
    FOR EACH ROW EXECUTE FUNCTION transfers_immutable();
CREATE TRIGGER transfers_no_truncate BEFORE TRUNCATE ON transfers
    FOR EACH STATEMENT EXECUTE FUNCTION transfers_immutable();

CREATE TABLE open_holds (
    transfer_id TEXT PRIMARY KEY NOT NULL REFERENCES transfers (id),
    job_id      TEXT UNIQUE,
    deadline_ms BIGINT NOT NULL
);
CREATE INDEX open_holds_deadline ON open_holds (deadline_ms);

CREATE TABLE api_keys (
    id                   TEXT PRIMARY KEY NOT NULL,
    account_id           TEXT NOT NULL REFERENCES accounts (id),
    hash                 BYTEA NOT NULL UNIQUE CHECK (octet_length(hash) = 32),
    scopes               TEXT NOT NULL,
    label                TEXT NOT NULL DEFAULT '',
    created_at_ms        BIGINT NOT NULL,
    expires_at_ms        BIGINT,
    revoked_at_ms        BIGINT,
    max_requests_per_sec BIGINT CHECK (max_requests_per_sec >= 0),
    max_in_flight        BIGINT CHECK (max_in_flight >= 0)
);

CREATE TABLE node_operators (
    node_id      TEXT PRIMARY KEY NOT NULL,
    account_id   TEXT NOT NULL REFERENCES accounts (id),
    linked_at_ms BIGINT NOT NULL
);
CREATE INDEX node_operators_account ON node_operators (account_id);

CREATE TABLE job_holds (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    job_id          TEXT PRIMARY KEY NOT NULL,
    account_id      TEXT NOT NULL REFERENCES accounts (id),
    input_per_mtok  BIGINT NOT NULL CHECK (input_per_mtok >= 0),
    output_per_mtok BIGINT NOT NULL CHECK (output_per_mtok >= 0),
    max_price       BIGINT NOT NULL CHECK (max_price >= 0)
);
CREATE INDEX job_holds_account ON job_holds (account_id, seq);

CREATE TABLE availability (
    epoch        BIGINT NOT NULL,
    node_id      TEXT NOT NULL,
    memory_bytes BIGINT NOT NULL CHECK (memory_bytes >= 0),
    online_ms    BIGINT NOT NULL CHECK (online_ms >= 0),
    PRIMARY KEY (epoch, node_id)
);

CREATE TABLE reward_epochs (
    epoch      BIGINT PRIMARY KEY NOT NULL,
    paid_ms    BIGINT NOT NULL,
    total      BIGINT NOT NULL CHECK (total >= 0)
);

CREATE TABLE audits (
    job_id        TEXT PRIMARY KEY NOT NULL REFERENCES jobs (id),
    node_id       TEXT NOT NULL,
    state         TEXT NOT NULL CHECK (state IN ('pending', 'passed', 'failed', 'missed')),
    auditor       TEXT,
    verdict       BYTEA,
    created_at_ms BIGINT NOT NULL,
    ended_at_ms   BIGINT
);
CREATE INDEX audits_node ON audits (node_id);

CREATE TABLE node_records (
    node_id       TEXT PRIMARY KEY NOT NULL,
    clean_audits  BIGINT NOT NULL DEFAULT 0 CHECK (clean_audits >= 0),
    failed_audits BIGINT NOT NULL DEFAULT 0 CHECK (failed_audits >= 0),
    banned_at_ms  BIGINT
);

CREATE TABLE job_segments (
    job_id        TEXT NOT NULL REFERENCES jobs (id),
    attempt       BIGINT NOT NULL,
    node_id       TEXT NOT NULL,
    first_index   BIGINT NOT NULL CHECK (first_index >= 0),
    token_count   BIGINT NOT NULL CHECK (token_count > 0),
    token_ids     BYTEA NOT NULL,
    text          TEXT NOT NULL,
    claim         BYTEA,
    signature     BYTEA,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
CREATE UNIQUE INDEX job_segments_order ON job_segments (job_id, first_index);
