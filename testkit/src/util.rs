//! Small helpers: ids, timestamps, durations the way kubectl prints them, query strings.

use std::time::Duration;

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A random RFC 4122 version 4 UUID, as Kubernetes uses for `metadata.uid`.
pub(crate) fn uid() -> String {
    uuid_v4(rand::random())
}

/// `b` as an RFC 4122 version 4 UUID (version and variant bits set).
pub(crate) fn uuid_v4(mut b: [u8; 16]) -> String {
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A random token of 32 hex characters.
pub(crate) fn random_token() -> String {
    hex(&rand::random::<[u8; 16]>())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Five characters from the alphabet Kubernetes uses for `generateName` suffixes.
pub(crate) fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// `t` as RFC 3339 with second precision (`metav1.Time`).
pub(crate) fn timestamp(t: OffsetDateTime) -> String {
    let t = t
        .replace_nanosecond(0)
        .unwrap_or(t)
        .to_offset(time::UtcOffset::UTC);
    t.format(&Rfc3339).unwrap_or_default()
}

/// `t` as RFC 3339 with nanoseconds (`time.RFC3339Nano`, as in log timestamps).
pub(crate) fn timestamp_nanos(t: OffsetDateTime) -> String {
    t.to_offset(time::UtcOffset::UTC)
        .format(&Rfc3339)
        .unwrap_or_default()
}

/// Parses an RFC 3339 timestamp.
pub(crate) fn parse_timestamp(s: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(s, &Rfc3339).ok()
}

/// A duration the way kube-apiserver's tables print ages (`duration.HumanDuration`).
pub(crate) fn human_duration(d: Duration) -> String {
    let seconds = d.as_secs();
    if seconds < 120 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        let s = seconds % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = minutes / 60;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{h}h", hours / 24)
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        let days = (hours / 24) % 365;
        return if days == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{days}d", hours / 24 / 365)
        };
    }
    format!("{}y", hours / 24 / 365)
}

/// The age of an object whose creation timestamp is `created` (RFC 3339), as a table cell.
pub(crate) fn age(created: Option<&str>) -> String {
    let Some(created) = created.and_then(parse_timestamp) else {
        return "<unknown>".into();
    };
    let elapsed = OffsetDateTime::now_utc() - created;
    if elapsed.whole_seconds() < -1 {
        return "<invalid>".into();
    }
    human_duration(Duration::from_secs(
        u64::try_from(elapsed.whole_seconds()).unwrap_or(0),
    ))
}

/// A Go `time.ParseDuration` string, as kube-apiserver's flags and configuration files take them: one or more
/// decimal numbers (fractions allowed) each with a unit `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`, e.g. `1h2m3s`,
/// `1.5h`, `300ms`; or `0`. None for anything else, negative durations included.
///
/// Hand-written (20 lines) because no kept crate parses exactly Go's syntax: humantime rejects fractions (`1.5h`)
/// and accepts what Go refuses (`1d`, `2 min`, spaces), and the Go-syntax crates are neither kept nor in our tree.
pub(crate) fn go_duration(text: &str) -> Option<Duration> {
    if text == "0" {
        return Some(Duration::ZERO);
    }
    let mut rest = text;
    let mut seconds = 0f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..number_end];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return None;
        }
        let value: f64 = number.parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        seconds += value * scale;
        rest = &rest[unit_end..];
    }
    if text.is_empty() {
        return None;
    }
    Duration::try_from_secs_f64(seconds).ok()
}

/// Decoded `key=value` pairs of a query string, in order, repeated keys kept.
pub(crate) fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    url::form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations_match_kubectl() {
        let cases = [
            (0, "0s"),
            (119, "119s"),
            (120, "2m"),
            (125, "2m5s"),
            (600, "10m"),
            (3 * 3600, "3h"),
            (3 * 3600 + 60, "3h1m"),
            (30 * 3600, "30h"),
            (3 * 86400 + 3600, "3d1h"),
            (100 * 86400, "100d"),
            (3 * 365 * 86400, "3y"),
        ];
        for (secs, want) in cases {
            assert_eq!(human_duration(Duration::from_secs(secs)), want, "{secs}s");
        }
    }

    #[test]
    fn uids_look_like_v4_uuids() {
        let u = uid();
        assert_eq!(u.len(), 36);
        assert_eq!(u.as_bytes()[14], b'4');
        assert_ne!(u, uid());
    }

    #[test]
    fn timestamps_round_trip() {
        let now = OffsetDateTime::now_utc();
        let text = timestamp(now);
        assert!(text.ends_with('Z') && !text.contains('.'), "{text}");
        assert_eq!(
            parse_timestamp(&text).map(|t| t.unix_timestamp()),
            Some(now.unix_timestamp())
        );
        assert_eq!(age(Some(&text)), "0s");
        assert_eq!(age(None), "<unknown>");
    }

    #[test]
    fn go_durations_parse_like_go() {
        let ok = [
            ("0", Duration::ZERO),
            ("2s", Duration::from_secs(2)),
            ("1m30s", Duration::from_secs(90)),
            ("1h2m3s", Duration::from_secs(3723)),
            ("1.5h", Duration::from_secs(5400)),
            ("2h45m", Duration::from_secs(9900)),
            ("300ms", Duration::from_millis(300)),
            (".5s", Duration::from_millis(500)),
            ("1µs", Duration::from_micros(1)),
            ("10us", Duration::from_micros(10)),
            ("100ns", Duration::from_nanos(100)),
        ];
        for (text, want) in ok {
            let got = go_duration(text);
            assert!(
                got.is_some_and(|d| d.abs_diff(want) < Duration::from_nanos(2)),
                "{text}: {got:?}"
            );
        }
        for bad in [
            "", "1", "s", ".s", "1d", "2 min", " 2s", "2s ", "-1s", "+1s", "1..5s", "1.2.3s", "1sm",
        ] {
            assert_eq!(go_duration(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn query_pairs_keep_repeats() {
        let pairs = query_pairs(Some("command=sh&command=-c&command=exit%203&tty=false"));
        assert_eq!(pairs.len(), 4);
        assert_eq!(pairs[2], ("command".to_string(), "exit 3".to_string()));
    }
}
