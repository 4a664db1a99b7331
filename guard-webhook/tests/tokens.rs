//! Token validation against tokens minted by PyJWT and keys served from a local HTTPS identity provider shaped
//! like Entra: the attack suite, v1/v2 issuers, app tokens, group overage, key rotation and outages.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::Value;
use support::{Idp, Minted, TENANT};
use tether_auth::jwks::HttpsFetcher;
use tether_auth::token::{Algorithm, PrincipalKind, StaticGroups};
use tether_auth::{Authenticator, TokenConfig, TokenError};

struct Setup {
    idp: Idp,
    minted: Minted,
}

async fn setup() -> anyhow::Result<Option<Setup>> {
    if !support::pyjwt_available() {
        return Ok(None);
    }
    tether_runtime::tls::install_crypto_provider();
    let idp = Idp::start().await?;
    let minted = support::mint(&idp)?;
    idp.set_keys(vec![minted.key("k1"), minted.key("e1")]);
    Ok(Some(Setup { idp, minted }))
}

fn authenticator(idp: &Idp, config: TokenConfig) -> anyhow::Result<Authenticator> {
    let fetcher = HttpsFetcher::new(Some(idp.ca_pem().as_bytes()))?;
    Ok(Authenticator::new(config, Arc::new(fetcher))?)
}

#[tokio::test]
async fn the_attack_suite_is_refused() -> anyhow::Result<()> {
    let Some(s) = setup().await? else {
        return Ok(());
    };
    let auth = authenticator(&s.idp, support::token_config(&s.idp))?;
    // Sanity: the same keys and issuer accept a well-formed token.
    let ok = auth.authenticate(&s.minted.token("valid_v2")).await;
    assert!(ok.is_ok(), "{ok:?}");

    let expect = |case: &str, want: fn(&TokenError) -> bool| (case.to_owned(), want);
    type Check = fn(&TokenError) -> bool;
    let cases: Vec<(String, Check)> = vec![
        expect(
            "none",
            |e| matches!(e, TokenError::AlgorithmNotAllowed(a) if a == "none"),
        ),
        expect(
            "hs256_confusion",
            |e| matches!(e, TokenError::AlgorithmNotAllowed(a) if a == "HS256"),
        ),
        expect("wrong_audience", |e| *e == TokenError::WrongAudience),
        expect("wrong_tenant", |e| {
            matches!(e, TokenError::UntrustedIssuer(_))
        }),
        expect("tid_mismatch", |e| *e == TokenError::TenantMismatch),
        expect("expired", |e| *e == TokenError::Expired),
        expect("nbf_future", |e| *e == TokenError::NotYetValid),
        expect(
            "unknown_kid",
            |e| matches!(e, TokenError::UnknownKey(k) if k == "k2"),
        ),
        expect("oversized", |e| matches!(e, TokenError::TooLarge { .. })),
        expect(
            "es256",
            |e| matches!(e, TokenError::AlgorithmNotAllowed(a) if a == "ES256"),
        ),
        expect("rs256_with_ec_kid", |e| {
            matches!(e, TokenError::KeyMismatch { .. })
        }),
        expect("group_overage", |e| *e == TokenError::GroupOverage),
        expect("no_exp", |e| *e == TokenError::MissingClaim("exp")),
    ];
    for (case, want) in cases {
        let token = s.minted.token(&case);
        assert!(!token.is_empty(), "no token minted for {case}");
        let err = auth.authenticate(&token).await.err();
        assert!(err.as_ref().is_some_and(want), "{case}: got {err:?}");
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            !text.contains(&token[..20]),
            "{case}: the reason must not echo the token"
        );
    }

    // Tampered payload: same header and signature, a different oid.
    let valid = s.minted.token("valid_v2");
    let mut parts: Vec<String> = valid.split('.').map(str::to_owned).collect();
    let mut claims: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(&parts[1])?)?;
    claims["oid"] = Value::String("aaaaaaaa-0000-0000-0000-00000000beef".to_owned());
    parts[1] = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims)?);
    assert_eq!(
        auth.authenticate(&parts.join(".")).await.err(),
        Some(TokenError::BadSignature)
    );
    // Tampered signature.
    let mut sig = URL_SAFE_NO_PAD.decode(valid.rsplit('.').next().unwrap_or_default())?;
    sig[10] ^= 1;
    let forged = format!(
        "{}.{}",
        valid.rsplit_once('.').map(|x| x.0).unwrap_or_default(),
        URL_SAFE_NO_PAD.encode(sig)
    );
    assert_eq!(
        auth.authenticate(&forged).await.err(),
        Some(TokenError::BadSignature)
    );
    Ok(())
}

