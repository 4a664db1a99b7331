//! The store's test suite, run against both backends: SQLite (a file in a temporary directory) and a real
//! PostgreSQL server started for the test (`tether_testkit::postgres`; without PostgreSQL the PostgreSQL half
//! skips with a printed reason, or fails when `CI` is set).
//!
//! Every case gets a fresh database and may open several handles on it (`Db::open`), which is how relay
//! replicas share one database: the race cases make two handles contend for the same rows.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tether_auth::rbac::RoleDefinition;
use tether_relay::store::{
    self, Activity, AgentHealth, ChangeFeed, ChangeKind, ClusterIdentity, ClusterMetadata,
    DenyAssignmentRecord, DirectoryEntry, FeedEvent, NewCluster, NewIdentity, ReplicaLease,
    RoleAssignmentRecord, Store, StoreError, TokenHash, TunnelRecord,
};
use tether_testkit::postgres::Postgres;
use time::OffsetDateTime;

/// One database of one backend.
struct Db {
    url: String,
    /// Keeps the SQLite file's directory alive.
    _dir: Option<tempfile::TempDir>,
    postgres: bool,
}

impl Db {
    fn sqlite() -> Db {
        let dir = tempfile::tempdir().expect("tempdir");
        Db {
            url: format!("sqlite://{}", dir.path().join("relay.db").display()),
            _dir: Some(dir),
            postgres: false,
        }
    }

    fn postgres(pg: &Postgres) -> Db {
        Db {
            url: pg.fresh_database().expect("create a database"),
            _dir: None,
            postgres: true,
        }
    }

    /// A new handle on this database (its own connection pool), as another replica would open it.
    async fn open(&self) -> Arc<dyn Store> {
        store::open(&self.url).await.expect("store opens")
    }
}

/// How long one SQLite case may run before it counts as hung.
const CASE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(300);

/// Runs each case against SQLite (one test per case) and against PostgreSQL (one server for all cases, a fresh
/// database for each).
macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    // A deadline, not a timing assertion: a case that hangs (once seen, with a worker spinning
                    // in sqlx's pool) fails here instead of holding CI until its limit.
                    tokio::time::timeout(super::CASE_DEADLINE, super::$case(&super::Db::sqlite()))
                        .await
                        .expect("the case finished within its deadline");
                }
            )*
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn postgres_suite() {
            let Some(pg) = Postgres::start_or_skip("the PostgreSQL store suite").expect("PostgreSQL starts")
            else {
                return;
            };
            $(
                eprintln!("postgres: {}", stringify!($case));
                $case(&Db::postgres(&pg)).await;
            )*
            pg.stop();
        }
    };
}

suite!(
    create_get_list_delete,
    onboarding_token_redeems_once,
    renewal_replaces_the_certificate_at_once_and_is_logged,
    connection_facts,
    role_definitions_are_unique_and_builtins_are_reserved,
    assignments_raise_versions_reference_roles_and_go_with_their_cluster,
    import_is_all_or_nothing,
    directory_entries,
    tags_change_and_are_logged,
    change_log_pages_and_prunes,
    race_onboarding_token_is_redeemed_exactly_once,
    race_guard_versions_grow_in_commit_order,
    race_duplicate_assignments_one_wins,
    race_deletions_and_batches_do_not_deadlock,
    change_feed_sees_changes_made_through_another_handle,
    change_feed_survives_a_lost_listener,
    replicas_hold_leases_that_lapse,
    tunnels_route_while_their_replica_lives,
);

fn new_cluster(name: &str, token: &str) -> NewCluster {
    NewCluster {
        name: name.into(),
        tags: BTreeMap::from([("env".to_string(), "test".to_string())]),
        onboarding_token_hash: TokenHash::of(token),
        created_at: OffsetDateTime::from_unix_timestamp(1_700_000_000).expect("valid timestamp"),
    }
}

async fn create_get_list_delete(db: &Db) {
    let store = db.open().await;
    let created = store
        .create_cluster(&new_cluster("b", "t1"))
        .await
        .expect("create b");
    store
        .create_cluster(&new_cluster("a", "t2"))
        .await
        .expect("create a");
    assert!(matches!(
        store.create_cluster(&new_cluster("a", "t3")).await,
        Err(StoreError::AlreadyExists(n)) if n == "a"
    ));
    let got = store.cluster("b").await.expect("query").expect("b exists");
    assert_eq!(got, created);
    assert_eq!(got.tags["env"], "test");
    let names: Vec<_> = store
        .list_clusters()
        .await
        .expect("list")
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert!(store.delete_cluster("a").await.expect("delete"));
    assert!(!store.delete_cluster("a").await.expect("delete again"));
    assert!(store.cluster("a").await.expect("query").is_none());
    assert!(store.secrets("a").await.expect("query").is_none());
}

fn identity(fingerprint: &str) -> NewIdentity {
    NewIdentity {
        fingerprint: fingerprint.into(),
        not_after: OffsetDateTime::from_unix_timestamp(1_900_000_000).expect("valid"),
    }
}

