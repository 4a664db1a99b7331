-- Issue 4: guard's RBAC lives at the relay. Custom role definitions (the four built-ins are rows too, without a
-- definition, so that assignments can reference every role through one foreign key), role and deny assignments
-- per cluster, a per-cluster snapshot version, and the group directory used for group overage.
-- Namespaces are '' for the whole cluster (NULL would defeat the UNIQUE constraint); lists are JSON arrays (TEXT).

-- Every change that touches a cluster's guard snapshot raises this (to at least the current Unix time in ms, so
-- a re-registered or imported cluster still outranks the snapshot its guard keeps on disk).
ALTER TABLE clusters ADD COLUMN guard_version BIGINT NOT NULL DEFAULT 0;
UPDATE clusters SET guard_version = CAST(strftime('%s', 'now') AS INTEGER) * 1000;

CREATE TABLE role_definitions (
    id         TEXT    NOT NULL PRIMARY KEY,
    id_key     TEXT    NOT NULL UNIQUE, -- lower(id): ids are unique ignoring ASCII case, as guard matches them
    name_key   TEXT    NOT NULL UNIQUE, -- lower(name): assignments may name a role
    builtin    BOOLEAN NOT NULL,
    definition TEXT,                    -- the role as JSON (guard's camelCase form); NULL for built-ins
    created_at BIGINT  NOT NULL
);
-- The built-in rows are written by the store at open, from tether_auth::rbac::builtin_roles().

CREATE TABLE role_assignments (
    id           TEXT   NOT NULL PRIMARY KEY,
    role_id      TEXT   NOT NULL REFERENCES role_definitions (id), -- NO ACTION: an assigned role cannot go
    principal_id TEXT   NOT NULL,
    cluster      TEXT   NOT NULL REFERENCES clusters (name) ON DELETE CASCADE,
    namespace    TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    UNIQUE (cluster, namespace, principal_id, role_id)
);
CREATE INDEX role_assignments_role ON role_assignments (role_id);

CREATE TABLE deny_assignments (
    id                 TEXT   NOT NULL PRIMARY KEY,
    name               TEXT   NOT NULL,
    data_actions       TEXT   NOT NULL,
    not_data_actions   TEXT   NOT NULL,
    principals         TEXT   NOT NULL,
    exclude_principals TEXT   NOT NULL,
    cluster            TEXT   NOT NULL REFERENCES clusters (name) ON DELETE CASCADE,
    namespace          TEXT   NOT NULL,
    created_at         BIGINT NOT NULL
);
CREATE INDEX deny_assignments_cluster ON deny_assignments (cluster);

CREATE TABLE directory_users (
    oid        TEXT   NOT NULL PRIMARY KEY,
    tid        TEXT,
    groups     TEXT   NOT NULL,
    updated_at BIGINT NOT NULL
);
