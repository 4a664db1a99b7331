//! The client side of the peer link: hyper-util's pooled clients over mutual TLS ([`crate::peer_tls`]) to the
//! other replicas, one pool per replica id. HTTP/2 carries ordinary requests (a watch is one stream, so
//! thousands share a connection); HTTP/1.1 carries requests that upgrade (exec, attach, port-forward over
//! WebSocket or SPDY), each on its own connection.
//!
//! A replica is dialed by name, `ID.replica.tether.invalid`: the resolver maps the id to the address its
//! route in the store gave ([`PeerClient::learn`]), and TLS checks that the certificate names that id. The
//! request body is handed over in a [`PeerBody`], which gives it back untouched when the connection to the
//! peer failed before anything was sent, so that the caller can try another route.
//!
//! What it does not do: pick routes, or answer the user (`crate::peer_forward` does both).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::body::{Body, BoxError};
use crate::error::RelayError;
use crate::identity::REPLICA_NAME_SUFFIX;
use crate::peer_tls::{self, ReplicaIdentity};

/// How long connecting to a peer may take (TCP and TLS); past it the attempt failed and another route is
/// tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Replica id → the address its peer link is reached at.
type Addresses = Arc<Mutex<HashMap<String, String>>>;

/// Resolves `ID.replica.tether.invalid` to the address the store gave for replica ID.
#[derive(Clone)]
struct PeerResolver {
    addresses: Addresses,
}

impl tower::Service<Name> for PeerResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, std::io::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let address = name
            .as_str()
            .strip_suffix(REPLICA_NAME_SUFFIX)
            .and_then(|id| {
                self.addresses
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(id)
                    .cloned()
            });
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let address = address.ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("no peer address known for {name}"),
                )
            })?;
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host(address.as_str()).await?.collect();
            Ok(resolved.into_iter())
        })
    }
}

/// A connector whose whole connection (TCP and TLS) is bounded by [`CONNECT_TIMEOUT`].
#[derive(Clone)]
struct Timed<C> {
    inner: C,
}

impl<C> tower::Service<Uri> for Timed<C>
where
    C: tower::Service<Uri> + Send,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
                Ok(result) => result.map_err(Into::into),
                Err(_) => {
                    Err(format!("connecting to the peer took more than {CONNECT_TIMEOUT:?}").into())
                }
            }
        })
    }
}

type Connector = Timed<HttpsConnector<HttpConnector<PeerResolver>>>;

/// The pooled clients of the peer link.
pub(crate) struct PeerClient {
    h2: Client<Connector, PeerBody>,
    h1: Client<Connector, PeerBody>,
    addresses: Addresses,
}

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient").finish_non_exhaustive()
    }
}

fn connector(
    identity: &ReplicaIdentity,
    alpn: &[u8],
    addresses: &Addresses,
) -> Result<Connector, RelayError> {
    let mut http = HttpConnector::new_with_resolver(PeerResolver {
        addresses: addresses.clone(),
    });
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(identity.client_config()?)
        .https_only();
    let https = if alpn == b"h2" {
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.enable_http1().wrap_connector(http)
    };
    Ok(Timed { inner: https })
}

impl PeerClient {
    /// Clients presenting `identity`, with response heads of at most `max_header_bytes`.
    pub(crate) fn new(
        identity: &ReplicaIdentity,
        max_header_bytes: usize,
    ) -> Result<PeerClient, RelayError> {
        let addresses = Addresses::default();
        let h2 = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .http2_only(true)
            .http2_keep_alive_interval(Duration::from_secs(15))
            .http2_keep_alive_timeout(Duration::from_secs(10))
            .http2_keep_alive_while_idle(true)
            .http2_max_header_list_size(u32::try_from(max_header_bytes).unwrap_or(u32::MAX))
            .build(connector(identity, b"h2", &addresses)?);
        let h1 = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .http1_max_buf_size(max_header_bytes.max(8192))
            .build(connector(identity, b"http/1.1", &addresses)?);
        Ok(PeerClient { h2, h1, addresses })
    }

    /// Remembers where replica `id` is reached (from its route).
    pub(crate) fn learn(&self, id: &str, address: &str) {
        let mut addresses = self
            .addresses
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if addresses.get(id).map(String::as_str) != Some(address) {
            // Bounded by the replicas ever seen in this process's life; replicas come and go slowly.
            if addresses.len() > 4096 {
                addresses.clear();
            }
            addresses.insert(id.to_owned(), address.to_owned());
        }
    }

    /// The URI of `path_and_query` at replica `id`.
    pub(crate) fn uri(id: &str, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme("https")
            .authority(peer_tls::server_name(id))
            .path_and_query(path_and_query)
            .build()
    }

    /// Sends `req` (its URI from [`PeerClient::uri`]) over HTTP/1.1 when `upgrade`, else HTTP/2.
    pub(crate) async fn send(
        &self,
        req: Request<PeerBody>,
        upgrade: bool,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        if upgrade {
            self.h1.request(req).await
        } else {
            self.h2.request(req).await
        }
    }
}

/// A request body handed to one attempt at a peer: it takes the body from a shared slot when first polled,
/// so a body an attempt never polled (its connection failed first) is still in the slot for the next one.
pub(crate) struct PeerBody {
    slot: Arc<Mutex<Option<Body>>>,
    taken: Option<Body>,
}

impl PeerBody {
    /// A body for one attempt, drawing from `slot`.
    pub(crate) fn from_slot(slot: &Arc<Mutex<Option<Body>>>) -> PeerBody {
        PeerBody {
            slot: slot.clone(),
            taken: None,
        }
    }

    fn active(&mut self) -> Option<&mut Body> {
        if self.taken.is_none() {
            self.taken = self
                .slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
        }
        self.taken.as_mut()
    }
}

impl http_body::Body for PeerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.active() {
            Some(body) => Pin::new(body).poll_frame(cx),
            // Another attempt took it: nothing to send (cannot happen: attempts run one after another).
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.taken {
            Some(body) => body.is_end_stream(),
            None => self
                .slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .is_none_or(http_body::Body::is_end_stream),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.taken {
            Some(body) => body.size_hint(),
            None => self
                .slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .map(http_body::Body::size_hint)
                .unwrap_or_default(),
        }
    }
}