async fn onboarding_token_redeems_once(db: &Db) {
    let store = db.open().await;
    store
        .create_cluster(&new_cluster("c", "token"))
        .await
        .expect("create");
    let now = OffsetDateTime::now_utc();
    let first = identity("aa");
    assert!(
        !store
            .redeem_onboarding_token("c", &TokenHash::of("wrong"), &first, now)
            .await
            .expect("redeem")
    );
    assert!(
        !store
            .redeem_onboarding_token("nope", &TokenHash::of("token"), &first, now)
            .await
            .expect("redeem")
    );
    assert!(
        store
            .redeem_onboarding_token("c", &TokenHash::of("token"), &first, now)
            .await
            .expect("redeem")
    );
    assert!(
        !store
            .redeem_onboarding_token("c", &TokenHash::of("token"), &identity("bb"), now)
            .await
            .expect("redeem")
    );
    let secrets = store.secrets("c").await.expect("query").expect("exists");
    assert!(secrets.onboarding_used);
    let c = store.cluster("c").await.expect("query").expect("exists");
    assert!(c.onboarded);
    assert_eq!(
        c.identity,
        Some(ClusterIdentity {
            fingerprint: "aa".into(),
            not_after: first.not_after,
            previous_fingerprint: None,
        })
    );
}

async fn renewal_replaces_the_certificate_at_once_and_is_logged(db: &Db) {
    let store = db.open().await;
    store
        .create_cluster(&new_cluster("c", "token"))
        .await
        .expect("create");
    let now = OffsetDateTime::now_utc();
    store
        .redeem_onboarding_token("c", &TokenHash::of("token"), &identity("a"), now)
        .await
        .expect("redeem");
    let head = store.changes_since(u64::MAX, 0).await.expect("head").head;
    assert!(
        !store
            .renew_identity("c", "unknown", &identity("x"))
            .await
            .expect("renew"),
        "only the current certificate may renew"
    );
    assert!(
        store
            .renew_identity("c", "a", &identity("b"))
            .await
            .expect("renew")
    );
    let id = store
        .cluster("c")
        .await
        .expect("q")
        .expect("c")
        .identity
        .expect("identity");
    // The replaced certificate is refused from now on; the store remembers it only to say why.
    assert!(id.accepts("b") && !id.accepts("a") && !id.accepts("x"));
    assert!(id.was_replaced("a") && !id.was_replaced("b"));
    // A stolen replaced certificate cannot renew either (and so cannot take the identity back).
    assert!(
        !store
            .renew_identity("c", "a", &identity("evil"))
            .await
            .expect("renew")
    );
    // Every replica learns of the renewal from the change log.
    let page = store.changes_since(head, 10).await.expect("changes");
    let kinds: Vec<ChangeKind> = page.changes.iter().map(|c| c.kind).collect();
    assert_eq!(kinds, [ChangeKind::Identity], "{page:?}");
    assert_eq!(page.changes[0].cluster, "c");
    assert!(
        store
            .renew_identity("c", "b", &identity("d"))
            .await
            .expect("renew again")
    );
    let id = store
        .cluster("c")
        .await
        .expect("q")
        .expect("c")
        .identity
        .expect("identity");
    assert!(id.accepts("d") && !id.accepts("b") && id.was_replaced("b"));
    assert!(
        !store
            .renew_identity("gone", "d", &identity("e"))
            .await
            .expect("renew")
    );
}

async fn connection_facts(db: &Db) {
    let store = db.open().await;
    store
        .create_cluster(&new_cluster("c", "token"))
        .await
        .expect("create");
    let t1 = OffsetDateTime::from_unix_timestamp(1_800_000_000).expect("valid");
    let t2 = OffsetDateTime::from_unix_timestamp(1_800_000_060).expect("valid");
    store
        .record_connected("c", "v1.2.3", t1)
        .await
        .expect("connected");
    let c = store.cluster("c").await.expect("query").expect("exists");
    assert_eq!(
        (c.connected_since, c.last_seen, c.agent_version.as_deref()),
        (Some(t1), Some(t1), Some("v1.2.3"))
    );
    let health = AgentHealth {
        uptime_seconds: 5,
        memory_bytes: 1 << 20,
        cpu_seconds: 0.25,
        reconnects: 2,
        tunnel_rtt_millis: Some(1.5),
        reported_at: t2,
    };
    store
        .record_activity(&[
            Activity {
                name: "c".into(),
                seen_at: t2,
                health: Some(health.clone()),
                agent_version: Some("v1.2.4".into()),
            },
            Activity {
                name: "unknown".into(),
                seen_at: t2,
                health: None,
                agent_version: None,
            },
        ])
        .await
        .expect("activity");
    let c = store.cluster("c").await.expect("query").expect("exists");
    assert_eq!(c.last_seen, Some(t2));
    assert_eq!(c.health.as_ref(), Some(&health));
    assert_eq!(c.agent_version.as_deref(), Some("v1.2.4"));
    // An older time does not move last-seen back; a batch without health keeps the stored one.
    store
        .record_activity(&[Activity {
            name: "c".into(),
            seen_at: t1,
            health: None,
            agent_version: None,
        }])
        .await
        .expect("activity");
    let c = store.cluster("c").await.expect("query").expect("exists");
    assert_eq!((c.last_seen, c.health.as_ref()), (Some(t2), Some(&health)));

    let metadata = ClusterMetadata {
        kubernetes_version: "v1.33.1".into(),
        node_count: 3,
        total_cpu_millis: 6000,
        total_memory_bytes: 8 << 30,
        distribution: "kind".into(),
        infrastructure: "generic".into(),
        reported_at: t2,
    };
    store
        .record_metadata("c", &metadata, "v1.2.5")
        .await
        .expect("metadata");
    store.record_disconnected("c").await.expect("disconnected");
    let c = store.cluster("c").await.expect("query").expect("exists");
    assert_eq!((c.connected_since, c.last_seen), (None, Some(t2)));
    assert_eq!(c.metadata, Some(metadata));
    assert_eq!(c.agent_version.as_deref(), Some("v1.2.5"));
}

