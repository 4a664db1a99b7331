//! Connectivity status and agent-upgrade availability, computed when read from persisted facts.
//!
//! ```text
//!  registered ──connect/heartbeat──▶ Connected ──nothing for offline_threshold──▶ Offline
//!  (Connecting)                          ▲                                          │
//!                                        └────────────── heartbeat ◀────────────────┘
//!  any state ──identity notAfter passes──▶ Expired   (recovery: delete the cluster, connect it again)
//! ```
//!
//! `Degraded` is `Connected` with fewer live tunnels across the fleet than an agent keeps (its `hello.tunnels`,
//! at most one per live replica): still reachable, one replica's loss away from not being so.

use std::time::Duration;

use time::OffsetDateTime;

/// Where a cluster stands, as `connectivityStatus` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectivityStatus {
    /// Registered, never heard from.
    Connecting,
    /// Heard from (tunnel connect or heartbeat) within the offline threshold.
    Connected,
    /// Connected, with fewer live tunnels than its agent keeps (still reachable).
    Degraded,
    /// Heard from once, not within the offline threshold.
    Offline,
    /// Its identity (client certificate) expired.
    Expired,
}

impl ConnectivityStatus {
    /// Every status, in the order they are documented.
    pub(crate) const ALL: [ConnectivityStatus; 5] = [
        ConnectivityStatus::Connecting,
        ConnectivityStatus::Connected,
        ConnectivityStatus::Degraded,
        ConnectivityStatus::Offline,
        ConnectivityStatus::Expired,
    ];

    /// The name used in the API.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ConnectivityStatus::Connecting => "Connecting",
            ConnectivityStatus::Connected => "Connected",
            ConnectivityStatus::Degraded => "Degraded",
            ConnectivityStatus::Offline => "Offline",
            ConnectivityStatus::Expired => "Expired",
        }
    }

    /// Parses an API name, ignoring ASCII case.
    pub(crate) fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|status| status.as_str().eq_ignore_ascii_case(s))
    }
}

/// The status at `now` of a cluster whose identity expires at `identity_not_after` (`None` before
/// onboarding) and that was last heard from at `last_seen`.
pub(crate) fn connectivity_status(
    identity_not_after: Option<OffsetDateTime>,
    last_seen: Option<OffsetDateTime>,
    now: OffsetDateTime,
    offline_threshold: Duration,
) -> ConnectivityStatus {
    if identity_not_after.is_some_and(|t| t <= now) {
        return ConnectivityStatus::Expired;
    }
    match last_seen {
        None => ConnectivityStatus::Connecting,
        Some(seen) if now - seen <= offline_threshold => ConnectivityStatus::Connected,
        Some(_) => ConnectivityStatus::Offline,
    }
}

/// One live tunnel as the fleet status counts it: the agent process holding it (empty when it did not say),
/// how many tunnels that process keeps (`hello.tunnels`, 0 when not said), and whether it still takes new
/// requests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveTunnel<'a> {
    pub(crate) instance: &'a str,
    pub(crate) keeps: u32,
    pub(crate) usable: bool,
}

