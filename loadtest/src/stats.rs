//! Measurement primitives: latency histograms (HdrHistogram, microseconds), per-interval counters for
//! throughput over time, and their serializable summaries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Largest latency a histogram tracks (values above are clamped): 5 minutes, in microseconds.
const MAX_LATENCY_US: u64 = 300_000_000;

/// A latency histogram in microseconds, 3 significant figures. One per worker; merge them at the end.
#[derive(Debug, Clone)]
pub struct Latency {
    hist: Histogram<u64>,
}

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

impl Latency {
    /// An empty histogram.
    pub fn new() -> Self {
        // Constant bounds that hdrhistogram accepts (low 1 ≤ high/2, 3 significant figures ≤ 5).
        let hist = Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)
            .expect("constant histogram bounds are valid");
        Self { hist }
    }

    /// Records one duration (clamped to the tracked range).
    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros())
            .unwrap_or(u64::MAX)
            .clamp(1, MAX_LATENCY_US);
        self.hist.saturating_record(us);
    }

    /// Adds every value recorded in `other`.
    pub fn merge(&mut self, other: &Latency) {
        // Both histograms share the same bounds, so `add` cannot fail for range reasons.
        if self.hist.add(&other.hist).is_err() {
            for v in other.hist.iter_recorded() {
                self.hist
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The value at `quantile` (0..=1) in microseconds.
    pub fn quantile_us(&self, quantile: f64) -> u64 {
        self.hist.value_at_quantile(quantile)
    }

    /// Summary figures, or `None` when nothing was recorded.
    pub fn summary(&self) -> Option<LatencySummary> {
        if self.hist.is_empty() {
            return None;
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Some(LatencySummary {
            count: self.hist.len(),
            min_ms: ms(self.hist.min()),
            mean_ms: self.hist.mean() / 1000.0,
            p50_ms: ms(self.quantile_us(0.50)),
            p90_ms: ms(self.quantile_us(0.90)),
            p99_ms: ms(self.quantile_us(0.99)),
            p999_ms: ms(self.quantile_us(0.999)),
            max_ms: ms(self.hist.max()),
            curve: self.percentile_curve(),
        })
    }

    /// Points for a percentile plot: (nines, latency ms) where nines = -log10(1 - q), from q = 0 up to the
    /// last recorded value (at most 5 nines).
    fn percentile_curve(&self) -> Vec<(f64, f64)> {
        let mut out = Vec::new();
        let steps = 40;
        for i in 0..=steps * 5 / 2 {
            let nines = f64::from(i) / f64::from(steps) * 2.0;
            let q = 1.0 - 10f64.powf(-nines);
            if q > 1.0 - 1.0 / self.hist.len() as f64 && i > 0 {
                break;
            }
            out.push((nines, self.quantile_us(q) as f64 / 1000.0));
        }
        out
    }
}

/// Latency figures of one run, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub count: u64,
    /// Smallest.
    pub min_ms: f64,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest.
    pub max_ms: f64,
    /// Percentile curve for plotting: (nines, ms), nines = -log10(1 - quantile).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<(f64, f64)>,
}

/// Events counted per fixed interval since a start instant, shared by all workers of a run (lock-free).
#[derive(Debug)]
pub struct Timeline {
    start: Instant,
    interval: Duration,
    buckets: Vec<AtomicU64>,
}

impl Timeline {
    /// A timeline starting now with `interval` buckets covering at least `span` (later events go to the last
    /// bucket).
    pub fn new(interval: Duration, span: Duration) -> Self {
        Self::starting_at(Instant::now(), interval, span)
    }

    /// Like [`Timeline::new`] with an explicit start (e.g. the end of a warm-up).
    pub fn starting_at(start: Instant, interval: Duration, span: Duration) -> Self {
        let interval = interval.max(Duration::from_millis(1));
        let n = (span.as_secs_f64() / interval.as_secs_f64()).ceil() as usize + 1;
        Self {
            start,
            interval,
            buckets: (0..n.max(1)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// When the timeline started.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Adds `n` to the bucket of the current instant.
    pub fn add(&self, n: u64) {
        self.add_at(Instant::now(), n);
    }

    /// Adds `n` to the bucket of `at`.
    pub fn add_at(&self, at: Instant, n: u64) {
        let i = at.saturating_duration_since(self.start).as_nanos() / self.interval.as_nanos();
        let i = usize::try_from(i)
            .unwrap_or(usize::MAX)
            .min(self.buckets.len() - 1);
        self.buckets[i].fetch_add(n, Ordering::Relaxed);
    }

    /// Per-second rates of the first `upto` of the run (trailing partial bucket dropped), scaled by `scale`
    /// (e.g. 1e-6 for MB/s from bytes).
    pub fn rates(&self, upto: Duration, scale: f64) -> Vec<f64> {
        let n = usize::try_from(upto.as_nanos() / self.interval.as_nanos())
            .unwrap_or(usize::MAX)
            .min(self.buckets.len());
        let per_sec = 1.0 / self.interval.as_secs_f64();
        self.buckets[..n]
            .iter()
            .map(|b| b.load(Ordering::Relaxed) as f64 * per_sec * scale)
            .collect()
    }

    /// The bucket width.
    pub fn interval(&self) -> Duration {
        self.interval
    }
}

/// Peak and mean of the non-empty span of a rate series (from its first to its last non-zero bucket).
pub fn peak_and_mean(rates: &[f64]) -> Option<(f64, f64)> {
    let first = rates.iter().position(|r| *r > 0.0)?;
    let last = rates.iter().rposition(|r| *r > 0.0)?;
    let span = &rates[first..=last];
    let peak = span.iter().copied().fold(0.0, f64::max);
    let mean = span.iter().sum::<f64>() / span.len() as f64;
    Some((peak, mean))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_histograms_adds_counts_and_keeps_extremes() {
        let mut a = Latency::new();
        let mut b = Latency::new();
        for ms in 1..=50 {
            a.record(Duration::from_millis(ms));
        }
        for ms in 51..=100 {
            b.record(Duration::from_millis(ms));
        }
        a.merge(&b);
        let s = a.summary().expect("samples were recorded");
        assert_eq!(s.count, 100);
        assert!((s.min_ms - 1.0).abs() < 0.01, "{s:?}");
        assert!((s.max_ms - 100.0).abs() < 0.1, "{s:?}");
        assert!((s.p50_ms - 50.0).abs() < 0.1, "{s:?}");
        assert!((s.p99_ms - 99.0).abs() < 0.1, "{s:?}");
    }

    #[test]
    fn empty_histogram_has_no_summary_and_clamps_extremes() {
        let mut h = Latency::new();
        assert!(h.summary().is_none());
        h.record(Duration::ZERO);
        h.record(Duration::from_secs(10_000));
        let s = h.summary().expect("two samples");
        assert_eq!(s.count, 2);
        assert!(s.min_ms > 0.0);
        assert!(s.max_ms <= MAX_LATENCY_US as f64 / 1000.0 * 1.001);
    }

    #[test]
    fn percentile_curve_is_monotonic_and_bounded_by_sample_count() {
        let mut h = Latency::new();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us * 10));
        }
        let curve = h.summary().expect("samples").curve;
        assert!(curve.len() > 10);
        assert!(
            curve
                .windows(2)
                .all(|w| w[0].1 <= w[1].1 && w[0].0 < w[1].0)
        );
        // 1000 samples resolve three nines, not five.
        assert!(curve.last().is_some_and(|(n, _)| *n <= 3.0 + 1e-9));
    }

    #[test]
    fn timeline_buckets_and_rates() {
        let t = Timeline::new(Duration::from_millis(100), Duration::from_secs(1));
        let s = t.start();
        t.add_at(s, 5);
        t.add_at(s + Duration::from_millis(150), 10);
        t.add_at(s + Duration::from_secs(60), 1); // clamped into the last bucket
        let rates = t.rates(Duration::from_millis(300), 1.0);
        assert_eq!(rates, vec![50.0, 100.0, 0.0]);
    }

    #[test]
    fn peak_and_mean_ignore_leading_and_trailing_zeros() {
        assert_eq!(peak_and_mean(&[0.0, 0.0]), None);
        assert_eq!(
            peak_and_mean(&[0.0, 2.0, 4.0, 0.0, 6.0, 0.0]),
            Some((6.0, 3.0))
        );
    }
}