fn custom_role(id: &str, name: &str) -> RoleDefinition {
    RoleDefinition {
        id: id.into(),
        name: name.into(),
        description: String::new(),
        data_actions: vec!["Microsoft.Kubernetes/connectedClusters/pods/read".into()],
        not_data_actions: Vec::new(),
    }
}

fn assignment(id: &str, role: &str, cluster: &str, ns: Option<&str>) -> RoleAssignmentRecord {
    RoleAssignmentRecord {
        id: id.into(),
        role_id: role.into(),
        principal_id: "0f1e2d3c-0000-4000-8000-000000000001".into(),
        cluster: cluster.into(),
        namespace: ns.map(str::to_owned),
        created_at: OffsetDateTime::from_unix_timestamp(1_700_000_000).expect("valid"),
    }
}

fn deny(id: &str, cluster: &str) -> DenyAssignmentRecord {
    DenyAssignmentRecord {
        id: id.into(),
        name: "no secrets".into(),
        data_actions: vec!["Microsoft.Kubernetes/connectedClusters/secrets/*".into()],
        not_data_actions: Vec::new(),
        principals: vec!["*".into()],
        exclude_principals: vec!["x".into()],
        cluster: cluster.into(),
        namespace: Some("prod".into()),
        created_at: OffsetDateTime::from_unix_timestamp(1_700_000_000).expect("valid"),
    }
}

const VIEWER: &str = "63f0a09d-1495-4db4-a681-037d84835eb4";

async fn role_definitions_are_unique_and_builtins_are_reserved(db: &Db) {
    let store = db.open().await;
    let at = OffsetDateTime::now_utc();
    assert!(store.role_definitions().await.expect("list").is_empty());
    store
        .create_role_definition(&custom_role("pod-reader", "Pod Reader"), at)
        .await
        .expect("create");
    for dup in [
        custom_role("POD-READER", "Other"),
        custom_role("other", "pod reader"),
        custom_role(VIEWER, "Mine"),
        custom_role("mine", "Azure Arc Kubernetes Viewer"),
    ] {
        assert!(
            matches!(
                store.create_role_definition(&dup, at).await,
                Err(StoreError::Conflict(_))
            ),
            "{dup:?}"
        );
    }
    let roles = store.role_definitions().await.expect("list");
    assert_eq!(roles, vec![custom_role("pod-reader", "Pod Reader")]);
    assert!(!store.delete_role_definition(VIEWER).await.expect("delete"));
    assert!(
        store
            .delete_role_definition("Pod-Reader")
            .await
            .expect("delete")
    );
    assert!(
        !store
            .delete_role_definition("pod-reader")
            .await
            .expect("delete")
    );
}

