-- A key made with a key (CreateApiKey) names it as its parent (issue 16):
-- revoking a key revokes every key under it, a key is accepted only while
-- its parent is unrevoked, and its expiry is clipped to its parent's when
-- it is made. NULL: a root key (bootstrap, or made by the ledger itself).
ALTER TABLE api_keys ADD COLUMN parent_key_id TEXT REFERENCES api_keys (id);
CREATE INDEX api_keys_parent ON api_keys (parent_key_id);
