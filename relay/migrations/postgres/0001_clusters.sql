-- PostgreSQL twin of ../sqlite/0001_clusters.sql: keep the two equivalent (same tables, columns and constraints).
-- Clusters and the hashes of their secrets. Timestamps are Unix seconds (BIGINT), hashes are lowercase hex
-- SHA-256 (TEXT), tags are a JSON object (TEXT): types every SQL backend has.
CREATE TABLE clusters (
    name                  TEXT    NOT NULL PRIMARY KEY,
    tags                  TEXT    NOT NULL,
    created_at            BIGINT  NOT NULL,
    onboarding_token_hash TEXT,
    onboarding_used       BOOLEAN NOT NULL,
    credential_hash       TEXT,
    onboarded_at          BIGINT,
    connected_since       BIGINT,
    last_seen             BIGINT,
    agent_version         TEXT
);
