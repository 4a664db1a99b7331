//! Results of one scenario run: the serializable [`Report`], its readable table, and the files written for it
//! (JSON, text table, SVG plots).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::plot;
use crate::stats::LatencySummary;

/// Everything one scenario measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Scenario name (`requests`, `bulk`, …).
    pub scenario: String,
    /// When the run started (RFC 3339, UTC).
    pub started_at: String,
    /// The machine it ran on.
    pub machine: Machine,
    /// The settings that shaped the run, as given or defaulted.
    pub settings: BTreeMap<String, String>,
    /// One entry per measured path or variant (tether, direct, rathole, "tether + stalled reader", …).
    pub runs: Vec<RunResult>,
    /// Scalar results (RSS per tunnel, CPU, connect rate, …).
    pub figures: Vec<Figure>,
    /// Ratios between runs (Tether/direct, Tether/rathole, Tether/haproxy, Tether/iperf3).
    pub ratios: Vec<Figure>,
    /// The targets, met or with the measured distance.
    pub targets: Vec<TargetCheck>,
    /// What a reader needs to know to interpret the figures (skipped peers, limits hit, …).
    pub notes: Vec<String>,
}

/// The machine a report was measured on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Logical CPUs.
    pub cpus: usize,
    /// CPU model name from /proc/cpuinfo.
    pub cpu_model: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Kernel release.
    pub kernel: String,
}

impl Machine {
    /// Reads the current machine's description from /proc (best effort: unknown fields stay empty).
    pub fn current() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_mib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb / 1024);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        Self {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            memory_mib,
            kernel,
        }
    }
}

/// One measured path or variant.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// What was measured ("tether", "direct", "rathole", "tether, 8 streams", …).
    pub label: String,
    /// Measured time in seconds (warm-up excluded).
    pub seconds: f64,
    /// Completed requests (or transfers, or connects).
    pub requests: u64,
    /// Failed requests.
    pub errors: u64,
    /// Response body bytes received.
    pub bytes: u64,
    /// Completed requests per second.
    pub requests_per_sec: f64,
    /// Body throughput in MB/s (10^6 bytes per second).
    pub mb_per_sec: f64,
    /// All latencies of the run.
    pub latency: Option<LatencySummary>,
    /// Latencies per request kind (get, list, watch, …).
    #[serde(default)]
    pub by_kind: BTreeMap<String, LatencySummary>,
    /// Width of a timeline bucket in milliseconds.
    pub timeline_interval_ms: u64,
    /// Unit of the timeline values ("req/s", "MB/s", "connects/s").
    pub timeline_unit: String,
    /// Rate per bucket over the run.
    #[serde(default)]
    pub timeline: Vec<f64>,
    /// The first few distinct errors.
    #[serde(default)]
    pub error_samples: Vec<String>,
}

/// A named number with its unit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// What it is.
    pub name: String,
    /// The value.
    pub value: f64,
    /// Its unit ("KiB", "×", "%", "connects/s", …).
    pub unit: String,
}

impl Figure {
    /// A figure.
    pub fn new(name: impl Into<String>, value: f64, unit: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value,
            unit: unit.into(),
        }
    }
}

/// One of the targets and how this run did against it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetCheck {
    /// The target, as the issue states it.
    pub target: String,
    /// The measured value, readable.
    pub measured: String,
    /// `Some(true)` met, `Some(false)` missed, `None` not measurable in this run.
    pub met: Option<bool>,
}

impl TargetCheck {
    /// A check of `measured` against "at least `goal`" (`higher_is_better`) or "at most `goal`".
    pub fn compare(
        target: impl Into<String>,
        measured: Option<f64>,
        goal: f64,
        higher_is_better: bool,
        unit: &str,
    ) -> Self {
        let target = target.into();
        match measured {
            Some(m) if m.is_finite() => {
                let met = if higher_is_better {
                    m >= goal
                } else {
                    m <= goal
                };
                let distance = if met {
                    String::new()
                } else if higher_is_better {
                    format!(" ({:.0} % short)", (1.0 - m / goal) * 100.0)
                } else {
                    format!(" ({:.0} % over)", (m / goal - 1.0) * 100.0)
                };
                Self {
                    target,
                    measured: format!("{}{unit}{distance}", fmt_num(m)),
                    met: Some(met),
                }
            }
            _ => Self {
                target,
                measured: "not measured".to_owned(),
                met: None,
            },
        }
    }
}

impl Report {
    /// An empty report for `scenario`, stamped with the current time and machine.
    pub fn new(scenario: &str) -> Self {
        let started_at = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        Self {
            scenario: scenario.to_owned(),
            started_at,
            machine: Machine::current(),
            ..Self::default()
        }
    }

    /// Records a setting.
    pub fn setting(&mut self, key: &str, value: impl ToString) {
        self.settings.insert(key.to_owned(), value.to_string());
    }

    /// The run with `label`, if any.
    pub fn run(&self, label: &str) -> Option<&RunResult> {
        self.runs.iter().find(|r| r.label == label)
    }

