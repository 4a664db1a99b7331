-- PostgreSQL twin of ../sqlite/0002_identity_status.sql: keep the two equivalent (same tables, columns and constraints).
-- Issue 3: certificate identities replace bearer credentials; connectivity facts reported by the agent.
-- The current identity (fingerprint = lowercase hex SHA-256 of the certificate's DER, notAfter as Unix seconds),
-- the previous one (still accepted until the agent connects with the current one after a renewal), and the
-- latest metadata and health reports as JSON objects (TEXT). `last_seen` now holds the last connect or heartbeat.
ALTER TABLE clusters ADD COLUMN identity_fingerprint TEXT;
ALTER TABLE clusters ADD COLUMN identity_not_after BIGINT;
ALTER TABLE clusters ADD COLUMN previous_fingerprint TEXT;
ALTER TABLE clusters ADD COLUMN metadata TEXT;
ALTER TABLE clusters ADD COLUMN health TEXT;
-- Bearer credentials are no longer accepted; forget their hashes.
UPDATE clusters SET credential_hash = NULL;
