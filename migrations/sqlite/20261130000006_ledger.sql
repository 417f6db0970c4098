-- The ledger: accounts, immutable double-entry transfers (two-phase, the
-- TigerBeetle model), API keys (hashes only), and which operator account
-- each node earns for. Amounts are integer micro-MLX (1 MLX = 1,000,000).
-- Times are milliseconds since the Unix epoch.

CREATE TABLE accounts (
    id              TEXT PRIMARY KEY NOT NULL,  -- 'acct_<hex>' for users, 'system:<name>' for the network's own
    name            TEXT NOT NULL,
    kind            TEXT NOT NULL CHECK (kind IN ('client', 'operator', 'fee', 'reward_pool', 'escrow', 'treasury')),
    -- 1: debits (posted + pending) may never exceed posted credits, i.e. the
    -- balance cannot go below zero, holds included.
    no_overdraft    INTEGER NOT NULL CHECK (no_overdraft IN (0, 1)),
    debits_pending  INTEGER NOT NULL DEFAULT 0 CHECK (debits_pending >= 0),
    debits_posted   INTEGER NOT NULL DEFAULT 0 CHECK (debits_posted >= 0),
    credits_pending INTEGER NOT NULL DEFAULT 0 CHECK (credits_pending >= 0),
    credits_posted  INTEGER NOT NULL DEFAULT 0 CHECK (credits_posted >= 0),
    created_at_ms   INTEGER NOT NULL,
    CHECK (no_overdraft = 0 OR debits_pending + debits_posted <= credits_posted)
);

-- The network's own accounts. The treasury issues every MLX token that
-- enters the ledger (grants), so it is the one account whose balance is
-- negative; the sum over all accounts stays zero.
INSERT INTO accounts (id, name, kind, no_overdraft, created_at_ms) VALUES
    ('system:treasury', 'treasury', 'treasury', 0, 0),
    ('system:escrow', 'job escrow', 'escrow', 1, 0),
    ('system:fee', 'network fee', 'fee', 1, 0),
    ('system:reward_pool', 'availability reward pool', 'reward_pool', 1, 0);

-- Every movement of money. A row is never updated or deleted (the triggers
-- below refuse it); its id is the idempotency key of the operation.
CREATE TABLE transfers (
    id             TEXT PRIMARY KEY NOT NULL,
    kind           TEXT NOT NULL CHECK (kind IN ('posted', 'pending', 'post_pending', 'void_pending', 'expire_pending')),
    debit_account  TEXT NOT NULL REFERENCES accounts (id),
    credit_account TEXT NOT NULL REFERENCES accounts (id),
    -- posted/pending: the amount; post_pending: the amount posted (<= the
    -- pending amount, the rest is released); void/expire: the amount released.
    amount         INTEGER NOT NULL CHECK (amount >= 0),
    pending_id     TEXT REFERENCES transfers (id),
    deadline_ms    INTEGER,
    job_id         TEXT,
    node_id        TEXT,
    tokens         INTEGER NOT NULL DEFAULT 0 CHECK (tokens >= 0), -- model tokens a payout pays for
    memo           TEXT NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    CHECK (debit_account <> credit_account),
    CHECK ((kind = 'pending') = (deadline_ms IS NOT NULL)),
    CHECK ((kind IN ('post_pending', 'void_pending', 'expire_pending')) = (pending_id IS NOT NULL))
);

-- A pending transfer is resolved (posted, voided or expired) at most once.
CREATE UNIQUE INDEX transfers_resolved_once ON transfers (pending_id) WHERE pending_id IS NOT NULL;
CREATE INDEX transfers_debit ON transfers (debit_account, created_at_ms);
CREATE INDEX transfers_credit ON transfers (credit_account, created_at_ms);
CREATE INDEX transfers_job ON transfers (job_id) WHERE job_id IS NOT NULL;

CREATE TRIGGER transfers_no_update BEFORE UPDATE ON transfers
BEGIN
    SELECT RAISE(ABORT, 'transfers are immutable');
END;

CREATE TRIGGER transfers_no_delete BEFORE DELETE ON transfers
BEGIN
    SELECT RAISE(ABORT, 'transfers are immutable');
END;

-- Pending transfers not yet resolved (an index for the expiry sweep, kept in
-- the same transaction as the transfers that open and resolve them).
CREATE TABLE open_holds (
    transfer_id TEXT PRIMARY KEY NOT NULL REFERENCES transfers (id),
    job_id      TEXT UNIQUE,
    deadline_ms INTEGER NOT NULL
);
CREATE INDEX open_holds_deadline ON open_holds (deadline_ms);

-- API keys: only the SHA-256 of the key is stored (see ledger/keys.rs).
CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY NOT NULL,    -- public id ('key_<hex>'), shown in lists, used to revoke
    account_id    TEXT NOT NULL REFERENCES accounts (id),
    hash          BLOB NOT NULL UNIQUE CHECK (length(hash) = 32),
    scopes        TEXT NOT NULL,                -- comma-separated: submit, read, admin
    label         TEXT NOT NULL DEFAULT '',
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER,                      -- NULL: never
    revoked_at_ms INTEGER
);

-- The operator account a node earns for, set when the node registers.
CREATE TABLE node_operators (
    node_id      TEXT PRIMARY KEY NOT NULL,     -- lowercase hex ed25519 public key
    account_id   TEXT NOT NULL REFERENCES accounts (id),
    linked_at_ms INTEGER NOT NULL
);
CREATE INDEX node_operators_account ON node_operators (account_id);

-- Who pays for each job and the price terms fixed at submit, so settlement
-- never depends on a catalogue that changed since.
CREATE TABLE job_holds (
    job_id          TEXT PRIMARY KEY NOT NULL,
    account_id      TEXT NOT NULL REFERENCES accounts (id),
    input_per_mtok  INTEGER NOT NULL CHECK (input_per_mtok >= 0),   -- micro-MLX per million input tokens
    output_per_mtok INTEGER NOT NULL CHECK (output_per_mtok >= 0),  -- micro-MLX per million output tokens
    max_price       INTEGER NOT NULL CHECK (max_price >= 0)         -- the hold
);

-- Availability of dedicated nodes: online time per reward epoch, and the
-- memory they offered (the largest seen in the epoch).
CREATE TABLE availability (
    epoch        INTEGER NOT NULL,              -- epoch number: floor(ms / reward_epoch_ms)
    node_id      TEXT NOT NULL,
    memory_bytes INTEGER NOT NULL CHECK (memory_bytes >= 0),
    online_ms    INTEGER NOT NULL CHECK (online_ms >= 0),
    PRIMARY KEY (epoch, node_id)
);

-- Epochs whose rewards were paid (in the same transaction as the payouts).
CREATE TABLE reward_epochs (
    epoch      INTEGER PRIMARY KEY NOT NULL,
    paid_ms    INTEGER NOT NULL,
    total      INTEGER NOT NULL CHECK (total >= 0)
);
