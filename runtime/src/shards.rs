//! Shards: one single-threaded Tokio runtime per thread, so that work placed together stays on one thread.
//!
//! A multi-threaded runtime moves a task to whichever worker woke it and wakes idle workers to steal; a request
//! that a user's connection hands to a tunnel's driver and back changes threads twice, and docs/BENCHMARKS.md
//! measured that hand-off at about a fifth of the relay's CPU per small request. A shard is a thread that
//! runs only its own tasks: what is spawned there (a tunnel's driver, the connections placed with it, their
//! tasks) wakes and runs on that thread. [`crate::serve`] gives each connection the shard with the fewest TLS
//! handshakes in progress ([`Shards::least_busy`]), runs the handshake there when it has none, and moves the
//! connection at most once more, to the shard its first request names ([`Placement`]).
//!
//! Tasks spawned from inside a shard stay on it (`tokio::spawn` uses the current runtime); I/O and timers a
//! shard's tasks create belong to that shard's runtime. Dropping [`Shards`] stops every shard's runtime and
//! with it every task still on it; stop what runs there first.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

thread_local! {
    /// The index of the shard this thread runs, if it runs one.
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The index of the shard the calling thread runs (from inside its tasks), `None` elsewhere.
pub fn current() -> Option<usize> {
    CURRENT.with(Cell::get)
}

/// A set of shards (see the [module docs](self)).
#[derive(Debug)]
pub struct Shards {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    next: AtomicUsize,
    /// Per shard, how many are counted busy there ([`Shards::least_busy`]).
    busy: Arc<[AtomicUsize]>,
}

impl Shards {
    /// Starts `n` shards (at least one), their threads named `NAME-shard-I`.
    pub fn start(n: usize, name: &str) -> std::io::Result<Arc<Shards>> {
        let n = n.max(1);
        let mut shards = Shards {
            handles: Vec::with_capacity(n),
            stops: Vec::with_capacity(n),
            threads: Vec::with_capacity(n),
            next: AtomicUsize::new(0),
            busy: (0..n).map(|_| AtomicUsize::new(0)).collect(),
        };
        for index in 0..n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            shards.handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            shards.stops.push(stop);
            let thread = std::thread::Builder::new()
                .name(format!("{name}-shard-{index}"))
                .spawn(move || {
                    CURRENT.with(|c| c.set(Some(index)));
                    // Runs the shard's tasks until told to stop (or until `Shards` is dropped), then drops
                    // the runtime and whatever is still spawned on it.
                    let _ = runtime.block_on(stopped);
                    // Without waiting long for blocking work still running on its pool.
                    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
                })?;
            shards.threads.push(thread);
        }
        Ok(Arc::new(shards))
    }

    /// How many shards there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Always false: there is at least one shard.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The runtime of shard `index` (taken modulo [`Shards::len`]), to spawn on it.
    pub fn handle(&self, index: usize) -> &Handle {
        &self.handles[index % self.handles.len()]
    }

    /// The next shard in turn, for work that has no place of its own.
    pub fn next(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len()
    }

    /// The shard with the fewest connections counted busy there (ties go in turn), with one more counted until
    /// the returned [`Busy`] is dropped. [`crate::serve`] counts connections in their TLS handshake.
    pub fn least_busy(&self) -> Busy {
        let n = self.handles.len();
        let start = self.next();
        let index = (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&i| self.busy[i].load(Ordering::Relaxed))
            .unwrap_or(start);
        let ahead = self.busy[index].fetch_add(1, Ordering::Relaxed);
        Busy {
            index,
            ahead,
            busy: self.busy.clone(),
        }
    }
}

/// One connection counted busy on a shard ([`Shards::least_busy`]) until this is dropped.
#[derive(Debug)]
pub struct Busy {
    index: usize,
    ahead: usize,
    busy: Arc<[AtomicUsize]>,
}

impl Busy {
    /// The shard's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// How many were counted busy on the shard when this one was.
    pub fn ahead(&self) -> usize {
        self.ahead
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.busy[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Shards {
    fn drop(&mut self) {
        for stop in self.stops.drain(..) {
            let _ = stop.send(());
        }
        let me = std::thread::current().id();
        for thread in self.threads.drain(..) {
            // Dropped on one of its own shards (the last `Arc` went away there): that thread ends by itself.
            if thread.thread().id() != me {
                let _ = thread.join();
            }
        }
    }
}

/// Where a connection goes, from its first request's target (path and query, e.g. `/clusters/a/api`): the
/// index of a shard, or `None` for any (it stays on the shard it was given at accept).
pub type Placement = Arc<dyn Fn(&str) -> Option<usize> + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_spawned_on_a_shard_run_on_its_thread_and_stay_there() -> std::io::Result<()> {
        let shards = Shards::start(3, "test")?;
        assert_eq!(shards.len(), 3);
        assert_eq!(current(), None);
        for index in 0..3 {
            let (tx, rx) = std::sync::mpsc::channel();
            shards.handle(index).spawn(async move {
                let here = current();
                // A task spawned from there stays on the same shard.
                let inner = tokio::spawn(async { current() }).await.ok().flatten();
                let _ = tx.send((here, inner));
            });
            let got = rx
                .recv_timeout(std::time::Duration::from_secs(60))
                .map_err(std::io::Error::other)?;
            assert_eq!(got, (Some(index), Some(index)));
        }
        let turns: Vec<usize> = (0..4).map(|_| shards.next()).collect();
        assert_eq!(turns, [0, 1, 2, 0]);
        Ok(())
    }

    #[test]
    fn least_busy_takes_the_shard_with_the_fewest_counted_until_each_is_dropped()
    -> std::io::Result<()> {
        let shards = Shards::start(3, "test")?;
        // All idle: in turn.
        let a = shards.least_busy();
        let b = shards.least_busy();
        let c = shards.least_busy();
        assert_eq!((a.ahead(), b.ahead(), c.ahead()), (0, 0, 0));
        let mut taken = [a.index(), b.index(), c.index()];
        taken.sort_unstable();
        assert_eq!(taken, [0, 1, 2]);
        // One each busy; b's shard frees up and is the one taken next, however the turn stands.
        let freed = b.index();
        drop(b);
        for _ in 0..3 {
            let again = shards.least_busy();
            assert_eq!(again.index(), freed);
        }
        // Each shard has one again: the next is counted after it.
        let d = shards.least_busy();
        assert_eq!((d.index(), d.ahead()), (freed, 0));
        let e = shards.least_busy();
        assert_eq!(e.ahead(), 1);
        drop((a, c, d, e));
        // All dropped: nothing is counted anywhere.
        let f = shards.least_busy();
        assert_eq!(f.ahead(), 0);
        Ok(())
    }

    #[test]
    fn dropping_the_shards_stops_their_threads_and_tasks() -> std::io::Result<()> {
        let shards = Shards::start(2, "test")?;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        // A task that never ends holds the sender; once its runtime is dropped, the sender goes with it.
        shards.handle(1).spawn(async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(shards);
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(60)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        );
        Ok(())
    }
}
