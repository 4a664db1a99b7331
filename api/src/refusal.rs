//! A relay's refusal of a QUIC tunnel. Over WebSocket the relay refuses the upgrade with an HTTP status and a
//! Kubernetes `Status` body; over QUIC there is no HTTP answer, so the relay closes the connection with that same
//! `Status` as the close reason. Agents (and the load generator's simulated agents) read the status back from it
//! to tell a refused identity, after which they stop dialling, from a relay that is only busy or starting.

/// The HTTP status in a QUIC refusal's `reason`: the `code` of the Kubernetes `Status` the relay sent. `None` when
/// the reason is not such a `Status` or its code is no HTTP status.
pub fn status_code(reason: &str) -> Option<u16> {
    let status: serde_json::Value = serde_json::from_str(reason).ok()?;
    let code = u16::try_from(status.get("code")?.as_u64()?).ok()?;
    (100..=999).contains(&code).then_some(code)
}

#[cfg(test)]
mod tests {
    use super::status_code;

    #[test]
    fn reads_the_code_of_the_relays_status_and_nothing_else() {
        let refused = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}"#;
        assert_eq!(status_code(refused), Some(403));
        for bad in [
            "",
            "relay shutting down",
            r#"{"kind":"Status"}"#,
            r#"{"code":"403"}"#,
            r#"{"code":70000}"#,
            r#"{"code":42}"#,
            r#"[403]"#,
        ] {
            assert_eq!(status_code(bad), None, "{bad:?}");
        }
    }
}
