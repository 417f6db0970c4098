-- Which replica owns what (issue 21): a node's row names the replica its
-- session is on, and a job's row the replica whose node holds its current
-- attempt (copied from the node's row when the attempt is assigned). The
-- orphan sweep requeues the attempts and offlines the nodes of replicas
-- whose liveness lease (`replica/<id>` in `leases`) is not live. NULL:
-- written before this column existed, owned by no live replica.
ALTER TABLE jobs ADD COLUMN replica TEXT;
ALTER TABLE nodes ADD COLUMN replica TEXT;
