//! Group overage through the relay's directory: a [`GroupResolver`] that asks the relay over the control
//! channel (`resolveGroups` → `groups`, matched by `requestId`).
//!
//! The resolver lives as long as the agent; control channels come and go with tunnels, several at once when
//! the agent keeps several tunnels. Each channel attaches its outgoing queue once it is up and detaches when
//! it ends, which fails the questions still open on it (the answer could only come on that channel).
//! Questions go out on the newest channel attached. Answers are cached briefly per (tenant, user) so that a kubectl
//! session does not cost one round trip to the relay per request; failures are not cached.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tether_api::control::{Groups, Message, ResolveGroups};
use tether_auth::token::GroupResolver;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// How long the relay has to answer one `resolveGroups`.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a resolved group list is reused.
const CACHE_TTL: Duration = Duration::from_secs(30);
/// Most cached group lists (the cache is emptied of expired entries, then entirely, when full).
const CACHE_MAX_ENTRIES: usize = 4096;
/// Most questions queued for one control channel.
pub(crate) const QUEUE_LEN: usize = 256;

/// The relay's directory, reached through the control channels that are up.
#[derive(Debug)]
pub(crate) struct RelayDirectory {
    state: Mutex<State>,
    answer_timeout: Duration,
}

#[derive(Debug, Default)]
struct State {
    /// The control channels' queues and their generations, oldest first.
    channels: Vec<(u64, mpsc::Sender<Message>)>,
    generation: u64,
    next_request: u64,
    /// Open questions: request id → the generation of the channel it went out on, and who waits.
    pending: HashMap<u64, (u64, oneshot::Sender<Groups>)>,
    cache: HashMap<(String, String), (Instant, Vec<String>)>,
}

impl Default for RelayDirectory {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::default()),
            answer_timeout: ANSWER_TIMEOUT,
        }
    }
}

impl RelayDirectory {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Makes the channel that just came up a way to the relay (the one new questions take); returns its
    /// generation (for [`RelayDirectory::detach`]) and the queue of messages it must send.
    pub(crate) fn attach(&self) -> (u64, mpsc::Receiver<Message>) {
        let (tx, rx) = mpsc::channel(QUEUE_LEN);
        let mut state = self.lock();
        state.generation += 1;
        let generation = state.generation;
        state.channels.push((generation, tx));
        (generation, rx)
    }

    /// The channel of `generation` ended: its open questions fail (the others' stay open).
    pub(crate) fn detach(&self, generation: u64) {
        let mut state = self.lock();
        state.channels.retain(|(g, _)| *g != generation);
        state.pending.retain(|_, (g, _)| *g != generation);
    }

    /// Delivers the relay's answer to whoever asked.
    pub(crate) fn answer(&self, groups: Groups) {
        let waiter = self.lock().pending.remove(&groups.request_id);
        match waiter {
            Some((_, waiter)) => {
                let _ = waiter.send(groups);
            }
            None => tracing::debug!(
                request_id = groups.request_id,
                "ignoring a groups answer nobody waits for"
            ),
        }
    }

    async fn resolve(&self, tid: &str, oid: &str) -> Result<Vec<String>, String> {
        let key = (tid.to_owned(), oid.to_owned());
        let (request_id, answer) = {
            let mut state = self.lock();
            if let Some((at, groups)) = state.cache.get(&key)
                && at.elapsed() < CACHE_TTL
            {
                return Ok(groups.clone());
            }
            let Some((generation, channel)) = state.channels.last().cloned() else {
                return Err("the relay is not connected".to_owned());
            };
            state.next_request += 1;
            let request_id = state.next_request;
            let question = Message::ResolveGroups(ResolveGroups {
                request_id,
                tid: tid.to_owned(),
                oid: oid.to_owned(),
            });
            if channel.try_send(question).is_err() {
                return Err("too many group lookups are waiting for the relay".to_owned());
            }
            let (tx, rx) = oneshot::channel();
            state.pending.insert(request_id, (generation, tx));
            (request_id, rx)
        };
        let answer = match tokio::time::timeout(self.answer_timeout, answer).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => return Err("the connection to the relay was lost".to_owned()),
            Err(_) => {
                self.lock().pending.remove(&request_id);
                return Err(format!(
                    "the relay did not answer within {:?}",
                    self.answer_timeout
                ));
            }
        };
        match (answer.groups, answer.error) {
            (Some(groups), _) => {
                let mut state = self.lock();
                if state.cache.len() >= CACHE_MAX_ENTRIES {
                    state.cache.retain(|_, (at, _)| at.elapsed() < CACHE_TTL);
                    if state.cache.len() >= CACHE_MAX_ENTRIES {
                        state.cache.clear();
                    }
                }
                state.cache.insert(key, (Instant::now(), groups.clone()));
                Ok(groups)
            }
            (None, Some(error)) => Err(format!("the relay's directory says: {error}")),
            (None, None) => Err("the relay answered without groups".to_owned()),
        }
    }
}

