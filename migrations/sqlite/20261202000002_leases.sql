-- Leases of the singleton duties (issue 21): one holder at a time per
-- name, and a fencing epoch that grows whenever a holder takes a lease it
-- did not hold, so a replica that lost a lease cannot commit under it
-- (`StoreTx::fence` checks holder, epoch and expiry inside the duty's
-- transaction). A released lease keeps its epoch, with no holder.
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL CHECK (epoch >= 1),
    expires_at_ms INTEGER NOT NULL
);
