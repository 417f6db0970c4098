-- Token chunks of unfinished jobs, relayed between replicas (issue 21): the
-- replica whose node runs an attempt writes its chunks here in batches
-- (one statement per batch, a NOTIFY on `mlxnet_tokens` per job as a
-- wake-up hint); a watcher on any replica reads them in (attempt,
-- first_index) order. `chunk` is the protobuf `JobEvent.Tokens`. An
-- attempt's unkept tokens are deleted when the job rewinds; every row of
-- a job is deleted a while after the job ends (`Store::purge_tokens`).
CREATE TABLE job_tokens (
    job_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    first_index BIGINT NOT NULL,
    chunk BYTEA NOT NULL,
    written_at_ms BIGINT NOT NULL,
    PRIMARY KEY (job_id, attempt, first_index)
);