async fn assignments_raise_versions_reference_roles_and_go_with_their_cluster(db: &Db) {
    let store = db.open().await;
    store
        .create_cluster(&new_cluster("c", "t"))
        .await
        .expect("create");
    store
        .create_cluster(&new_cluster("d", "t2"))
        .await
        .expect("create");
    let at = OffsetDateTime::now_utc();
    store
        .create_role_definition(&custom_role("pod-reader", "Pod Reader"), at)
        .await
        .expect("role");
    let v0 = store
        .guard_state("c")
        .await
        .expect("state")
        .expect("exists")
        .version;
    assert!(
        v0 >= 1_700_000_000_000,
        "versions start at the creation time in ms: {v0}"
    );

    assert!(matches!(
        store.create_role_assignment(&assignment("a0", VIEWER, "nope", None)).await,
        Err(StoreError::NotFound(m)) if m.contains("nope")
    ));
    assert!(matches!(
        store.create_role_assignment(&assignment("a0", "ghost", "c", None)).await,
        Err(StoreError::NotFound(m)) if m.contains("ghost")
    ));
    let v1 = store
        .create_role_assignment(&assignment("a1", VIEWER, "c", Some("dev")))
        .await
        .expect("assign");
    let v2 = store
        .create_role_assignment(&assignment("a2", "pod-reader", "c", None))
        .await
        .expect("assign");
    store
        .create_role_assignment(&assignment("a3", VIEWER, "d", None))
        .await
        .expect("assign");
    assert!(v0 < v1 && v1 < v2, "{v0} {v1} {v2}");
    assert!(matches!(
        store
            .create_role_assignment(&assignment("a4", VIEWER, "c", Some("dev")))
            .await,
        Err(StoreError::Conflict(_))
    ));
    let refused = store.delete_role_definition("pod-reader").await;
    assert!(
        matches!(refused, Err(StoreError::Conflict(_))),
        "{refused:?}"
    );
    let v3 = store
        .create_deny_assignment(&deny("d1", "c"))
        .await
        .expect("deny");
    assert!(v3 > v2);

    let state = store
        .guard_state("c")
        .await
        .expect("state")
        .expect("exists");
    assert_eq!(state.version, v3);
    assert_eq!(state.roles, vec![custom_role("pod-reader", "Pod Reader")]);
    assert_eq!(
        state.assignments,
        vec![
            assignment("a1", VIEWER, "c", Some("dev")),
            assignment("a2", "pod-reader", "c", None)
        ]
    );
    assert_eq!(state.deny_assignments, vec![deny("d1", "c")]);
    assert_eq!(store.role_assignments(None).await.expect("list").len(), 3);
    assert_eq!(
        store.role_assignments(Some("d")).await.expect("list").len(),
        1
    );
    assert_eq!(
        store.deny_assignments(Some("d")).await.expect("list").len(),
        0
    );

    let (cluster, v4) = store
        .delete_role_assignment("a2")
        .await
        .expect("delete")
        .expect("existed");
    assert_eq!(cluster, "c");
    assert!(v4 > v3);
    assert!(
        store
            .delete_role_assignment("a2")
            .await
            .expect("delete")
            .is_none()
    );
    assert!(
        store
            .delete_role_definition("pod-reader")
            .await
            .expect("delete")
    );
    let (_, v5) = store
        .delete_deny_assignment("d1")
        .await
        .expect("delete")
        .expect("existed");
    assert!(v5 > v4);

    // Deleting a cluster deletes its assignments, and nothing of the others'.
    store
        .create_deny_assignment(&deny("d2", "c"))
        .await
        .expect("deny");
    assert!(store.delete_cluster("c").await.expect("delete"));
    assert!(store.guard_state("c").await.expect("state").is_none());
    let left: Vec<_> = store
        .role_assignments(None)
        .await
        .expect("list")
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(left, ["a3"]);
    assert!(store.deny_assignments(None).await.expect("list").is_empty());
}