    /// Adds the ratio `a / b` of two runs' values (skipped when either is missing or `b` is zero) and
    /// returns it.
    pub fn ratio(&mut self, name: &str, a: Option<f64>, b: Option<f64>) -> Option<f64> {
        match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => {
                let r = a / b;
                self.ratios.push(Figure::new(name, r, "×"));
                Some(r)
            }
            _ => None,
        }
    }

    /// The readable table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "== {} ({}) ==", self.scenario, self.started_at);
        let _ = writeln!(
            out,
            "machine: {} CPUs, {}, {} MiB, Linux {}",
            self.machine.cpus, self.machine.cpu_model, self.machine.memory_mib, self.machine.kernel
        );
        if !self.settings.is_empty() {
            let settings: Vec<String> = self
                .settings
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let _ = writeln!(out, "settings: {}", settings.join(" "));
        }
        if !self.runs.is_empty() {
            let _ = writeln!(out);
            let width = self
                .runs
                .iter()
                .map(|r| r.label.chars().count())
                .max()
                .unwrap_or(4)
                .max(4);
            let _ = writeln!(
                out,
                "{:<width$} {:>9} {:>7} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8}",
                "path",
                "req/s",
                "errors",
                "MB/s",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms"
            );
            for r in &self.runs {
                let l = r.latency.as_ref();
                let cell =
                    |f: fn(&LatencySummary) -> f64| l.map_or("-".to_owned(), |l| fmt_num(f(l)));
                let _ = writeln!(
                    out,
                    "{:<width$} {:>9} {:>7} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8}",
                    r.label,
                    fmt_num(r.requests_per_sec),
                    r.errors,
                    fmt_num(r.mb_per_sec),
                    cell(|l| l.p50_ms),
                    cell(|l| l.p90_ms),
                    cell(|l| l.p99_ms),
                    cell(|l| l.p999_ms),
                    cell(|l| l.max_ms),
                );
            }
            for r in self.runs.iter().filter(|r| !r.error_samples.is_empty()) {
                let _ = writeln!(out, "  {} errors: {}", r.label, r.error_samples.join("; "));
            }
            let kinds: Vec<(&str, &str, &LatencySummary)> = self
                .runs
                .iter()
                .flat_map(|r| {
                    r.by_kind
                        .iter()
                        .map(|(k, s)| (r.label.as_str(), k.as_str(), s))
                })
                .collect();
            if !kinds.is_empty() {
                let _ = writeln!(out);
                let _ = writeln!(
                    out,
                    "{:<width$} {:<6} {:>8} {:>8} {:>8} {:>8}",
                    "path", "kind", "count", "p50 ms", "p99 ms", "max ms"
                );
                for (label, kind, s) in kinds {
                    let _ = writeln!(
                        out,
                        "{:<width$} {:<6} {:>8} {:>8} {:>8} {:>8}",
                        label,
                        kind,
                        s.count,
                        fmt_num(s.p50_ms),
                        fmt_num(s.p99_ms),
                        fmt_num(s.max_ms)
                    );
                }
            }
        }
        let named = |out: &mut String, title: &str, figures: &[Figure]| {
            if figures.is_empty() {
                return;
            }
            let _ = writeln!(out, "\n{title}:");
            let width = figures
                .iter()
                .map(|f| f.name.chars().count())
                .max()
                .unwrap_or(0);
            for f in figures {
                let _ = writeln!(
                    out,
                    "  {:<width$}  {}{}",
                    f.name,
                    fmt_num(f.value),
                    unit_suffix(&f.unit)
                );
            }
        };
        named(&mut out, "figures", &self.figures);
        named(&mut out, "ratios", &self.ratios);
        if !self.targets.is_empty() {
            let _ = writeln!(out, "\ntargets:");
            for t in &self.targets {
                let mark = match t.met {
                    Some(true) => "met   ",
                    Some(false) => "MISSED",
                    None => "n/a   ",
                };
                let _ = writeln!(out, "  [{mark}] {} — measured {}", t.target, t.measured);
            }
        }
        if !self.notes.is_empty() {
            let _ = writeln!(out, "\nnotes:");
            for n in &self.notes {
                let _ = writeln!(out, "  - {n}");
            }
        }
        out
    }

    /// Writes `SCENARIO.json`, `SCENARIO.txt` and the SVG plots into `dir` (created if needed); returns the
    /// paths written.
    pub fn write(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut written = Vec::new();
        let json = dir.join(format!("{}.json", self.scenario));
        std::fs::write(&json, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("cannot write {}", json.display()))?;
        written.push(json);
        let txt = dir.join(format!("{}.txt", self.scenario));
        std::fs::write(&txt, self.table())
            .with_context(|| format!("cannot write {}", txt.display()))?;
        written.push(txt);

        let latencies: Vec<(&str, &LatencySummary)> = self
            .runs
            .iter()
            .filter_map(|r| r.latency.as_ref().map(|l| (r.label.as_str(), l)))
            .filter(|(_, l)| !l.curve.is_empty())
            .collect();
        if !latencies.is_empty() {
            let svg = dir.join(format!("{}-latency.svg", self.scenario));
            plot::latency_svg(
                &svg,
                &format!("{}: latency by percentile", self.scenario),
                &latencies,
            )?;
            written.push(svg);
        }
        let timelines: Vec<plot::Timeline<'_>> = self
            .runs
            .iter()
            .filter(|r| !r.timeline.is_empty())
            .map(|r| plot::Timeline {
                label: &r.label,
                interval_ms: r.timeline_interval_ms,
                points: &r.timeline,
                unit: &r.timeline_unit,
            })
            .collect();
        if !timelines.is_empty() {
            let svg = dir.join(format!("{}-throughput.svg", self.scenario));
            plot::timeline_svg(
                &svg,
                &format!("{}: throughput over time", self.scenario),
                &timelines,
            )?;
            written.push(svg);
        }
        Ok(written)
    }
}

