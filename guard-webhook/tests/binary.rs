//! The `tether-guard` binary validates its configuration before binding and exits 64 when it is unusable.

use std::process::Command;

use tether_testkit::certs::{Ca, write_pem};

fn run(args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_tether-guard"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn bad_configuration_exits_64_with_a_reason() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ca = Ca::new("ca")?;
    let server = ca.issue_server(&["127.0.0.1".to_owned()])?;
    let p = |name: &str| dir.path().join(name).display().to_string();
    write_pem(dir.path().join("cert.pem").as_path(), &server.cert_pem)?;
    write_pem(dir.path().join("key.pem").as_path(), &server.key_pem)?;
    write_pem(dir.path().join("ca.pem").as_path(), ca.cert_pem())?;
    let base = [
        "--listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--tls-cert".to_owned(),
        p("cert.pem"),
        "--tls-key".to_owned(),
        p("key.pem"),
        "--client-ca".to_owned(),
        p("ca.pem"),
        "--snapshot-file".to_owned(),
        p("snapshot.json"),
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter()
            .cloned()
            .chain(extra.iter().map(|s| (*s).to_owned()))
            .collect()
    };

    let (code, err) = run(&[])?;
    assert_eq!(code, Some(64), "{err}");

    let args = with(&["--tenant", "t1"]);
    let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("audience"), "{err}");

    let args = with(&[
        "--tenant",
        "t1",
        "--audience",
        "api://x",
        "--leeway-seconds",
        "300",
    ]);
    let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("leeway"), "{err}");

    let args = with(&[
        "--tenant",
        "t1",
        "--audience",
        "api://x",
        "--algorithm",
        "HS256",
    ]);
    let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("HS256"), "{err}");

    for (flag, value, mentions) in [
        ("--client-cn", "", "client-cn"),
        ("--groups-prefix", "system:", "system:"),
        ("--username-prefix", "System:x", "system:"),
    ] {
        let args = with(&[flag, value]);
        let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        assert_eq!(code, Some(64), "{flag} {value:?}: {err}");
        assert!(err.contains(mentions), "{err}");
    }

    // The agent's push certificate needs a CA of its own, and a pinned subject.
    let push_ca = Ca::new("push ca")?;
    write_pem(dir.path().join("push-ca.pem").as_path(), push_ca.cert_pem())?;
    for (extra, mentions) in [
        (
            vec![
                "--snapshot-client-ca",
                "ca.pem",
                "--snapshot-client-cn",
                "tether-agent",
            ],
            "also a client CA",
        ),
        (
            vec!["--snapshot-client-ca", "push-ca.pem"],
            "snapshot-client-cn",
        ),
        (
            vec![
                "--snapshot-client-ca",
                "nope.pem",
                "--snapshot-client-cn",
                "tether-agent",
            ],
            "nope.pem",
        ),
    ] {
        let extra: Vec<String> = extra
            .iter()
            .map(|a| {
                if a.ends_with(".pem") {
                    p(a)
                } else {
                    (*a).to_owned()
                }
            })
            .collect();
        let args = with(&extra.iter().map(String::as_str).collect::<Vec<_>>());
        let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        assert_eq!(code, Some(64), "{extra:?}: {err}");
        assert!(err.contains(mentions), "{extra:?}: {err}");
    }

    let mut args = with(&[]);
    args[3] = p("missing.pem");
    let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("missing.pem"), "{err}");

    std::fs::write(dir.path().join("snapshot.json"), b"{broken")?;
    let args = with(&[]);
    let (code, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    assert_eq!(
        code,
        Some(64),
        "a corrupt snapshot file is not silently replaced: {err}"
    );
    Ok(())
}