async fn import_is_all_or_nothing(db: &Db) {
    let store = db.open().await;
    let new = new_cluster("moved", "t");
    let role = custom_role("pod-reader", "Pod Reader");
    let bad = [assignment("a1", "ghost", "moved", None)];
    assert!(matches!(
        store.import_cluster(&new, &[], &bad, &[]).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(store.cluster("moved").await.expect("query").is_none());
    let good = [
        assignment("a1", "pod-reader", "moved", None),
        assignment("a2", VIEWER, "moved", Some("ns")),
    ];
    let record = store
        .import_cluster(
            &new,
            std::slice::from_ref(&role),
            &good,
            &[deny("d1", "moved")],
        )
        .await
        .expect("import");
    assert_eq!(record.name, "moved");
    let state = store
        .guard_state("moved")
        .await
        .expect("state")
        .expect("exists");
    assert_eq!(
        (state.assignments.len(), state.deny_assignments.len()),
        (2, 1)
    );
    assert_eq!(state.roles, vec![role.clone()]);
    // The role existed already this time: not an error.
    assert!(matches!(
        store.import_cluster(&new, &[role], &[], &[]).await,
        Err(StoreError::AlreadyExists(_))
    ));
    let other = new_cluster("other", "t");
    store
        .import_cluster(&other, &[custom_role("pod-reader", "Pod Reader")], &[], &[])
        .await
        .expect("import with an existing role");
}

async fn directory_entries(db: &Db) {
    let store = db.open().await;
    let at = OffsetDateTime::from_unix_timestamp(1_700_000_000).expect("valid");
    assert!(store.directory_entry("u").await.expect("get").is_none());
    let mut entry = DirectoryEntry {
        oid: "u".into(),
        tid: Some("t".into()),
        groups: vec!["g1".into(), "g2".into()],
        updated_at: at,
    };
    store.set_directory_entry(&entry).await.expect("set");
    assert_eq!(
        store.directory_entry("u").await.expect("get"),
        Some(entry.clone())
    );
    entry.groups = vec!["g3".into()];
    entry.tid = None;
    store.set_directory_entry(&entry).await.expect("replace");
    assert_eq!(store.directory_entry("u").await.expect("get"), Some(entry));
    assert!(store.delete_directory_entry("u").await.expect("delete"));
    assert!(!store.delete_directory_entry("u").await.expect("delete"));
}

async fn tags_change_and_are_logged(db: &Db) {
    let store = db.open().await;
    store
        .create_cluster(&new_cluster("c", "t"))
        .await
        .expect("create");
    let tags = BTreeMap::from([("team".to_string(), "payments".to_string())]);
    assert!(store.set_cluster_tags("c", &tags).await.expect("set"));
    assert!(!store.set_cluster_tags("nope", &tags).await.expect("set"));
    assert_eq!(store.cluster("c").await.expect("q").expect("c").tags, tags);
    let page = store.changes_since(0, 100).await.expect("log");
    let kinds: Vec<_> = page
        .changes
        .iter()
        .map(|c| (c.cluster.as_str(), c.kind))
        .collect();
    assert_eq!(kinds, [("c", ChangeKind::Created), ("c", ChangeKind::Tags)]);
}

async fn change_log_pages_and_prunes(db: &Db) {
    let store = db.open().await;
    let empty = store.changes_since(0, 10).await.expect("log");
    assert_eq!(
        (empty.head, empty.reset, empty.changes.len()),
        (0, false, 0)
    );
    for name in ["a", "b", "c"] {
        store
            .create_cluster(&new_cluster(name, name))
            .await
            .expect("create");
    }
    let v = store
        .create_role_assignment(&assignment("a1", VIEWER, "b", None))
        .await
        .expect("assign");
    assert!(store.delete_cluster("a").await.expect("delete"));
    assert!(!store.delete_cluster("a").await.expect("delete again"));

    let all = store.changes_since(0, 100).await.expect("log");
    assert!(!all.reset);
    assert_eq!(all.head, 5);
    let entries: Vec<_> = all
        .changes
        .iter()
        .map(|c| (c.seq, c.cluster.as_str(), c.kind))
        .collect();
    assert_eq!(
        entries,
        [
            (1, "a", ChangeKind::Created),
            (2, "b", ChangeKind::Created),
            (3, "c", ChangeKind::Created),
            (4, "b", ChangeKind::Guard(v)),
            (5, "a", ChangeKind::Deleted),
        ]
    );
    // Pages: the limit holds, the cursor continues.
    let first = store.changes_since(0, 2).await.expect("log");
    assert_eq!(
        first.changes.iter().map(|c| c.seq).collect::<Vec<_>>(),
        [1, 2]
    );
    let rest = store.changes_since(2, 100).await.expect("log");
    assert_eq!(
        rest.changes.iter().map(|c| c.seq).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    assert!(
        store
            .changes_since(5, 100)
            .await
            .expect("log")
            .changes
            .is_empty()
    );
    // A cursor from the future (another database) means: reload.
    let future = store.changes_since(6, 100).await.expect("log");
    assert!(future.reset && future.changes.is_empty() && future.head == 5);

    // Nothing is older than an hour ago; everything is older than a minute from now.
    let now = OffsetDateTime::now_utc();
    assert_eq!(
        store
            .prune_changes(now - time::Duration::hours(1))
            .await
            .expect("prune"),
        0
    );
    assert_eq!(
        store
            .prune_changes(now + time::Duration::minutes(1))
            .await
            .expect("prune"),
        5
    );
    // A reader behind the pruned part must reload; one at the head is fine.
    let behind = store.changes_since(3, 100).await.expect("log");
    assert!(behind.reset && behind.changes.is_empty() && behind.head == 5);
    let current = store.changes_since(5, 100).await.expect("log");
    assert!(!current.reset);
    // Sequence numbers continue after pruning.
    store
        .create_cluster(&new_cluster("d", "d"))
        .await
        .expect("create");
    let next = store.changes_since(5, 100).await.expect("log");
    assert_eq!(next.changes.iter().map(|c| c.seq).collect::<Vec<_>>(), [6]);
}

/// Two handles (replicas) race to redeem one onboarding token, many times over: exactly one wins each time, and
/// the stored identity is the winner's.
async fn race_onboarding_token_is_redeemed_exactly_once(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    for round in 0..10 {
        let name = format!("c{round}");
        a.create_cluster(&new_cluster(&name, "token"))
            .await
            .expect("create");
        let mut attempts = tokio::task::JoinSet::new();
        for i in 0..8 {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let name = name.clone();
            attempts.spawn(async move {
                let fingerprint = format!("fp-{i}");
                let won = store
                    .redeem_onboarding_token(
                        &name,
                        &TokenHash::of("token"),
                        &identity(&fingerprint),
                        OffsetDateTime::now_utc(),
                    )
                    .await
                    .expect("redeem");
                won.then_some(fingerprint)
            });
        }
        let winners: Vec<String> = attempts.join_all().await.into_iter().flatten().collect();
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        let stored = b
            .cluster(&name)
            .await
            .expect("query")
            .expect("exists")
            .identity
            .expect("identity");
        assert_eq!(stored.fingerprint, winners[0]);
    }
}

/// Guard changes on one cluster from two handles at once: every version is distinct, the final snapshot has
/// the highest, and the change log lists them in increasing order (commit order is version order).
async fn race_guard_versions_grow_in_commit_order(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    a.create_cluster(&new_cluster("c", "t"))
        .await
        .expect("create");
    let cursor = a.changes_since(0, 100).await.expect("log").head;
    let mut writers = tokio::task::JoinSet::new();
    for i in 0..24 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        writers.spawn(async move {
            let mut record = assignment(&format!("a{i}"), VIEWER, "c", None);
            record.principal_id = format!("principal-{i}");
            if i % 3 == 0 {
                store
                    .create_deny_assignment(&deny(&format!("d{i}"), "c"))
                    .await
                    .expect("deny")
            } else {
                store.create_role_assignment(&record).await.expect("assign")
            }
        });
    }
    let mut versions = writers.join_all().await;
    versions.sort_unstable();
    let count = versions.len();
    versions.dedup();
    assert_eq!(versions.len(), count, "duplicate versions: {versions:?}");
    let state = b.guard_state("c").await.expect("state").expect("exists");
    assert_eq!(Some(&state.version), versions.last());
    assert_eq!(state.assignments.len() + state.deny_assignments.len(), 24);
    let logged: Vec<u64> = b
        .changes_since(cursor, 100)
        .await
        .expect("log")
        .changes
        .iter()
        .map(|c| match c.kind {
            ChangeKind::Guard(v) => v,
            other => panic!("unexpected change {other:?}"),
        })
        .collect();
    assert_eq!(logged, versions, "log order is version order");
}

/// The same role for the same principal and scope, requested through two handles at once: one succeeds, the
/// others are conflicts, one row is stored.
async fn race_duplicate_assignments_one_wins(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    a.create_cluster(&new_cluster("c", "t"))
        .await
        .expect("create");
    let mut attempts = tokio::task::JoinSet::new();
    for i in 0..8 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        attempts.spawn(async move {
            store
                .create_role_assignment(&assignment(&format!("a{i}"), VIEWER, "c", Some("ns")))
                .await
        });
    }
    let results = attempts.join_all().await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let conflicts = results
        .iter()
        .filter(|r| matches!(r, Err(StoreError::Conflict(_))))
        .count();
    assert_eq!((ok, conflicts), (1, 7), "{results:?}");
    assert_eq!(b.role_assignments(Some("c")).await.expect("list").len(), 1);
}

/// A cluster deleted through one handle while its assignments are deleted and its agent's activity is written
/// through another (in the opposite row order): every call ends without a database error, nothing is left.
async fn race_deletions_and_batches_do_not_deadlock(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    for round in 0..5 {
        let names: Vec<String> = (0..6).map(|i| format!("r{round}-c{i}")).collect();
        for name in &names {
            a.create_cluster(&new_cluster(name, "t"))
                .await
                .expect("create");
            for i in 0..4 {
                let mut record = assignment(&format!("{name}-a{i}"), VIEWER, name, None);
                record.principal_id = format!("p{i}");
                a.create_role_assignment(&record).await.expect("assign");
            }
        }
        let activity = |reverse: bool| -> Vec<Activity> {
            let mut batch: Vec<Activity> = names
                .iter()
                .map(|name| Activity {
                    name: name.clone(),
                    seen_at: OffsetDateTime::now_utc(),
                    health: None,
                    agent_version: Some("v1".into()),
                })
                .collect();
            if reverse {
                batch.reverse();
            }
            batch
        };
        let mut tasks = tokio::task::JoinSet::new();
        {
            let (a, b) = (a.clone(), b.clone());
            let (forward, backward) = (activity(false), activity(true));
            tasks.spawn(async move { a.record_activity(&forward).await.map(|_| 0) });
            tasks.spawn(async move { b.record_activity(&backward).await.map(|_| 0) });
        }
        for name in &names {
            let store = a.clone();
            let doomed = name.clone();
            tasks.spawn(async move { store.delete_cluster(&doomed).await.map(u64::from) });
            for i in 0..4 {
                let store = b.clone();
                let id = format!("{name}-a{i}");
                tasks.spawn(async move {
                    store
                        .delete_role_assignment(&id)
                        .await
                        .map(|r| r.map_or(0, |(_, v)| v))
                });
            }
        }
        for result in tasks.join_all().await {
            result.expect("no store call fails");
        }
        for name in &names {
            assert!(a.cluster(name).await.expect("query").is_none());
            assert!(
                a.role_assignments(Some(name))
                    .await
                    .expect("list")
                    .is_empty()
            );
        }
    }
}

/// A replica's feed (handle B) sees what another replica (handle A) changed: on PostgreSQL through NOTIFY alone
/// (the periodic re-read is set to an hour, so only a notification can deliver in time), on SQLite through the
/// re-read.
async fn change_feed_sees_changes_made_through_another_handle(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    a.create_cluster(&new_cluster("before", "t"))
        .await
        .expect("create");
    let resync = if db.postgres {
        Duration::from_secs(3600)
    } else {
        Duration::from_millis(50)
    };
    let mut feed = ChangeFeed::subscribe(b.clone(), resync)
        .await
        .expect("subscribe");
    assert!(feed.has_push(), "both backends push within a handle");
    assert_eq!(feed.cursor(), 1, "the feed starts after what existed");
    // The first `next` call starts waiting for a signal; its first tick of the re-read interval fires at once,
    // so on PostgreSQL wait for that to pass before changing anything (the change must come by NOTIFY).
    let waiting = tokio::time::timeout(Duration::from_millis(300), feed.next()).await;
    assert!(waiting.is_err(), "no change yet: {waiting:?}");

    a.create_cluster(&new_cluster("c", "t"))
        .await
        .expect("create");
    let tags = BTreeMap::from([("env".to_string(), "prod".to_string())]);
    a.set_cluster_tags("c", &tags).await.expect("tags");
    let version = a
        .create_role_assignment(&assignment("a1", VIEWER, "c", None))
        .await
        .expect("assign");
    assert!(a.delete_cluster("c").await.expect("delete"));
    let expected = [
        ChangeKind::Created,
        ChangeKind::Tags,
        ChangeKind::Guard(version),
        ChangeKind::Deleted,
    ];

    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.len() < expected.len() {
        let event = tokio::time::timeout_at(deadline, feed.next())
            .await
            .unwrap_or_else(|_| panic!("only {seen:?} arrived within 10 s"))
            .expect("feed");
        match event {
            FeedEvent::Changes(changes) => {
                for change in changes {
                    assert_eq!(change.cluster, "c");
                    seen.push(change.kind);
                }
            }
            FeedEvent::Resync => panic!("unexpected resync"),
        }
    }
    assert_eq!(seen, expected);
    assert_eq!(feed.cursor(), 5);

    // Pruned past the feed's cursor: the feed says to reload, then follows on.
    b.prune_changes(OffsetDateTime::now_utc() + time::Duration::minutes(1))
        .await
        .expect("prune");
    a.create_cluster(&new_cluster("d", "t"))
        .await
        .expect("create");
    let mut stale = ChangeFeed::subscribe(b.clone(), resync)
        .await
        .expect("subscribe");
    assert_eq!(stale.cursor(), 6);
    // A cursor in the pruned part cannot be made from outside; the page itself is checked in
    // change_log_pages_and_prunes. Here: the newest change still arrives after a prune.
    a.create_cluster(&new_cluster("e", "t"))
        .await
        .expect("create");
    let event = tokio::time::timeout(Duration::from_secs(10), stale.next())
        .await
        .expect("in time")
        .expect("feed");
    match event {
        FeedEvent::Changes(changes) => {
            assert_eq!(changes.len(), 1);
            assert_eq!(changes[0].cluster, "e");
        }
        FeedEvent::Resync => panic!("unexpected resync"),
    }
}

/// Waits (at most 10 s) until `feed` yields a change for `cluster`, and returns its kind.
async fn next_change_for(feed: &mut ChangeFeed, cluster: &str) -> ChangeKind {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let event = tokio::time::timeout_at(deadline, feed.next())
            .await
            .unwrap_or_else(|_| panic!("no change for {cluster} within 10 s"))
            .expect("feed");
        if let FeedEvent::Changes(changes) = event
            && let Some(change) = changes.iter().find(|c| c.cluster == cluster)
        {
            return change.kind;
        }
    }
}

