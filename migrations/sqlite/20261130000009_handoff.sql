-- Hand-off: the tokens an attempt streamed to the client before it ended
-- without finishing the job (its node vanished, lost its lease, or drained).
-- The next attempt resumes after all of a job's segments, in order, so the
-- client's stream goes on with no gap and no repeat. A drained node's
-- segment carries its signed partial claim (finish_reason 'handoff'), which
-- is what pays it; a vanished node's segment has none and pays nobody.
CREATE TABLE job_segments (
    job_id      TEXT NOT NULL REFERENCES jobs (id),
    attempt     INTEGER NOT NULL,
    node_id     TEXT NOT NULL,
    first_index INTEGER NOT NULL CHECK (first_index >= 0),
    token_count INTEGER NOT NULL CHECK (token_count > 0),
    token_ids   BLOB NOT NULL,      -- token_count u32, little-endian
    text        TEXT NOT NULL,      -- the text streamed with them
    claim       BLOB,               -- ResultClaim of a hand-off, verified
    signature   BLOB,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, attempt)
);

CREATE UNIQUE INDEX job_segments_order ON job_segments (job_id, first_index);

-- Queue priority (see scheduler/queue.rs): 0 normal, 1..=3 higher.
ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 3);
