-- PostgreSQL twin of ../sqlite/0005_fleet.sql: keep the two equivalent (same tables, columns and constraints).
-- Issue 11: the relay fleet. Each replica has a row with a lease it renews every third of its TTL; each tunnel a
-- replica holds has a row, deleted with its replica (or its cluster). A replica whose lease lapsed is ignored at
-- once (its tunnels route nothing) and its rows are deleted soon after by any live replica. Lease times are Unix
-- milliseconds by the database's clock (PostgreSQL's clock_timestamp(); SQLite serves one process on one host),
-- so the replicas' own clocks need not agree.
-- The change log's kinds now include 'identity' (a renewal replaced a cluster's certificate).
CREATE TABLE relay_replicas (
    id            TEXT    NOT NULL PRIMARY KEY,
    peer_address  TEXT,              -- HOST:PORT of its peer link; NULL without one
    started_at    BIGINT  NOT NULL,  -- Unix ms
    lease_expires BIGINT  NOT NULL,  -- Unix ms
    draining      BOOLEAN NOT NULL
);

CREATE TABLE relay_tunnels (
    replica         TEXT    NOT NULL REFERENCES relay_replicas (id) ON DELETE CASCADE,
    tunnel_id       BIGINT  NOT NULL, -- unique within the replica's life
    cluster         TEXT    NOT NULL REFERENCES clusters (name) ON DELETE CASCADE,
    agent_instance  TEXT    NOT NULL, -- hello.instance ('' when not said)
    agent_tunnels   BIGINT  NOT NULL, -- hello.tunnels, the agent's K (0 when not said)
    transport       TEXT    NOT NULL, -- wss | quic
    agent_address   TEXT    NOT NULL, -- the agent's address as the replica sees it
    connected_since BIGINT  NOT NULL, -- Unix seconds
    usable          BOOLEAN NOT NULL, -- false once the tunnel got GOAWAY (it takes no new requests)
    PRIMARY KEY (replica, tunnel_id)
);
CREATE INDEX relay_tunnels_cluster ON relay_tunnels (cluster);
