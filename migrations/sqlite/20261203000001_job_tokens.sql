-- Token chunks of unfinished jobs, relayed between replicas (issue 21; see
-- migrations/postgres for the contract). SQLite serves one replica, whose
-- watchers follow the in-process hub; the table is here so the Store seam
-- keeps one contract on both backends.
CREATE TABLE job_tokens (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    first_index INTEGER NOT NULL,
    chunk BLOB NOT NULL,
    written_at_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, attempt, first_index)
);
