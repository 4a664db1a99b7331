//! Waiting on a condition with a deadline — the one way tests wait (never a fixed sleep "to let things settle").

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often [`eventually`] checks again.
const POLL: Duration = Duration::from_millis(20);

/// The condition given to [`eventually`] did not hold in time.
#[derive(Debug, thiserror::Error)]
#[error("{what}: not met within {limit:?}")]
pub struct TimedOut {
    /// What was waited for, as the caller named it.
    pub what: String,
    /// How long was waited.
    pub limit: Duration,
}

/// Calls `check` until it returns `Some`, at most for `limit`; the value, or [`TimedOut`] naming `what`.
///
/// `check` is async so it may ask a server; a synchronous condition is `|| async { … }`. Follows Tokio's clock,
/// so it also works under `tokio::time::pause()`.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<T, TimedOut>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            return Err(TimedOut {
                what: what.to_owned(),
                limit,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a condition that is only true or false.
pub async fn until<F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<(), TimedOut>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually(what, limit, || {
        let fut = check();
        async move { fut.await.then_some(()) }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_value_once_the_condition_holds() {
        let mut calls = 0;
        let value = eventually("third call", Duration::from_secs(1), || {
            calls += 1;
            let now = calls;
            async move { (now == 3).then_some(now) }
        })
        .await;
        assert_eq!(value.ok(), Some(3));
    }

    #[tokio::test(start_paused = true)]
    async fn times_out_naming_what_was_awaited() {
        let err = until("never", Duration::from_millis(100), || async { false })
            .await
            .err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.starts_with("never: not met within"), "{text}");
    }
}
