//! Gathering writes: a task that writes what other tasks hand it (a tunnel's driver, an HTTP/2 connection's
//! task) holds a batch's first write back until the runtime's worker has run every other task that is ready, so
//! what they hand it meanwhile leaves in the same write.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Holds the first write of a batch back until the runtime worker has run every other task that is ready
/// and polled for I/O once: streams woken together (responses read from one upstream read, requests from
/// users' connections that became readable together) then leave in one transport write, one TLS record and
/// one syscall, instead of one each. Tokio's `yield_now` defers a task's wake-up exactly that long (and no
/// longer than the worker's maintenance interval under load); the waker handed to it here records that the
/// wait is over before waking the driver, so that other wake-ups of the driver in between (more streams
/// writing) do not release the batch early.
///
/// Holding costs a trip through the scheduler (and the worker's I/O poll); with one request at a time there is
/// nothing to gather. So a hold during which nothing else woke the driver turns holding off for the next few
/// batches, twice as many after each such hold in a row up to [`Cork::REST`], and one that gathered something
/// resets that: a lone user pays for about one hold in seventeen batches, a busy tunnel keeps gathering.
pub struct Cork {
    release: Arc<CorkRelease>,
    /// `release` as a waker, made once.
    waker: Waker,
    /// A release is awaited.
    held: bool,
    /// The driver was polled again while held: other work arrived.
    busy: bool,
    /// Batches left to send without holding.
    rest: u8,
    /// Batches to send without holding after the next hold that gathers nothing.
    next_rest: u8,
}

struct CorkRelease {
    released: AtomicBool,
    driver: AtomicWaker,
}

impl Wake for CorkRelease {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.released.store(true, Ordering::Release);
        self.driver.wake();
    }
}

impl Cork {
    /// Batches sent without holding after a hold that gathered nothing.
    const REST: u8 = 16;

    /// A cork that holds the next batch.
    pub fn new() -> Self {
        let release = Arc::new(CorkRelease {
            released: AtomicBool::new(false),
            driver: AtomicWaker::new(),
        });
        Self {
            waker: Waker::from(release.clone()),
            release,
            held: false,
            busy: false,
            rest: 0,
            next_rest: 1,
        }
    }

    /// Called at the start of each of the driver's polls: one while held that the release did not cause means
    /// other work arrived.
    pub fn polled(&mut self) {
        self.busy |= self.held && !self.release.released.load(Ordering::Acquire);
    }

    /// True while a batch's first write should wait; the first call for a batch starts the wait.
    pub fn hold(&mut self, cx: &Context<'_>) -> bool {
        if self.held {
            if self.release.released.load(Ordering::Acquire) {
                self.held = false;
                if self.busy {
                    self.next_rest = 1;
                } else {
                    self.rest = self.next_rest;
                    self.next_rest = self.next_rest.saturating_mul(2).min(Self::REST);
                }
                return false;
            }
            return true;
        }
        if self.rest > 0 {
            self.rest -= 1;
            return false;
        }
        self.release.released.store(false, Ordering::Relaxed);
        self.release.driver.register(cx.waker());
        let mut yielded = std::pin::pin!(tokio::task::yield_now());
        // Pending: the runtime keeps `self.waker` and wakes it once the worker has nothing else to run.
        // Outside a runtime worker it is woken at once, which only costs a poll.
        let _ = yielded.as_mut().poll(&mut Context::from_waker(&self.waker));
        self.held = true;
        self.busy = false;
        true
    }
}

impl Default for Cork {
    fn default() -> Self {
        Self::new()
    }
}

/// An I/O stream whose writes are gathered by a [`Cork`]: the first write after a flush waits (returns
/// `Pending`) until the worker has run what else was ready, and the writer, polled again, then writes all it
/// has gathered. For a writer that buffers what it cannot write yet and writes it on its next poll, as `h2`'s
/// connection does: requests that tasks woken together hand an HTTP/2 connection leave in one TLS record and
/// one syscall. Tokio's LIFO slot otherwise runs the connection's task right after each request's task, so
/// each request leaves on its own.
pub struct Corked<T> {
    inner: T,
    cork: Cork,
    /// Written since the last flush: the batch is open and further writes go straight through.
    unflushed: bool,
}