/// A number with a precision that suits its size.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn unit_suffix(unit: &str) -> String {
    match unit {
        "" => String::new(),
        "×" | "%" => unit.to_owned(),
        u => format!(" {u}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let mut r = Report::new("requests");
        r.setting("concurrency", 4);
        r.runs.push(RunResult {
            label: "tether".into(),
            seconds: 2.0,
            requests: 200,
            errors: 1,
            error_samples: vec!["1× HTTP 503".into()],
            requests_per_sec: 100.0,
            latency: Some(LatencySummary {
                count: 200,
                min_ms: 0.5,
                mean_ms: 1.0,
                p50_ms: 0.9,
                p90_ms: 1.5,
                p99_ms: 3.25,
                p999_ms: 4.0,
                max_ms: 5.0,
                curve: vec![(0.0, 0.5), (1.0, 1.5), (2.0, 3.25)],
            }),
            timeline_interval_ms: 100,
            timeline_unit: "req/s".into(),
            timeline: vec![90.0, 110.0],
            ..RunResult::default()
        });
        r.runs.push(RunResult {
            label: "direct".into(),
            requests_per_sec: 400.0,
            ..RunResult::default()
        });
        r
    }

    #[test]
    fn table_lists_runs_ratios_and_targets() {
        let mut r = sample();
        let ratio = r.ratio("requests tether/direct", Some(100.0), Some(400.0));
        assert_eq!(ratio, Some(0.25));
        assert_eq!(r.ratio("missing", Some(1.0), None), None);
        assert_eq!(r.ratio("zero", Some(1.0), Some(0.0)), None);
        r.targets
            .push(TargetCheck::compare("≥ 0.5× direct", ratio, 0.5, true, "×"));
        let t = r.table();
        assert!(t.contains("== requests"), "{t}");
        assert!(t.contains("tether"), "{t}");
        assert!(t.contains("3.25"), "{t}");
        assert!(t.contains("tether errors: 1× HTTP 503"), "{t}");
        assert!(t.contains("requests tether/direct  0.250×"), "{t}");
        assert!(
            t.contains("[MISSED] ≥ 0.5× direct — measured 0.250× (50 % short)"),
            "{t}"
        );
        assert_eq!(r.ratios.len(), 1);
    }

    #[test]
    fn target_checks_both_directions() {
        let met = TargetCheck::compare("rss", Some(60.0), 64.0, false, " KiB");
        assert_eq!(met.met, Some(true));
        assert_eq!(met.measured, "60.00 KiB");
        let over = TargetCheck::compare("rss", Some(96.0), 64.0, false, " KiB");
        assert_eq!(over.met, Some(false));
        assert_eq!(over.measured, "96.00 KiB (50 % over)");
        let none = TargetCheck::compare("rss", None, 64.0, false, " KiB");
        assert_eq!(none.met, None);
    }

    #[test]
    fn json_round_trips_and_files_are_written() -> anyhow::Result<()> {
        let r = sample();
        let back: Report = serde_json::from_str(&serde_json::to_string(&r)?)?;
        assert_eq!(back, r);
        let dir = tempfile::tempdir()?;
        let written = r.write(dir.path())?;
        let names: Vec<String> = written
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        assert_eq!(
            names,
            [
                "requests.json",
                "requests.txt",
                "requests-latency.svg",
                "requests-throughput.svg"
            ]
        );
        let svg = std::fs::read_to_string(dir.path().join("requests-latency.svg"))?;
        assert!(svg.starts_with("<svg") && svg.contains("tether"), "{svg}");
        Ok(())
    }

    #[test]
    fn numbers_are_formatted_by_magnitude() {
        assert_eq!(fmt_num(12345.6), "12346");
        assert_eq!(fmt_num(123.45), "123.5");
        assert_eq!(fmt_num(1.2345), "1.23");
        assert_eq!(fmt_num(0.01234), "0.012");
        assert_eq!(fmt_num(f64::NAN), "-");
    }
}