/// The listening connection dies (on PostgreSQL: terminated by the server, as a failover or an idle-session
/// reaper would): a change made meanwhile still arrives, through the reconnection or the periodic re-read, and
/// later changes keep arriving.
async fn change_feed_survives_a_lost_listener(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    let mut feed = ChangeFeed::subscribe(b.clone(), Duration::from_millis(500))
        .await
        .expect("subscribe");
    // Let the feed start listening (its first call re-reads at once).
    let idle = tokio::time::timeout(Duration::from_millis(200), feed.next()).await;
    assert!(idle.is_err(), "no change yet: {idle:?}");
    if db.postgres {
        let admin = sqlx::PgPool::connect(&db.url).await.expect("connect");
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE query ILIKE 'LISTEN%' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&admin)
        .await
        .expect("terminate");
        assert_eq!(killed, 1, "the feed's listener session");
        admin.close().await;
    }
    a.create_cluster(&new_cluster("lost", "t"))
        .await
        .expect("create");
    assert_eq!(
        next_change_for(&mut feed, "lost").await,
        ChangeKind::Created
    );
    a.create_cluster(&new_cluster("after", "t"))
        .await
        .expect("create");
    assert_eq!(
        next_change_for(&mut feed, "after").await,
        ChangeKind::Created
    );
    assert!(
        feed.has_push(),
        "the listener reconnected instead of ending"
    );
}

