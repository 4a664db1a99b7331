//! Prometheus metrics served at `GET /metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a decision: which webhook and what it answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `authenticate` or `authorize`.
    pub webhook: &'static str,
    /// `allowed`, `denied`, `no_opinion`, `authenticated`, `unauthenticated` or `error`.
    pub result: &'static str,
}

/// Labels of where an authorization decision came from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// `cache`, `evaluation` or `error`.
    pub source: &'static str,
}

/// Labels of a latency observation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabels {
    /// `authenticate` or `authorize`.
    pub webhook: &'static str,
}

/// Labels of a refused token.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// [`tether_auth::token::TokenError::label`].
    pub reason: &'static str,
}

/// Every metric guard exports.
pub struct Metrics {
    registry: Registry,
    /// Decisions by webhook and result.
    pub decisions: Family<DecisionLabels, Counter>,
    /// Authorization decisions by source.
    pub sources: Family<SourceLabels, Counter>,
    /// Refused tokens by reason.
    pub token_refusals: Family<RefusalLabels, Counter>,
    /// Webhook latency in seconds.
    pub latency: Family<WebhookLabels, Histogram, fn() -> Histogram>,
    /// The snapshot version in use.
    pub snapshot_version: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn latency_histogram() -> Histogram {
    // 50 µs … ~1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `tether_guard` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tether_guard");
        let decisions = Family::<DecisionLabels, Counter>::default();
        let sources = Family::<SourceLabels, Counter>::default();
        let token_refusals = Family::<RefusalLabels, Counter>::default();
        let latency = Family::<WebhookLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        let snapshot_version = Gauge::default();
        registry.register(
            "decisions",
            "Webhook decisions by webhook and result",
            decisions.clone(),
        );
        registry.register(
            "decision_sources",
            "Authorization decisions by source (cache, evaluation, error)",
            sources.clone(),
        );
        registry.register(
            "token_refusals",
            "Refused tokens by reason",
            token_refusals.clone(),
        );
        registry.register(
            "latency_seconds",
            "Time to answer a webhook request",
            latency.clone(),
        );
        registry.register(
            "snapshot_version",
            "Version of the RBAC snapshot in use",
            snapshot_version.clone(),
        );
        Self {
            registry,
            decisions,
            sources,
            token_refusals,
            latency,
            snapshot_version,
        }
    }

    /// Counts a decision.
    pub fn decision(&self, webhook: &'static str, result: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels { webhook, result })
            .inc();
    }

    /// Counts an authorization decision's source.
    pub fn source(&self, source: &'static str) {
        self.sources.get_or_create(&SourceLabels { source }).inc();
    }

    /// Records a webhook latency.
    pub fn observe(&self, webhook: &'static str, seconds: f64) {
        self.latency
            .get_or_create(&WebhookLabels { webhook })
            .observe(seconds);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