#[tokio::test]
async fn v1_v2_and_app_identities() -> anyhow::Result<()> {
    let Some(s) = setup().await? else {
        return Ok(());
    };
    let auth = authenticator(&s.idp, support::token_config(&s.idp))?;
    let v2 = auth.authenticate(&s.minted.token("valid_v2")).await?;
    assert_eq!(v2.username, "alice@contoso.example");
    assert_eq!(v2.uid, "aaaaaaaa-0000-0000-0000-000000000001");
    assert_eq!(v2.groups.len(), 2);
    assert_eq!(v2.extra.get("oid"), Some(&vec![v2.uid.clone()]));
    assert_eq!(v2.extra.get("tid"), Some(&vec![TENANT.to_owned()]));
    assert_eq!(v2.kind, PrincipalKind::User);

    let v1 = auth.authenticate(&s.minted.token("valid_v1")).await?;
    assert_eq!(v1.username, "bob@contoso.example", "upn first");
    assert_eq!(v1.uid, "aaaaaaaa-0000-0000-0000-000000000002");

    let app = auth.authenticate(&s.minted.token("app")).await?;
    assert_eq!(app.kind, PrincipalKind::ServicePrincipal);
    assert_eq!(app.username, "spn:11111111-2222-3333-4444-555555555555");
    assert_eq!(app.uid, "aaaaaaaa-0000-0000-0000-0000000000a1");
    assert!(app.groups.is_empty());
    Ok(())
}