fn lease(id: &str, ttl: Duration) -> ReplicaLease {
    ReplicaLease {
        id: id.into(),
        peer_address: Some(format!("{id}.example:9443")),
        ttl,
        draining: false,
    }
}

async fn live_ids(store: &dyn Store) -> Vec<String> {
    store
        .live_replicas()
        .await
        .expect("live replicas")
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// Waits (bounded) until `id` is no longer live: its lease lapsed.
async fn until_lapsed(store: &dyn Store, id: &str) {
    tether_testkit::wait::until("the lease to lapse", Duration::from_secs(20), || async {
        !live_ids(store).await.contains(&id.to_owned())
    })
    .await
    .expect("the lease lapses");
}

async fn replicas_hold_leases_that_lapse(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    a.register_replica(&lease("a", Duration::from_secs(60)))
        .await
        .expect("register a");
    b.register_replica(&lease("b", Duration::from_secs(60)))
        .await
        .expect("register b");
    assert_eq!(live_ids(a.as_ref()).await, ["a", "b"]);
    let replicas = b.live_replicas().await.expect("live");
    assert_eq!(replicas[0].peer_address.as_deref(), Some("a.example:9443"));
    assert!(replicas[0].lease_expires > replicas[0].started_at);
    assert!(!replicas[0].draining);

    // Draining is recorded with the renewal.
    let mut draining = lease("a", Duration::from_secs(60));
    draining.draining = true;
    assert!(a.renew_lease(&draining).await.expect("renew"));
    assert!(b.live_replicas().await.expect("live")[0].draining);

    // A replica that stops renewing is ignored once its lease lapses, then reaped (by anyone).
    let c = db.open().await;
    c.register_replica(&lease("c", Duration::from_millis(300)))
        .await
        .expect("register c");
    until_lapsed(a.as_ref(), "c").await;
    assert_eq!(b.reap_replicas(Duration::ZERO).await.expect("reap"), 1);
    assert!(
        !c.renew_lease(&lease("c", Duration::from_secs(60)))
            .await
            .expect("renew c"),
        "a reaped replica must register again"
    );
    c.register_replica(&lease("c", Duration::from_secs(60)))
        .await
        .expect("register c again");
    assert_eq!(live_ids(b.as_ref()).await, ["a", "b", "c"]);
    // Live leases are never reaped.
    assert_eq!(b.reap_replicas(Duration::ZERO).await.expect("reap"), 0);
    b.remove_replica("b").await.expect("remove b");
    assert_eq!(live_ids(a.as_ref()).await, ["a", "c"]);
}

fn tunnel(replica: &str, id: u64, cluster: &str) -> TunnelRecord {
    TunnelRecord {
        replica: replica.into(),
        tunnel_id: id,
        cluster: cluster.into(),
        agent_instance: String::new(),
        agent_tunnels: 0,
        transport: "wss".into(),
        agent_address: "10.0.0.7:51000".into(),
        connected_since: OffsetDateTime::from_unix_timestamp(1_800_000_000).expect("valid"),
        usable: true,
    }
}

async fn routes(store: &dyn Store, cluster: Option<&str>) -> Vec<(String, u64)> {
    store
        .tunnel_routes(cluster)
        .await
        .expect("routes")
        .into_iter()
        .map(|r| (r.tunnel.replica, r.tunnel.tunnel_id))
        .collect()
}

async fn tunnels_route_while_their_replica_lives(db: &Db) {
    let a = db.open().await;
    let b = db.open().await;
    for name in ["c1", "c2"] {
        a.create_cluster(&new_cluster(name, name))
            .await
            .expect("create");
    }
    a.register_replica(&lease("a", Duration::from_secs(60)))
        .await
        .expect("register a");
    b.register_replica(&lease("b", Duration::from_millis(300)))
        .await
        .expect("register b");
    a.put_tunnel(&tunnel("a", 1, "c1")).await.expect("put a/1");
    a.put_tunnel(&tunnel("a", 2, "c1")).await.expect("put a/2");
    a.put_tunnel(&tunnel("a", 3, "c2")).await.expect("put a/3");
    // b's lease may lapse any moment now: its tunnel is put as soon as it registered.
    let put_b = b.put_tunnel(&tunnel("b", 1, "c1")).await;
    assert!(put_b.is_ok(), "{put_b:?}");

    // What hello says, and GOAWAY, update the row.
    let mut said = tunnel("a", 1, "c1");
    said.agent_instance = "agent-7f3a".into();
    said.agent_tunnels = 2;
    a.put_tunnel(&said).await.expect("update a/1");
    let mut away = tunnel("a", 2, "c1");
    away.usable = false;
    a.put_tunnel(&away).await.expect("update a/2");
    let shown = b.tunnel_routes(Some("c1")).await.expect("routes");
    let a1 = shown
        .iter()
        .find(|r| r.tunnel.replica == "a" && r.tunnel.tunnel_id == 1)
        .expect("a/1 routed");
    assert_eq!(a1.tunnel, said);
    assert_eq!(a1.peer_address.as_deref(), Some("a.example:9443"));
    assert!(!a1.replica_draining);
    assert!(
        shown
            .iter()
            .any(|r| r.tunnel.tunnel_id == 2 && !r.tunnel.usable)
    );

    // b stops renewing: its tunnel routes nothing from the moment its lease lapses.
    until_lapsed(a.as_ref(), "b").await;
    assert_eq!(
        routes(a.as_ref(), Some("c1")).await,
        [("a".to_owned(), 1), ("a".to_owned(), 2)]
    );
    assert_eq!(routes(a.as_ref(), None).await.len(), 3);

    // A tunnel of a deleted cluster cannot be recorded; deleting a cluster drops its routes.
    assert!(matches!(
        a.put_tunnel(&tunnel("a", 4, "ghost")).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(a.delete_cluster("c2").await.expect("delete"));
    assert_eq!(routes(a.as_ref(), None).await.len(), 2);
    a.remove_tunnel("a", 2).await.expect("remove a/2");
    assert_eq!(routes(b.as_ref(), Some("c1")).await, [("a".to_owned(), 1)]);
    // A replica that restarts with the same id holds nothing from before; one that leaves takes its rows.
    a.register_replica(&lease("a", Duration::from_secs(60)))
        .await
        .expect("register a again");
    assert!(routes(b.as_ref(), None).await.is_empty());
    a.put_tunnel(&tunnel("a", 1, "c1")).await.expect("put a/1");
    a.remove_replica("a").await.expect("remove a");
    assert!(routes(b.as_ref(), None).await.is_empty());
}
