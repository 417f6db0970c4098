-- A node's job slots (issue 21: two replicas never double-book a Mac):
-- what its Hello said it runs at once (`max_concurrent_jobs`, at least 1),
-- written at each registration. An assignment books one of them with a
-- conditional update: it lands only while the node's assigned and running
-- jobs are fewer (see `jobs::assign`). 0: rows from before this column, or
-- a record that names no slots: no bound.
ALTER TABLE nodes ADD COLUMN slots BIGINT NOT NULL DEFAULT 0;
CREATE INDEX jobs_node_active ON jobs (node_id) WHERE state IN ('assigned', 'running');
