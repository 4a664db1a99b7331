//! A user's cancellations cannot make the apiserver close the agent's shared upstream connection (issue 10): a
//! burst of watches, each cancelled right after it was sent (as the agent does when the relay resets a stream
//! whose user went away), runs against the sample apiserver's real HTTP/2 server (hyper's h2, which closes a
//! connection with GOAWAY "too_many_resets" after 20 resets of streams it has not taken up yet) while another
//! user's watch runs on the same upstream connection. That watch keeps receiving events.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tether_agent::forward::{Upstream, serve_stream};
use tether_agent::pool::PoolOptions;
use tether_testkit::{SampleApiserver, SampleOptions};

const DEADLINE: Duration = Duration::from_secs(30);
const WATCH: &str = "/api/v1/namespaces/default/configmaps?watch=1";

async fn upstream(api: &SampleApiserver) -> Result<Upstream> {
    tether_runtime::tls::install_crypto_provider();
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(api.kubeconfig_path())?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    // Room for every watch of the burst on one connection, so they share it with the user who holds a watch.
    let pool = PoolOptions {
        streams_per_connection: 1000,
        ..PoolOptions::default()
    };
    Ok(Upstream::from_kube_config_with(&config, None, pool)?)
}

/// Sends a watch on a fresh tunnel-like stream and cancels the stream's task as soon as the request left the
/// relay side, the way the agent cuts a stream the relay reset.
async fn open_and_cancel(upstream: Upstream, token: String) -> Result<()> {
    let (relay_end, agent_end) = tokio::io::duplex(64 * 1024);
    let serving = tokio::spawn(serve_stream(agent_end, upstream));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(relay_end)).await?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = Request::get(WATCH)
        .header("authorization", format!("Bearer {token}"))
        .body(Empty::<Bytes>::new())?;
    let pending = tokio::spawn(sender.send_request(req));
    tokio::task::yield_now().await;
    serving.abort();
    pending.abort();
    conn.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_requests_do_not_close_the_shared_upstream_connection() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let api = SampleApiserver::start(SampleOptions::new(dir.path())).await?;
    let upstream = upstream(&api).await?;

    // The other user's watch, on the connection the burst will use.
    let (relay_end, agent_end) = tokio::io::duplex(64 * 1024);
    tokio::spawn(serve_stream(agent_end, upstream.clone()));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(relay_end)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = Request::get(WATCH)
        .header("authorization", format!("Bearer {}", api.token()))
        .body(Empty::<Bytes>::new())?;
    let watch = tokio::time::timeout(DEADLINE, sender.send_request(req))
        .await
        .context("no watch head")??;
    ensure!(watch.status() == StatusCode::OK, "{}", watch.status());
    let mut watch = watch.into_body();

    // The burst: 48 users, 50 watches each, each cancelled right after it was sent.
    let mut burst = tokio::task::JoinSet::new();
    for _ in 0..48 {
        let (upstream, token) = (upstream.clone(), api.token().to_owned());
        burst.spawn(async move {
            for _ in 0..50 {
                open_and_cancel(upstream.clone(), token.clone()).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tokio::time::timeout(DEADLINE, burst.join_next())
        .await
        .context("the burst did not finish")?
    {
        done??;
    }

    // The watch still delivers: its connection was not closed under it.
    api.create_configmaps("default", "after-burst-", 1);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("after-burst-") {
        let frame = tokio::time::timeout_at(deadline, watch.frame())
            .await
            .context("no event on the other user's watch")?;
        match frame {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    seen.extend_from_slice(&data);
                }
            }
            Some(Err(e)) => anyhow::bail!("the other user's watch failed: {e}"),
            None => anyhow::bail!(
                "the other user's watch ended: the apiserver closed the shared connection"
            ),
        }
    }
    Ok(())
}
