//! The state every connection and request shares ([`Shared`]) and the request limits. It imports no handler:
//! the listener, the router and the handlers all depend on it, never the other way round.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::Authenticator;
use crate::authz::Authorizer;
use crate::store::Store;

/// Largest request body accepted (413 beyond).
pub(crate) const MAX_BODY: usize = 3 * 1024 * 1024;
/// How long a client has to send a request body.
pub(crate) const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// State shared by every connection and request.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) authn: Authenticator,
    pub(crate) authz: Authorizer,
    pub(crate) requests: AtomicU64,
    /// Requests refused for a missing or unknown bearer token.
    pub(crate) unauthenticated: AtomicU64,
    /// Requests per User-Agent product (the part before the first `/`), bounded.
    pub(crate) user_agents: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    /// The listen address, for discovery's `serverAddressByClientCIDRs`.
    pub(crate) addr: SocketAddr,
    /// When the server started: the demo pod's log ticks count from here.
    pub(crate) started: Instant,
    pub(crate) started_wall: time::OffsetDateTime,
    /// The uid of the seeded `default/demo` pod, whose log ticks every second.
    pub(crate) demo_uid: String,
    /// The loopback servers that answer for pod ports (port-forward).
    pub(crate) pod_network: crate::podnet::PodNetwork,
    /// Where each pod's scratch filesystem lives (`DIR/pods`), for `kubectl cp`.
    pub(crate) pods_dir: std::path::PathBuf,
    /// Cancelled on shutdown: every connection, watch, log stream and exec session ends.
    pub(crate) shutdown: CancellationToken,
    /// Tracks every background task (connections, exec sessions, streams) so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
}

impl Shared {
    /// A store seeded with the namespaces `default`, `kube-system`, `kube-public`, the node and the demo pod.
    pub(crate) fn new(
        addr: SocketAddr,
        shutdown: CancellationToken,
        tracker: TaskTracker,
        authn: Authenticator,
        authz: Authorizer,
        pod_network: crate::podnet::PodNetwork,
        pods_dir: std::path::PathBuf,
    ) -> Shared {
        let store = Store::new();
        for ns in ["default", "kube-system", "kube-public"] {
            let obj = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            if let Err(e) =
                crate::objects::create_object(&store, crate::resources::Resource::Namespaces, obj)
            {
                tracing::error!(ns, error = %e.message, "cannot seed namespace");
            }
        }
        let seeded = [
            (
                crate::resources::Resource::Nodes,
                crate::resources::sample_node(),
            ),
            (
                crate::resources::Resource::Pods,
                crate::resources::demo_pod(),
            ),
            (
                crate::resources::Resource::Services,
                crate::resources::kubernetes_service(),
            ),
            (
                crate::resources::Resource::Services,
                crate::resources::demo_service(),
            ),
            (
                crate::resources::Resource::Secrets,
                crate::resources::demo_secret(),
            ),
        ];
        let mut demo_uid = String::new();
        for (resource, obj) in seeded {
            match crate::objects::create_object(&store, resource, obj) {
                Ok(created) if resource == crate::resources::Resource::Pods => {
                    demo_uid = created["metadata"]["uid"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e.message, "cannot seed object"),
            }
        }
        Shared {
            store,
            authn,
            authz,
            requests: AtomicU64::new(0),
            unauthenticated: AtomicU64::new(0),
            user_agents: std::sync::Mutex::new(std::collections::HashMap::new()),
            addr,
            started: Instant::now(),
            started_wall: time::OffsetDateTime::now_utc(),
            demo_uid,
            pod_network,
            pods_dir,
            shutdown,
            tracker,
        }
    }
}
