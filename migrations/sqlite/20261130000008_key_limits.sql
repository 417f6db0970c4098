-- Per-key abuse limits (see coordinator/src/limits.rs). NULL: the
-- coordinator's configured default (limits.key_requests_per_sec,
-- limits.key_max_in_flight); 0: unlimited.
ALTER TABLE api_keys ADD COLUMN max_requests_per_sec INTEGER CHECK (max_requests_per_sec >= 0);
ALTER TABLE api_keys ADD COLUMN max_in_flight INTEGER CHECK (max_in_flight >= 0);