/// `Connected` becomes `Degraded` when an agent process holds fewer usable tunnels than it keeps, counting
/// at most one per live replica (an agent keeping 2 tunnels to a fleet of 1 holds 1 and is not degraded).
/// Any other status stays as it is.
pub(crate) fn with_tunnels(
    status: ConnectivityStatus,
    tunnels: &[LiveTunnel<'_>],
    live_replicas: u32,
) -> ConnectivityStatus {
    if status != ConnectivityStatus::Connected || tunnels.is_empty() {
        return status;
    }
    let mut by_instance: std::collections::BTreeMap<&str, (u32, u32)> = Default::default();
    for t in tunnels {
        let entry = by_instance.entry(t.instance).or_default();
        entry.0 = entry.0.max(t.keeps.max(1));
        entry.1 += u32::from(t.usable);
    }
    let degraded = by_instance
        .values()
        .any(|(keeps, usable)| *usable < (*keeps).min(live_replicas.max(1)));
    if degraded {
        ConnectivityStatus::Degraded
    } else {
        status
    }
}

fn parse_version(v: &str) -> Option<semver::Version> {
    semver::Version::parse(v.trim().trim_start_matches('v')).ok()
}

/// True when `agent` is a semantic version older than `latest`. Unknown or unparsable versions never claim an
/// upgrade.
pub(crate) fn upgrade_available(agent: Option<&str>, latest: &str) -> bool {
    match (agent.and_then(parse_version), parse_version(latest)) {
        (Some(agent), Some(latest)) => agent < latest,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000 + secs)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH)
    }

    #[test]
    fn transitions_in_virtual_time() {
        let threshold = Duration::from_secs(900);
        let expiry = Some(at(10_000));
        use ConnectivityStatus::*;
        assert_eq!(
            connectivity_status(None, None, at(0), threshold),
            Connecting
        );
        assert_eq!(
            connectivity_status(expiry, None, at(0), threshold),
            Connecting
        );
        assert_eq!(
            connectivity_status(expiry, Some(at(0)), at(0), threshold),
            Connected
        );
        assert_eq!(
            connectivity_status(expiry, Some(at(0)), at(900), threshold),
            Connected
        );
        assert_eq!(
            connectivity_status(expiry, Some(at(0)), at(901), threshold),
            Offline
        );
        assert_eq!(
            connectivity_status(expiry, Some(at(950)), at(1000), threshold),
            Connected
        );
        // Expiry wins over everything, the moment notAfter is reached.
        assert_eq!(
            connectivity_status(expiry, Some(at(9_999)), at(9_999), threshold),
            Connected
        );
        assert_eq!(
            connectivity_status(expiry, Some(at(9_999)), at(10_000), threshold),
            Expired
        );
        assert_eq!(
            connectivity_status(expiry, None, at(20_000), threshold),
            Expired
        );
        // A clock that went backwards does not make a cluster Offline.
        assert_eq!(
            connectivity_status(expiry, Some(at(100)), at(50), threshold),
            Connected
        );
    }

    #[test]
    fn degraded_is_connected_with_fewer_tunnels_than_the_agent_keeps() {
        use ConnectivityStatus::*;
        let t = |instance, keeps, usable| LiveTunnel {
            instance,
            keeps,
            usable,
        };
        // An agent keeping 2 tunnels, both up over 3 replicas: Connected.
        assert_eq!(
            with_tunnels(Connected, &[t("a", 2, true), t("a", 2, true)], 3),
            Connected
        );
        // One lost: Degraded (still reachable).
        assert_eq!(with_tunnels(Connected, &[t("a", 2, true)], 3), Degraded);
        // A tunnel that is moving (GOAWAY) does not count.
        assert_eq!(
            with_tunnels(Connected, &[t("a", 2, true), t("a", 2, false)], 3),
            Degraded
        );
        // One replica only: one tunnel is all the agent can keep.
        assert_eq!(with_tunnels(Connected, &[t("a", 2, true)], 1), Connected);
        // Older agents say nothing (K read as 1).
        assert_eq!(with_tunnels(Connected, &[t("", 0, true)], 3), Connected);
        // Two agent replicas sharing an identity, each counted on its own.
        assert_eq!(
            with_tunnels(
                Connected,
                &[t("a", 2, true), t("a", 2, true), t("b", 2, true)],
                2
            ),
            Degraded
        );
        // Other statuses are left alone.
        assert_eq!(with_tunnels(Offline, &[t("a", 2, true)], 3), Offline);
        assert_eq!(with_tunnels(Connected, &[], 3), Connected);
    }

    #[test]
    fn status_names() {
        for s in ConnectivityStatus::ALL {
            assert_eq!(ConnectivityStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(
            ConnectivityStatus::parse("offline"),
            Some(ConnectivityStatus::Offline)
        );
        assert_eq!(ConnectivityStatus::parse("Gone"), None);
    }

    #[test]
    fn upgrades_by_semver() {
        assert!(upgrade_available(Some("0.1.0"), "0.2.0"));
        assert!(
            upgrade_available(Some("v0.9.0"), "0.10.0"),
            "not a string comparison"
        );
        assert!(upgrade_available(Some("1.0.0-rc.1"), "1.0.0"));
        assert!(!upgrade_available(Some("0.2.0"), "0.2.0"));
        assert!(!upgrade_available(Some("0.3.0"), "0.2.0"));
        assert!(!upgrade_available(None, "0.2.0"));
        assert!(!upgrade_available(Some("unknown"), "0.2.0"));
    }
}
