//! The upstream grows with load (issue 17): against the sample apiserver, which advertises kube-apiserver's 100
//! concurrent streams per HTTP/2 connection, more watches than that are all answered and a short request still
//! answers while they are open; past the connection bound a request gets a 503 `Status` with `Retry-After`.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tether_agent::forward::{Upstream, serve_stream};
use tether_agent::pool::PoolOptions;
use tether_testkit::{SampleApiserver, SampleOptions};

const DEADLINE: Duration = Duration::from_secs(30);

/// One exchange on a tunnel-like stream; dropping it closes the stream, as a client going away does.
struct Exchange {
    response: http::Response<Incoming>,
    _conn: AbortOnDrop,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Exchange {
    fn status(&self) -> StatusCode {
        self.response.status()
    }
}

/// One request over a fresh tunnel-like stream, as the relay sends it, up to the response head.
async fn send(upstream: &Upstream, token: &str, path: &str) -> Result<Exchange> {
    let (relay_end, agent_end) = tokio::io::duplex(64 * 1024);
    tokio::spawn(serve_stream(agent_end, upstream.clone()));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(relay_end)).await?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = Request::get(path)
        .header("authorization", format!("Bearer {token}"))
        .body(Empty::<Bytes>::new())?;
    let response = tokio::time::timeout(DEADLINE, sender.send_request(req))
        .await
        .context("no response head in time")??;
    Ok(Exchange {
        response,
        _conn: AbortOnDrop(conn),
    })
}

async fn body(exchange: Exchange) -> Result<Bytes> {
    Ok(exchange.response.into_body().collect().await?.to_bytes())
}

async fn upstream(api: &SampleApiserver, pool: PoolOptions) -> Result<Upstream> {
    tether_runtime::tls::install_crypto_provider();
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(api.kubeconfig_path())?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    Ok(Upstream::from_kube_config_with(&config, None, pool)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_watches_than_one_connection_carries_are_all_answered() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let api = SampleApiserver::start(SampleOptions::new(dir.path())).await?;
    let upstream = upstream(&api, PoolOptions::default()).await?;
    let mut watches = Vec::new();
    for _ in 0..250 {
        let resp = send(
            &upstream,
            api.token(),
            "/api/v1/namespaces/default/configmaps?watch=1",
        )
        .await?;
        ensure!(resp.status() == StatusCode::OK, "{}", resp.status());
        watches.push(resp);
    }
    // A short request answers while all of them are open.
    let resp = send(&upstream, api.token(), "/api/v1/namespaces").await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = body(resp).await?;
    ensure!(String::from_utf8_lossy(&body).contains("NamespaceList"));
    drop(watches);
    Ok(())
}

#[tokio::test]
async fn past_the_connection_bound_a_request_gets_503_with_retry_after() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let api = SampleApiserver::start(SampleOptions::new(dir.path())).await?;
    let upstream = upstream(
        &api,
        PoolOptions {
            streams_per_connection: 2,
            max_connections: 2,
            queue_timeout: Duration::from_millis(200),
        },
    )
    .await?;
    let watch = "/api/v1/namespaces/default/configmaps?watch=1";
    // Long-running requests get one connection (the other is kept for short ones): two streams.
    let first = send(&upstream, api.token(), watch).await?;
    let second = send(&upstream, api.token(), watch).await?;
    assert_eq!(
        (first.status(), second.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    let shed = send(&upstream, api.token(), watch).await?;
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        shed.response
            .headers()
            .get("retry-after")
            .map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let status: serde_json::Value = serde_json::from_slice(&body(shed).await?)?;
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["code"], 503);
    // Short requests still have their connection.
    assert_eq!(
        send(&upstream, api.token(), "/api/v1/namespaces")
            .await?
            .status(),
        StatusCode::OK
    );
    // A watch whose client went away gives its stream back (the agent notices when the next event cannot be
    // written).
    drop(first);
    let give_up = tokio::time::Instant::now() + DEADLINE;
    for round in 0.. {
        api.create_configmaps("default", &format!("nudge-{round}-"), 1);
        if send(&upstream, api.token(), watch).await?.status() == StatusCode::OK {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < give_up,
            "the stream was never given back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(second);
    Ok(())
}