impl GroupResolver for RelayDirectory {
    fn groups<'a>(
        &'a self,
        tid: &'a str,
        oid: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<String>, String>> + Send + 'a>> {
        Box::pin(self.resolve(tid, oid))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn question(message: Option<Message>) -> ResolveGroups {
        match message {
            Some(Message::ResolveGroups(q)) => q,
            other => panic!("expected resolveGroups, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn answers_are_matched_by_request_id_and_cached() {
        let dir = Arc::new(RelayDirectory::default());
        assert_eq!(
            dir.groups("t", "o").await,
            Err("the relay is not connected".to_owned())
        );
        let (_generation, mut queue) = dir.attach();
        let asking = tokio::spawn({
            let dir = dir.clone();
            async move { dir.groups("t", "o").await }
        });
        let q = question(queue.recv().await);
        assert_eq!((q.tid.as_str(), q.oid.as_str()), ("t", "o"));
        dir.answer(Groups {
            request_id: q.request_id + 100,
            groups: Some(vec!["wrong".into()]),
            error: None,
        });
        dir.answer(Groups {
            request_id: q.request_id,
            groups: Some(vec!["g1".into()]),
            error: None,
        });
        assert_eq!(asking.await.unwrap(), Ok(vec!["g1".to_owned()]));
        // Cached: no second question.
        assert_eq!(dir.groups("t", "o").await, Ok(vec!["g1".to_owned()]));
        assert!(queue.try_recv().is_err());

        let asking = tokio::spawn({
            let dir = dir.clone();
            async move { dir.groups("t", "unknown").await }
        });
        let q = question(queue.recv().await);
        dir.answer(Groups {
            request_id: q.request_id,
            groups: None,
            error: Some("unknown user".into()),
        });
        let refused = asking.await.unwrap().unwrap_err();
        assert!(refused.contains("unknown user"), "{refused}");
    }

    #[tokio::test]
    async fn a_lost_channel_fails_its_open_questions() {
        let dir = Arc::new(RelayDirectory::default());
        let (generation, mut queue) = dir.attach();
        let asking = tokio::spawn({
            let dir = dir.clone();
            async move { dir.groups("t", "o").await }
        });
        let _ = question(queue.recv().await);
        dir.detach(generation);
        assert_eq!(
            asking.await.unwrap(),
            Err("the connection to the relay was lost".to_owned())
        );
        // A stale detach does not undo a newer attach.
        let (_newer, _queue) = dir.attach();
        dir.detach(generation);
        assert_eq!(dir.lock().channels.len(), 1);
    }

    #[tokio::test]
    async fn with_two_channels_losing_one_fails_only_its_questions() {
        let dir = Arc::new(RelayDirectory::default());
        let (first, mut first_queue) = dir.attach();
        let asking_first = tokio::spawn({
            let dir = dir.clone();
            async move { dir.groups("t", "a").await }
        });
        let on_first = question(first_queue.recv().await);
        // A second tunnel comes up: new questions take it; the one open on the first stays open.
        let (second, mut second_queue) = dir.attach();
        let asking_second = tokio::spawn({
            let dir = dir.clone();
            async move { dir.groups("t", "b").await }
        });
        let on_second = question(second_queue.recv().await);
        dir.answer(Groups {
            request_id: on_first.request_id,
            groups: Some(vec!["ga".into()]),
            error: None,
        });
        assert_eq!(asking_first.await.unwrap(), Ok(vec!["ga".to_owned()]));
        // The first tunnel goes; the question on the second is still answered there.
        dir.detach(first);
        dir.answer(Groups {
            request_id: on_second.request_id,
            groups: Some(vec!["gb".into()]),
            error: None,
        });
        assert_eq!(asking_second.await.unwrap(), Ok(vec!["gb".to_owned()]));
        // And new questions still go out.
        let asking = tokio::spawn({
            let dir = dir.clone();
            async move { dir.groups("t", "c").await }
        });
        let q = question(second_queue.recv().await);
        assert_eq!(q.oid, "c");
        dir.detach(second);
        assert_eq!(
            asking.await.unwrap(),
            Err("the connection to the relay was lost".to_owned())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_question_times_out() {
        let dir = RelayDirectory::default();
        let (_generation, _queue) = dir.attach();
        let refused = dir.groups("t", "o").await.unwrap_err();
        assert!(refused.contains("did not answer"), "{refused}");
        assert!(dir.lock().pending.is_empty());
    }
}
