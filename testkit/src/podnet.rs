//! The pod network of the sample cluster: loopback TCP servers that stand in for pod ports (an HTTP responder on
//! 80 and 8080, an echo server on every other port), for `kubectl port-forward`.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The loopback servers that answer for pod ports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PodNetwork {
    http: SocketAddr,
    echo: SocketAddr,
}

impl PodNetwork {
    /// Binds the HTTP responder and the echo server on 127.0.0.1 and serves them until `shutdown`.
    pub(crate) async fn start(
        shutdown: &CancellationToken,
        tracker: &TaskTracker,
    ) -> std::io::Result<PodNetwork> {
        let localhost = SocketAddr::from(([127, 0, 0, 1], 0));
        let http = TcpListener::bind(localhost).await?;
        let echo = TcpListener::bind(localhost).await?;
        let network = PodNetwork {
            http: http.local_addr()?,
            echo: echo.local_addr()?,
        };
        tracker.spawn(serve(http, shutdown.clone(), tracker.clone(), serve_http));
        tracker.spawn(serve(echo, shutdown.clone(), tracker.clone(), serve_echo));
        Ok(network)
    }

    /// Where the pod's `port` is answered.
    pub(crate) fn address(&self, port: u16) -> SocketAddr {
        match port {
            80 | 8080 => self.http,
            _ => self.echo,
        }
    }
}

async fn serve<F, Fut>(
    listener: TcpListener,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    handler: F,
) where
    F: Fn(TcpStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, _)) => {
                let shutdown = shutdown.clone();
                let conn = handler(tcp);
                tracker.spawn(async move {
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "pod network accept failed");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

/// Port 7 and friends: every byte comes back, and end-of-stream is echoed too.
async fn serve_echo(mut tcp: TcpStream) {
    let (mut r, mut w) = tcp.split();
    let _ = tokio::io::copy(&mut r, &mut w).await;
    let _ = w.shutdown().await;
}

/// Port 80: a tiny web server, one line of text naming the path.
async fn serve_http(tcp: TcpStream) {
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        let text = format!(
            "Hello from the Tether sample cluster: {} {}\n",
            req.method(),
            req.uri().path()
        );
        let mut response = Response::new(http_body_util::Full::new(Bytes::from(text)));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        Ok::<_, std::convert::Infallible>(response)
    });
    // Half-close: a client that sends its request and shuts down writing still gets the answer.
    let _ = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(tcp), service)
        .await;
}