impl<T> Corked<T> {
    /// Gathers the writes to `inner`.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            cork: Cork::new(),
            unflushed: false,
        }
    }

    /// Writes with `write` unless the batch's first write should wait; a write that went through opens the
    /// batch (until the next flush).
    fn write(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>>
    where
        T: Unpin,
    {
        self.cork.polled();
        if !self.unflushed && self.cork.hold(cx) {
            return Poll::Pending;
        }
        let written = std::task::ready!(write(Pin::new(&mut self.inner), cx))?;
        self.unflushed = true;
        Poll::Ready(Ok(written))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Corked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Corked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.write(cx, |inner, cx| inner.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.write(cx, |inner, cx| inner.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        self.unflushed = false;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Mutex;

    use tokio::sync::Notify;

    use super::*;

    /// Records the length of each write it is given.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<usize>>>);

    impl AsyncWrite for Sink {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.lock().unwrap().push(buf.len());
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// What tasks hand the writer, and the writer's waker: as `h2`'s streams and connection share them.
    #[derive(Default)]
    struct Queue {
        items: Vec<u8>,
        writer: Option<Waker>,
        done: bool,
    }

    /// A writer task as `h2`'s connection is one: it takes what was queued into its own buffer and writes
    /// that, keeping what a `Pending` write left for its next poll.
    async fn writer<W: AsyncWrite + Unpin>(queue: Arc<Mutex<Queue>>, mut io: W) {
        let mut buffered = Vec::new();
        std::future::poll_fn(|cx| {
            let done = {
                let mut q = queue.lock().unwrap();
                q.writer = Some(cx.waker().clone());
                buffered.append(&mut q.items);
                q.done
            };
            while !buffered.is_empty() {
                let n = std::task::ready!(Pin::new(&mut io).poll_write(cx, &buffered)).unwrap();
                buffered.drain(..n);
            }
            std::task::ready!(Pin::new(&mut io).poll_flush(cx)).unwrap();
            if done { Poll::Ready(()) } else { Poll::Pending }
        })
        .await;
    }

    /// Waits (at most 10 s) until `ready` holds.
    async fn until(ready: impl Fn() -> bool) {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while !ready() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the condition never held");
    }

    /// Eight tasks woken together each hand the writer one byte and wake it. On one worker, Tokio's LIFO slot
    /// runs the writer right after each of them; corked, it writes the eight bytes at once.
    async fn writes_of_eight_tasks_woken_together(corked: bool) -> Vec<usize> {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let sink = Sink::default();
        let task = if corked {
            tokio::spawn(writer(queue.clone(), Corked::new(sink.clone())))
        } else {
            tokio::spawn(writer(queue.clone(), sink.clone()))
        };
        let go = Arc::new(Notify::new());
        let parked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handing: Vec<_> = (0..8u8)
            .map(|i| {
                let (queue, go, parked) = (queue.clone(), go.clone(), parked.clone());
                tokio::spawn(async move {
                    let notified = go.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    parked.fetch_add(1, Ordering::SeqCst);
                    notified.await;
                    let mut q = queue.lock().unwrap();
                    q.items.push(i);
                    if let Some(w) = q.writer.take() {
                        w.wake();
                    }
                })
            })
            .collect();
        // Once the writer and the eight tasks wait, wake the eight from a task on the worker.
        until(|| parked.load(Ordering::SeqCst) == 8 && queue.lock().unwrap().writer.is_some())
            .await;
        tokio::spawn(async move { go.notify_waiters() })
            .await
            .unwrap();
        for t in handing {
            t.await.unwrap();
        }
        until(|| sink.0.lock().unwrap().iter().sum::<usize>() == 8).await;
        {
            let mut q = queue.lock().unwrap();
            q.done = true;
            if let Some(w) = q.writer.take() {
                w.wake();
            }
        }
        task.await.unwrap();
        let writes = sink.0.lock().unwrap().clone();
        assert_eq!(writes.iter().sum::<usize>(), 8, "every byte written once");
        writes
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn writes_handed_over_together_leave_in_one_write() {
        // Without the cork the writer runs after each task: the test's premise.
        assert!(writes_of_eight_tasks_woken_together(false).await.len() > 1);
        assert_eq!(writes_of_eight_tasks_woken_together(true).await, vec![8]);
    }
}