#[tokio::test]
async fn es256_is_opt_in_and_overage_goes_through_the_resolver() -> anyhow::Result<()> {
    let Some(s) = setup().await? else {
        return Ok(());
    };
    let mut config = support::token_config(&s.idp);
    config.algorithms = vec![Algorithm::Rs256, Algorithm::Es256];
    let directory = StaticGroups(HashMap::from([(
        "aaaaaaaa-0000-0000-0000-000000000001".to_owned(),
        vec!["from-directory".to_owned()],
    )]));
    let auth = authenticator(&s.idp, config)?.with_group_resolver(Arc::new(directory));
    let es = auth.authenticate(&s.minted.token("es256")).await?;
    assert_eq!(es.username, "alice@contoso.example");
    let over = auth.authenticate(&s.minted.token("group_overage")).await?;
    assert_eq!(over.groups, vec!["from-directory".to_owned()]);
    // Still refused: an RS256 header on an EC key.
    assert!(matches!(
        auth.authenticate(&s.minted.token("rs256_with_ec_kid"))
            .await,
        Err(TokenError::KeyMismatch { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn unknown_kid_refetch_finds_a_rotated_key() -> anyhow::Result<()> {
    let Some(s) = setup().await? else {
        return Ok(());
    };
    let mut config = support::token_config(&s.idp);
    config.min_refetch_interval = Duration::ZERO;
    let auth = authenticator(&s.idp, config)?;
    auth.authenticate(&s.minted.token("valid_v2")).await?;
    assert_eq!(s.idp.key_fetches(), 1);
    // k2 is not published yet: one refetch, still unknown.
    assert!(matches!(
        auth.authenticate(&s.minted.token("unknown_kid")).await,
        Err(TokenError::UnknownKey(_))
    ));
    assert_eq!(s.idp.key_fetches(), 2);
    // The issuer rotates to k2: the next token with k2 triggers a refetch that finds it.
    s.idp.set_keys(vec![s.minted.key("k2")]);
    let id = auth.authenticate(&s.minted.token("unknown_kid")).await?;
    assert_eq!(id.username, "alice@contoso.example");
    assert_eq!(s.idp.key_fetches(), 3);
    Ok(())
}

#[tokio::test]
async fn refetches_are_rate_limited_and_keys_survive_an_outage() -> anyhow::Result<()> {
    let Some(s) = setup().await? else {
        return Ok(());
    };
    // Default interval (30 s): the unknown kid does not cause a fetch right after the first one.
    let auth = authenticator(&s.idp, support::token_config(&s.idp))?;
    auth.authenticate(&s.minted.token("valid_v2")).await?;
    for _ in 0..5 {
        assert!(
            auth.authenticate(&s.minted.token("unknown_kid"))
                .await
                .is_err()
        );
    }
    assert_eq!(s.idp.key_fetches(), 1, "no fetch storm on unknown key ids");

    // An outage with stale keys: refresh fails, the last-known-good keys keep working.
    let mut config = support::token_config(&s.idp);
    config.keys_ttl = Duration::ZERO;
    config.min_refetch_interval = Duration::ZERO;
    let auth = authenticator(&s.idp, config)?;
    auth.authenticate(&s.minted.token("valid_v2")).await?;
    s.idp.set_reachable(false);
    let id = auth.authenticate(&s.minted.token("valid_v2")).await;
    assert!(id.is_ok(), "last-known-good keys: {id:?}");
    assert!(
        auth.keys()
            .stats()
            .fetch_failures
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 1
    );

    // Without any keys, an unreachable issuer is reported as such.
    let fresh = authenticator(&s.idp, support::token_config(&s.idp))?;
    assert!(matches!(
        fresh.authenticate(&s.minted.token("valid_v2")).await,
        Err(TokenError::KeysUnavailable(_))
    ));
    Ok(())
}

#[tokio::test]
async fn reserved_system_names_are_refused() -> anyhow::Result<()> {
    // A token claiming `system:masters` (or a `system:` username) must not become that Kubernetes identity.
    let Some(s) = setup().await? else {
        return Ok(());
    };
    let auth = authenticator(&s.idp, support::token_config(&s.idp))?;
    for case in ["system_user", "system_group", "system_upn_case"] {
        let refused = auth.authenticate(&s.minted.token(case)).await;
        let text = refused.as_ref().map_err(ToString::to_string);
        assert!(
            text.as_ref().is_err_and(|e| e.contains("\"system:\"")),
            "{case}: {text:?}"
        );
        assert!(
            refused.is_err_and(|e| e.label() == "reserved_name"),
            "{case}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn username_and_groups_prefixes_apply_to_every_token() -> anyhow::Result<()> {
    let Some(s) = setup().await? else {
        return Ok(());
    };
    let mut config = support::token_config(&s.idp);
    config.username_prefix = "entra:".to_owned();
    config.groups_prefix = "entra-group:".to_owned();
    let auth = authenticator(&s.idp, config.clone())?;
    let id = auth.authenticate(&s.minted.token("valid_v2")).await?;
    assert_eq!(id.username, "entra:alice@contoso.example");
    assert_eq!(
        id.groups,
        vec![
            "entra-group:gggggggg-0000-0000-0000-000000000001".to_owned(),
            "entra-group:gggggggg-0000-0000-0000-000000000002".to_owned(),
        ]
    );
    assert_eq!(id.oid(), "aaaaaaaa-0000-0000-0000-000000000001");
    // A prefix does not make a reserved name acceptable, and a prefix may not itself be reserved.
    assert!(
        auth.authenticate(&s.minted.token("system_group"))
            .await
            .is_err()
    );
    config.username_prefix = "system:".to_owned();
    assert!(authenticator(&s.idp, config).is_err());
    Ok(())
}
