-- A node's record beyond its audits (see coordinator/src/audit.rs,
-- "Reputation and probation"): jobs completed under a verified claim,
-- failed attempts, and verdicts given as an auditor on the losing side.
ALTER TABLE node_records ADD COLUMN jobs_done INTEGER NOT NULL DEFAULT 0 CHECK (jobs_done >= 0);
ALTER TABLE node_records ADD COLUMN failed_attempts INTEGER NOT NULL DEFAULT 0 CHECK (failed_attempts >= 0);
ALTER TABLE node_records ADD COLUMN wrong_verdicts INTEGER NOT NULL DEFAULT 0 CHECK (wrong_verdicts >= 0);
