-- PostgreSQL twin of ../sqlite/0004_change_log.sql: keep the two equivalent (same tables, columns and constraints).
-- Issue 11: a change log that relay replicas follow (cluster created, deleted, tags or guard snapshot changed).
-- Every change appends one row in the transaction that makes it. `seq` comes from the single row of
-- change_log_head, incremented in that same transaction: the row lock (PostgreSQL) or the write lock (SQLite)
-- is held until commit, so sequence numbers are gapless and in commit order, and a reader that has seen N has
-- seen everything up to N. `pruned_through` is the highest sequence number removed by pruning: a reader behind
-- it must reload everything.
CREATE TABLE change_log_head (
    id             INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    seq            BIGINT  NOT NULL,
    pruned_through BIGINT  NOT NULL
);
INSERT INTO change_log_head (id, seq, pruned_through) VALUES (1, 0, 0);

CREATE TABLE cluster_changes (
    seq           BIGINT NOT NULL PRIMARY KEY,
    cluster       TEXT   NOT NULL, -- no foreign key: a deletion outlives its cluster
    kind          TEXT   NOT NULL, -- created | deleted | tags | guard
    guard_version BIGINT,          -- the new snapshot version, for kind = guard
    changed_at    BIGINT NOT NULL  -- Unix seconds
);
CREATE INDEX cluster_changes_changed_at ON cluster_changes (changed_at);
