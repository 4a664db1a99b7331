//! Entra-style JWT validation: the pure checks (size, header, issuer and tenant, signature against a given key,
//! lifetime, audience) and the mapping of verified claims to a Kubernetes identity.
//!
//! The network part (OIDC discovery and JWKS with caching) is in [`crate::jwks`]; [`Authenticator`] puts the two
//! together. Every refusal is a [`TokenError`] whose text is safe to show to the person holding the token: it never
//! contains the token or a signature.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use serde::Deserialize;
use serde_json::Value;

use crate::jwks::{Fetch, KeyCache, KeyError};
pub use crate::jwks::{Issuer, TokenVersion};

/// The default authority of v2 issuers (`https://login.microsoftonline.com/{tid}/v2.0`).
pub const DEFAULT_V2_AUTHORITY: &str = "https://login.microsoftonline.com";
/// The default authority of v1 issuers (`https://sts.windows.net/{tid}/`).
pub const DEFAULT_V1_AUTHORITY: &str = "https://sts.windows.net";
/// The default size limit of a token; longer ones are refused before any parsing.
pub const DEFAULT_MAX_TOKEN_BYTES: usize = 16 * 1024;
/// The largest clock-skew leeway the configuration accepts.
pub const MAX_LEEWAY: Duration = Duration::from_secs(60);

/// Smallest RSA modulus accepted from a JWKS, in bytes (2048 bits).
const MIN_RSA_MODULUS_BYTES: usize = 256;

/// A signature algorithm a token may use. Only asymmetric algorithms exist here: `none` and HMAC cannot be
/// configured at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// RSASSA-PKCS1-v1_5 with SHA-256 (what Entra signs with).
    Rs256,
    /// ECDSA P-256 with SHA-256 (opt-in).
    Es256,
}

impl Algorithm {
    /// The JOSE name (`RS256`, `ES256`).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Rs256 => "RS256",
            Algorithm::Es256 => "ES256",
        }
    }

    fn jsonwebtoken(self) -> jsonwebtoken::Algorithm {
        match self {
            Algorithm::Rs256 => jsonwebtoken::Algorithm::RS256,
            Algorithm::Es256 => jsonwebtoken::Algorithm::ES256,
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_uppercase().as_str() {
            "RS256" => Ok(Algorithm::Rs256),
            "ES256" => Ok(Algorithm::Es256),
            other => Err(ConfigError::Invalid(format!(
                "algorithm {other:?} is not supported (allowed: RS256, ES256)"
            ))),
        }
    }
}

/// Token validation settings.
#[derive(Clone, Debug)]
pub struct TokenConfig {
    /// Accepted tenants (`tid` values); required, non-empty.
    pub tenants: Vec<String>,
    /// Accepted audiences (`aud` values: the application id URI or client id); required, non-empty.
    pub audiences: Vec<String>,
    /// Accepted signature algorithms; default RS256 only.
    pub algorithms: Vec<Algorithm>,
    /// Clock-skew leeway for `exp` and `nbf`; at most [`MAX_LEEWAY`].
    pub leeway: Duration,
    /// Base URL of v2 issuers and of both versions' discovery documents (default [`DEFAULT_V2_AUTHORITY`]).
    pub v2_authority: String,
    /// Base URL of v1 issuers (default [`DEFAULT_V1_AUTHORITY`]).
    pub v1_authority: String,
    /// Tokens longer than this are refused before parsing.
    pub max_token_bytes: usize,
    /// How long fetched signing keys are used before they are fetched again.
    pub keys_ttl: Duration,
    /// The least time between two fetches for one issuer (bounds refetches on unknown key ids).
    pub min_refetch_interval: Duration,
    /// Put before every username a token yields (like kube-apiserver's `--oidc-username-prefix`); empty: none.
    pub username_prefix: String,
    /// Put before every group a token yields (like `--oidc-groups-prefix`); empty: none.
    pub groups_prefix: String,
}

impl TokenConfig {
    /// A configuration for `tenants` and `audiences` with every other setting at its default.
    pub fn new(tenants: Vec<String>, audiences: Vec<String>) -> Self {
        Self {
            tenants,
            audiences,
            algorithms: vec![Algorithm::Rs256],
            leeway: Duration::from_secs(30),
            v2_authority: DEFAULT_V2_AUTHORITY.to_owned(),
            v1_authority: DEFAULT_V1_AUTHORITY.to_owned(),
            max_token_bytes: DEFAULT_MAX_TOKEN_BYTES,
            keys_ttl: Duration::from_secs(3600),
            min_refetch_interval: Duration::from_secs(30),
            username_prefix: String::new(),
            groups_prefix: String::new(),
        }
    }

    /// Checks the settings; called by [`Authenticator::new`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if self.tenants.is_empty() || self.tenants.iter().any(|t| !is_tenant_id(t)) {
            return invalid(
                "at least one tenant id is required, each made of letters, digits, '-' and '.' only",
            );
        }
        if self.audiences.is_empty() || self.audiences.iter().any(|a| a.trim().is_empty()) {
            return invalid("at least one non-empty audience is required");
        }
        if self.algorithms.is_empty() {
            return invalid("at least one algorithm is required");
        }
        if self.leeway > MAX_LEEWAY {
            return invalid("the leeway may be at most 60 s");
        }
        for (name, url) in [
            ("v2 authority", &self.v2_authority),
            ("v1 authority", &self.v1_authority),
        ] {
            if !url.starts_with("https://") || url.len() <= "https://".len() {
                return Err(ConfigError::Invalid(format!(
                    "the {name} must be an https:// URL, not {url:?}"
                )));
            }
        }
        if self.max_token_bytes == 0 {
            return invalid("the token size limit must be positive");
        }
        for (name, prefix) in [
            ("username prefix", &self.username_prefix),
            ("groups prefix", &self.groups_prefix),
        ] {
            if is_reserved(prefix)
                || prefix.len() > 64
                || prefix.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(ConfigError::Invalid(format!(
                    "the {name} must be at most 64 characters, without spaces, and must not start with \
                     {RESERVED_PREFIX:?}"
                )));
            }
        }
        Ok(())
    }

    /// Every issuer this configuration trusts: v1 and v2 for each tenant.
    pub fn issuers(&self) -> Vec<Issuer> {
        let v2 = self.v2_authority.trim_end_matches('/');
        let v1 = self.v1_authority.trim_end_matches('/');
        let mut out = Vec::with_capacity(self.tenants.len() * 2);
        for tid in &self.tenants {
            out.push(Issuer {
                url: format!("{v2}/{tid}/v2.0"),
                tenant: tid.clone(),
                version: TokenVersion::V2,
                discovery_url: format!("{v2}/{tid}/v2.0/.well-known/openid-configuration"),
            });
            out.push(Issuer {
                url: format!("{v1}/{tid}/"),
                tenant: tid.clone(),
                version: TokenVersion::V1,
                // Entra serves v1 metadata (whose issuer is sts.windows.net) from the v2 authority.
                discovery_url: format!("{v2}/{tid}/.well-known/openid-configuration"),
            });
        }
        out
    }
}

fn is_tenant_id(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// A configuration problem.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A setting is missing or out of range.
    #[error("invalid token configuration: {0}")]
    Invalid(String),
}

/// Why a token was refused. The text is safe to show to users and to log: it never includes the token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The token is longer than the configured limit.
    #[error("token refused: {len} bytes is more than the {max}-byte limit")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The token is not a well-formed compact JWS.
    #[error("token refused: malformed JWT ({0})")]
    Malformed(&'static str),
    /// The header names an algorithm that is not allowed (`none`, HS*, or one not configured).
    #[error("token refused: algorithm {0:?} is not allowed")]
    AlgorithmNotAllowed(String),
    /// The header has no `kid`.
    #[error("token refused: the header has no key id (kid)")]
    MissingKeyId,
    /// The issuer is not one of the configured tenants' v1/v2 issuers.
    #[error("token refused: issuer {0:?} is not trusted")]
    UntrustedIssuer(String),
    /// The `tid` claim does not match the issuer's tenant.
    #[error("token refused: tenant (tid) does not match the issuer")]
    TenantMismatch,
    /// No signing key with the token's `kid` is published by the issuer.
    #[error("token refused: the issuer publishes no signing key with id {0:?}")]
    UnknownKey(String),
    /// The signing keys could not be fetched and none are cached.
    #[error("token refused: the issuer's signing keys are unavailable ({0})")]
    KeysUnavailable(String),
    /// The key's type or declared algorithm does not fit the token's algorithm.
    #[error("token refused: key {kid:?} cannot verify {alg} tokens")]
    KeyMismatch {
        /// The key id.
        kid: String,
        /// The token's algorithm.
        alg: &'static str,
    },
    /// The signature does not verify.
    #[error("token refused: invalid signature")]
    BadSignature,
    /// A required claim is missing or has the wrong type.
    #[error("token refused: claim {0:?} is missing or malformed")]
    MissingClaim(&'static str),
    /// `exp` is in the past (beyond the leeway).
    #[error("token refused: expired")]
    Expired,
    /// `nbf` is in the future (beyond the leeway).
    #[error("token refused: not valid yet (nbf)")]
    NotYetValid,
    /// No `aud` value is one of the configured audiences.
    #[error("token refused: audience is not accepted")]
    WrongAudience,
    /// The token carries a group overage indication and no group resolver is configured.
    #[error(
        "token refused: the user is in too many groups for the token to list them (group overage) and no directory \
         is configured to resolve them"
    )]
    GroupOverage,
    /// The group resolver failed.
    #[error("token refused: group membership could not be resolved ({0})")]
    GroupResolution(String),
    /// The token names a user or group in the `system:` namespace Kubernetes reserves for itself.
    #[error(
        "token refused: its {0} starts with \"system:\", which Kubernetes reserves for its own identities"
    )]
    ReservedName(&'static str),
}

impl From<KeyError> for TokenError {
    fn from(e: KeyError) -> Self {
        match e {
            KeyError::Unknown(kid) => TokenError::UnknownKey(kid),
            KeyError::Unavailable(why) => TokenError::KeysUnavailable(why),
        }
    }
}

impl TokenError {
    /// A short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            TokenError::TooLarge { .. } => "too_large",
            TokenError::Malformed(_) => "malformed",
            TokenError::AlgorithmNotAllowed(_) => "algorithm",
            TokenError::MissingKeyId => "missing_kid",
            TokenError::UntrustedIssuer(_) => "issuer",
            TokenError::TenantMismatch => "tenant",
            TokenError::UnknownKey(_) => "unknown_key",
            TokenError::KeysUnavailable(_) => "keys_unavailable",
            TokenError::KeyMismatch { .. } => "key_mismatch",
            TokenError::BadSignature => "signature",
            TokenError::MissingClaim(_) => "claim",
            TokenError::Expired => "expired",
            TokenError::NotYetValid => "not_yet_valid",
            TokenError::WrongAudience => "audience",
            TokenError::GroupOverage => "group_overage",
            TokenError::GroupResolution(_) => "group_resolution",
            TokenError::ReservedName(_) => "reserved_name",
        }
    }
}

/// A token that passed the checks possible before its signature: size, shape, algorithm, issuer and tenant.
/// Nothing in it is trustworthy until [`verify`] succeeds.
#[derive(Clone, Debug)]
pub struct Unverified {
    /// The header's algorithm.
    pub alg: Algorithm,
    /// The header's key id.
    pub kid: String,
    /// The trusted issuer named by `iss`.
    pub issuer: Issuer,
    signing_input_len: usize,
    signature_b64: String,
    claims: Value,
}

#[derive(Deserialize)]
struct Header {
    alg: Option<String>,
    kid: Option<String>,
    crit: Option<Value>,
}

/// Checks a token's size and shape, its header and its issuer/tenant, without any key (pure).
pub fn inspect(config: &TokenConfig, token: &str) -> Result<Unverified, TokenError> {
    if token.len() > config.max_token_bytes {
        return Err(TokenError::TooLarge {
            len: token.len(),
            max: config.max_token_bytes,
        });
    }
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed("expected three dot-separated parts"));
    };
    let header: Header =
        decode_json(h).ok_or(TokenError::Malformed("header is not base64url JSON"))?;
    let alg_name = header
        .alg
        .ok_or(TokenError::Malformed("header has no alg"))?;
    let alg = config
        .algorithms
        .iter()
        .copied()
        .find(|a| a.name() == alg_name)
        .ok_or_else(|| TokenError::AlgorithmNotAllowed(truncate(&alg_name, 16)))?;
    if header.crit.is_some() {
        // No critical extension is understood, so RFC 7515 §4.1.11 says refuse.
        return Err(TokenError::Malformed("unsupported crit header"));
    }
    let kid = header
        .kid
        .filter(|k| !k.is_empty())
        .ok_or(TokenError::MissingKeyId)?;
    if s.is_empty() {
        return Err(TokenError::Malformed("empty signature"));
    }
    let claims: Value =
        decode_json(p).ok_or(TokenError::Malformed("payload is not base64url JSON"))?;
    if !claims.is_object() {
        return Err(TokenError::Malformed("payload is not a JSON object"));
    }
    let iss = claims
        .get("iss")
        .and_then(Value::as_str)
        .ok_or(TokenError::MissingClaim("iss"))?;
    let issuer = config
        .issuers()
        .into_iter()
        .find(|i| i.url == iss)
        .ok_or_else(|| TokenError::UntrustedIssuer(truncate(iss, 200)))?;
    let tid = claims.get("tid").and_then(Value::as_str);
    if tid != Some(issuer.tenant.as_str()) {
        return Err(TokenError::TenantMismatch);
    }
    Ok(Unverified {
        alg,
        kid,
        issuer,
        signing_input_len: h.len() + 1 + p.len(),
        signature_b64: s.to_owned(),
        claims,
    })
}

fn decode_json<T: serde::de::DeserializeOwned>(part: &str) -> Option<T> {
    let bytes = URL_SAFE_NO_PAD.decode(part).ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn truncate(s: &str, max: usize) -> String {
    let mut out: String = s.chars().take(max).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

/// Whether `token` claims to come from one of the configured authorities: it is shaped like a JWT (dot-separated
/// parts) and its payload's `iss` lies under the v2 or the v1 authority (`{authority}/…`, any tenant; compared
/// ASCII case-insensitively). Nothing is verified (pure).
///
/// This is how the relay and the agent's authentication proxy tell an Entra-style token, which must then pass
/// [`Authenticator::authenticate`] (a token from an untrusted tenant under the same authority included), from
/// a token that is not theirs to judge (a Kubernetes service-account token, an opaque token), which passes
/// through unchanged.
pub fn is_entra_style(config: &TokenConfig, token: &str) -> bool {
    let mut parts = token.split('.');
    let (Some(_header), Some(payload)) = (parts.next(), parts.next()) else {
        return false;
    };
    let Some(claims) = decode_json::<Value>(payload) else {
        return false;
    };
    let Some(iss) = claims.get("iss").and_then(Value::as_str) else {
        return false;
    };
    let under = |authority: &str| {
        let prefix = format!("{}/", authority.trim_end_matches('/'));
        iss.len() >= prefix.len()
            && iss.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
    };
    under(&config.v2_authority) || under(&config.v1_authority)
}

/// Checks the signature of `token` (the same string given to [`inspect`]) with `key`, then its lifetime at `now`
/// and its audience (pure). Returns the verified claims.
pub fn verify(
    config: &TokenConfig,
    token: &str,
    unverified: &Unverified,
    key: &Jwk,
    now: SystemTime,
) -> Result<Claims, TokenError> {
    check_key(unverified, key)?;
    let decoding =
        jsonwebtoken::DecodingKey::from_jwk(key).map_err(|_| TokenError::KeyMismatch {
            kid: unverified.kid.clone(),
            alg: unverified.alg.name(),
        })?;
    let message = token
        .as_bytes()
        .get(..unverified.signing_input_len)
        .ok_or(TokenError::Malformed("token does not match its inspection"))?;
    let ok = jsonwebtoken::crypto::verify(
        &unverified.signature_b64,
        message,
        &decoding,
        unverified.alg.jsonwebtoken(),
    )
    .map_err(|_| TokenError::BadSignature)?;
    if !ok {
        return Err(TokenError::BadSignature);
    }
    check_claims(config, &unverified.claims, now)?;
    Claims::from_value(unverified.claims.clone())
}

/// Refuses a key whose type, curve, size, use or declared algorithm does not fit the token's algorithm (the
/// key-type confusion checks).
fn check_key(unverified: &Unverified, key: &Jwk) -> Result<(), TokenError> {
    let mismatch = || TokenError::KeyMismatch {
        kid: unverified.kid.clone(),
        alg: unverified.alg.name(),
    };
    if let Some(key_use) = &key.common.public_key_use
        && *key_use != PublicKeyUse::Signature
    {
        return Err(mismatch());
    }
    let type_fits = match (&key.algorithm, unverified.alg) {
        (AlgorithmParameters::RSA(rsa), Algorithm::Rs256) => URL_SAFE_NO_PAD
            .decode(rsa.n.trim_end_matches('='))
            .map(|n| {
                let significant = n.iter().skip_while(|b| **b == 0).count();
                significant >= MIN_RSA_MODULUS_BYTES
            })
            .unwrap_or(false),
        (AlgorithmParameters::EllipticCurve(ec), Algorithm::Es256) => {
            ec.curve == EllipticCurve::P256
        }
        _ => false,
    };
    if !type_fits {
        return Err(mismatch());
    }
    if let Some(declared) = key.common.key_algorithm {
        let fits = matches!(
            (declared, unverified.alg),
            (KeyAlgorithm::RS256, Algorithm::Rs256) | (KeyAlgorithm::ES256, Algorithm::Es256)
        );
        if !fits {
            return Err(mismatch());
        }
    }
    Ok(())
}

fn numeric_date(claims: &Value, name: &'static str) -> Result<Option<f64>, TokenError> {
    match claims.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or(TokenError::MissingClaim(name)),
    }
}

fn check_claims(config: &TokenConfig, claims: &Value, now: SystemTime) -> Result<(), TokenError> {
    let now = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let leeway = config.leeway.as_secs_f64();
    let exp = numeric_date(claims, "exp")?.ok_or(TokenError::MissingClaim("exp"))?;
    if now > exp + leeway {
        return Err(TokenError::Expired);
    }
    if let Some(nbf) = numeric_date(claims, "nbf")?
        && now + leeway < nbf
    {
        return Err(TokenError::NotYetValid);
    }
    let accepted = |a: &str| config.audiences.iter().any(|c| c == a);
    let ok = match claims.get("aud") {
        Some(Value::String(a)) => accepted(a),
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).any(accepted),
        None => return Err(TokenError::MissingClaim("aud")),
        Some(_) => return Err(TokenError::MissingClaim("aud")),
    };
    if !ok {
        return Err(TokenError::WrongAudience);
    }
    Ok(())
}

/// The claims of a verified token that identity mapping uses.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Claims {
    /// Tenant id.
    pub tid: String,
    /// Object id of the user or service principal.
    #[serde(default)]
    pub oid: Option<String>,
    /// Subject.
    #[serde(default)]
    pub sub: Option<String>,
    /// User principal name (v1 and some v2 tokens).
    #[serde(default)]
    pub upn: Option<String>,
    /// Preferred username (v2).
    #[serde(default)]
    pub preferred_username: Option<String>,
    /// Unique name (v1).
    #[serde(default)]
    pub unique_name: Option<String>,
    /// Group object ids.
    #[serde(default)]
    pub groups: Option<Vec<String>>,
    /// Identity type (`user` or `app`), an optional claim.
    #[serde(default)]
    pub idtyp: Option<String>,
    /// Client application id (v2).
    #[serde(default)]
    pub azp: Option<String>,
    /// Client application id (v1).
    #[serde(default)]
    pub appid: Option<String>,
    /// Delegated scopes: present only in user (delegated) tokens.
    #[serde(default)]
    pub scp: Option<String>,
    /// Group overage: the claim names that moved to a claim source.
    #[serde(default, rename = "_claim_names")]
    pub claim_names: Option<BTreeMap<String, Value>>,
    /// Group overage in implicit-flow tokens.
    #[serde(default)]
    pub hasgroups: Option<bool>,
}

impl Claims {
    fn from_value(v: Value) -> Result<Self, TokenError> {
        serde_json::from_value(v).map_err(|_| TokenError::MissingClaim("tid"))
    }

    /// Whether the groups claim was replaced by an overage indication.
    pub fn has_group_overage(&self) -> bool {
        self.hasgroups == Some(true)
            || self
                .claim_names
                .as_ref()
                .is_some_and(|n| n.contains_key("groups"))
    }

    /// Whether this is an application (service principal) token rather than a user's.
    ///
    /// `idtyp=app` says so when the tenant emits that optional claim; otherwise a token with a client id
    /// (`azp`/`appid`), no delegated scopes, no user name claims and `sub == oid` is an app-only token.
    pub fn is_app(&self) -> bool {
        match self.idtyp.as_deref() {
            Some("app") => true,
            Some(_) => false,
            None => {
                (self.azp.is_some() || self.appid.is_some())
                    && self.scp.is_none()
                    && self.upn.is_none()
                    && self.preferred_username.is_none()
                    && self.unique_name.is_none()
                    && self.oid.is_some()
                    && self.oid == self.sub
            }
        }
    }
}

/// What kind of principal an identity is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum PrincipalKind {
    /// A person.
    User,
    /// An application (service principal, managed identity).
    ServicePrincipal,
}

/// The extra key carrying the object id (what authorization keys on).
pub const EXTRA_OID: &str = "oid";
/// The extra key carrying the tenant id.
pub const EXTRA_TID: &str = "tid";
/// The extra key carrying an application's client id (service principals only).
pub const EXTRA_APPID: &str = "appid";
/// Username prefix of service principals: `spn:{appid}`.
pub const SERVICE_PRINCIPAL_PREFIX: &str = "spn:";

/// A Kubernetes identity made from verified claims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// `upn`, `preferred_username` or `unique_name`, else the oid; `spn:{appid}` for service principals.
    pub username: String,
    /// The object id.
    pub uid: String,
    /// Group object ids (resolved through the directory on overage).
    pub groups: Vec<String>,
    /// `oid` and `tid` (and `appid` for service principals).
    pub extra: BTreeMap<String, Vec<String>>,
    /// User or service principal.
    pub kind: PrincipalKind,
}

impl Identity {
    /// The object id.
    pub fn oid(&self) -> &str {
        &self.uid
    }
}

/// Maps verified claims to an identity (pure). On group overage `resolved_groups` must carry the groups from the
/// directory; `None` then refuses with [`TokenError::GroupOverage`].
pub fn identity(
    claims: &Claims,
    resolved_groups: Option<Vec<String>>,
) -> Result<Identity, TokenError> {
    let oid = claims
        .oid
        .clone()
        .filter(|o| !o.is_empty())
        .ok_or(TokenError::MissingClaim("oid"))?;
    let groups = if claims.has_group_overage() {
        resolved_groups.ok_or(TokenError::GroupOverage)?
    } else {
        claims.groups.clone().unwrap_or_default()
    };
    let mut extra = BTreeMap::new();
    extra.insert(EXTRA_OID.to_owned(), vec![oid.clone()]);
    extra.insert(EXTRA_TID.to_owned(), vec![claims.tid.clone()]);
    let non_empty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    if claims.is_app() {
        let appid = non_empty(&claims.azp)
            .or_else(|| non_empty(&claims.appid))
            .ok_or(TokenError::MissingClaim("azp"))?;
        extra.insert(EXTRA_APPID.to_owned(), vec![appid.clone()]);
        return Ok(Identity {
            username: format!("{SERVICE_PRINCIPAL_PREFIX}{appid}"),
            uid: oid,
            groups,
            extra,
            kind: PrincipalKind::ServicePrincipal,
        });
    }
    let username = non_empty(&claims.upn)
        .or_else(|| non_empty(&claims.preferred_username))
        .or_else(|| non_empty(&claims.unique_name))
        .unwrap_or_else(|| oid.clone());
    Ok(Identity {
        username,
        uid: oid,
        groups,
        extra,
        kind: PrincipalKind::User,
    })
}

/// The name prefix Kubernetes reserves (`system:masters`, `system:serviceaccount:…`, `system:node:…`).
pub const RESERVED_PREFIX: &str = "system:";

fn is_reserved(name: &str) -> bool {
    name.get(..RESERVED_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_PREFIX))
}

/// Makes the Kubernetes identity of a token's verified claims (pure): [`identity`], then refuses `system:`
/// usernames and groups ([`TokenError::ReservedName`]) and applies the configured username and groups prefixes.
/// This is the one place a token becomes a Kubernetes user: guard's TokenReview, the agent's impersonation and
/// the relay all go through it (via [`Authenticator::authenticate`]).
pub fn kubernetes_identity(
    claims: &Claims,
    resolved_groups: Option<Vec<String>>,
    config: &TokenConfig,
) -> Result<Identity, TokenError> {
    let mut id = identity(claims, resolved_groups)?;
    if is_reserved(&id.username) {
        return Err(TokenError::ReservedName("username"));
    }
    if id.groups.iter().any(|g| is_reserved(g)) {
        return Err(TokenError::ReservedName("group"));
    }
    if !config.username_prefix.is_empty() {
        id.username = format!("{}{}", config.username_prefix, id.username);
    }
    if !config.groups_prefix.is_empty() {
        for g in &mut id.groups {
            g.insert_str(0, &config.groups_prefix);
        }
    }
    Ok(id)
}

/// Resolves the groups of a user whose token had a group overage (the relay's directory API, later).
pub trait GroupResolver: Send + Sync {
    /// The group object ids of `oid` in tenant `tid`. The error text is shown to the user.
    fn groups<'a>(
        &'a self,
        tid: &'a str,
        oid: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<String>, String>> + Send + 'a>>;
}

/// A fixed directory, for tests and development.
#[derive(Clone, Debug, Default)]
pub struct StaticGroups(pub HashMap<String, Vec<String>>);

impl GroupResolver for StaticGroups {
    fn groups<'a>(
        &'a self,
        _tid: &'a str,
        oid: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<String>, String>> + Send + 'a>> {
        let result = self
            .0
            .get(oid)
            .cloned()
            .ok_or_else(|| "the user is not in the directory".to_owned());
        Box::pin(async move { result })
    }
}

/// Validates tokens end to end: [`inspect`], the issuer's keys from [`KeyCache`], [`verify`], group resolution,
/// [`identity`]. Cheap to share behind an `Arc`.
pub struct Authenticator {
    config: TokenConfig,
    keys: KeyCache,
    resolver: Option<Arc<dyn GroupResolver>>,
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator")
            .field("config", &self.config)
            .field("resolver", &self.resolver.is_some())
            .finish_non_exhaustive()
    }
}

impl Authenticator {
    /// Validates `config` and builds an authenticator fetching discovery documents and keys with `fetch`
    /// (usually [`crate::jwks::HttpsFetcher`]).
    pub fn new(config: TokenConfig, fetch: Arc<dyn Fetch>) -> Result<Self, ConfigError> {
        config.validate()?;
        let keys = KeyCache::new(fetch, config.keys_ttl, config.min_refetch_interval);
        Ok(Self {
            config,
            keys,
            resolver: None,
        })
    }

    /// Resolves group overages through `resolver` instead of refusing them.
    pub fn with_group_resolver(mut self, resolver: Arc<dyn GroupResolver>) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TokenConfig {
        &self.config
    }

    /// The signing-key cache (for metrics and tests).
    pub fn keys(&self) -> &KeyCache {
        &self.keys
    }

    /// Validates `token` now.
    pub async fn authenticate(&self, token: &str) -> Result<Identity, TokenError> {
        self.authenticate_at(token, SystemTime::now()).await
    }

    /// Validates `token` as of `now` (lifetime checks only; key caching follows Tokio's clock).
    pub async fn authenticate_at(
        &self,
        token: &str,
        now: SystemTime,
    ) -> Result<Identity, TokenError> {
        let unverified = inspect(&self.config, token)?;
        let key = self.keys.key(&unverified.issuer, &unverified.kid).await?;
        let claims = verify(&self.config, token, &unverified, &key, now)?;
        let resolved = match (&self.resolver, claims.has_group_overage()) {
            (Some(resolver), true) => {
                let oid = claims
                    .oid
                    .as_deref()
                    .ok_or(TokenError::MissingClaim("oid"))?;
                let groups = resolver
                    .groups(&claims.tid, oid)
                    .await
                    .map_err(|e| TokenError::GroupResolution(truncate(&e, 200)))?;
                Some(groups)
            }
            _ => None,
        };
        kubernetes_identity(&claims, resolved, &self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TID: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";

    fn config() -> TokenConfig {
        TokenConfig::new(vec![TID.to_owned()], vec!["api://tether".to_owned()])
    }

    fn b64(v: &Value) -> String {
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap_or_default())
    }

    fn token(header: Value, claims: Value) -> String {
        format!("{}.{}.c2ln", b64(&header), b64(&claims))
    }

    #[test]
    fn entra_style_tokens_are_recognised_by_issuer_authority() {
        let c = config();
        let with_iss = |iss: &str| token(json!({"alg": "none"}), json!({"iss": iss}));
        assert!(is_entra_style(
            &c,
            &with_iss(&format!("https://login.microsoftonline.com/{TID}/v2.0"))
        ));
        // Any tenant under the authority: an untrusted tenant must be refused, not passed through.
        assert!(is_entra_style(
            &c,
            &with_iss("https://login.microsoftonline.com/other/v2.0")
        ));
        assert!(is_entra_style(
            &c,
            &with_iss("https://sts.windows.net/other/")
        ));
        assert!(is_entra_style(
            &c,
            &with_iss("HTTPS://LOGIN.MICROSOFTONLINE.COM/x/v2.0")
        ));
        // No signature part (alg none) still counts.
        let header = b64(&json!({"alg": "none"}));
        let payload = b64(&json!({"iss": "https://sts.windows.net/x/"}));
        assert!(is_entra_style(&c, &format!("{header}.{payload}.")));

        assert!(!is_entra_style(
            &c,
            &with_iss("https://kubernetes.default.svc.cluster.local")
        ));
        assert!(!is_entra_style(&c, &with_iss("kubernetes/serviceaccount")));
        assert!(!is_entra_style(
            &c,
            &with_iss("https://login.microsoftonline.com.evil.example/x/v2.0")
        ));
        assert!(!is_entra_style(
            &c,
            &with_iss("https://login.microsoftonline.com")
        ));
        assert!(!is_entra_style(&c, "opaque-token"));
        assert!(!is_entra_style(&c, "a.b.c"));
        assert!(!is_entra_style(&c, &token(json!({}), json!({"sub": "x"}))));

        let mut dev = config();
        dev.v2_authority = "https://127.0.0.1:8443/login/".to_owned();
        assert!(is_entra_style(
            &dev,
            &with_iss("https://127.0.0.1:8443/login/t/v2.0")
        ));
        assert!(!is_entra_style(
            &dev,
            &with_iss("https://login.microsoftonline.com/t/v2.0")
        ));
    }

    fn v2_claims() -> Value {
        json!({"iss": format!("https://login.microsoftonline.com/{TID}/v2.0"), "tid": TID, "aud": "api://tether",
               "exp": 2_000_000_000u64, "oid": "o1"})
    }

    #[test]
    fn config_validation() {
        assert!(config().validate().is_ok());
        let mut c = config();
        c.audiences.clear();
        assert!(c.validate().is_err());
        let mut c = config();
        c.leeway = Duration::from_secs(61);
        assert!(c.validate().is_err());
        let mut c = config();
        c.v2_authority = "http://login.example".to_owned();
        assert!(c.validate().is_err());
        let mut c = config();
        c.tenants = vec!["a/b".to_owned()];
        assert!(c.validate().is_err());
        assert!("HS256".parse::<Algorithm>().is_err());
        assert!("none".parse::<Algorithm>().is_err());
        assert_eq!("es256".parse::<Algorithm>().ok(), Some(Algorithm::Es256));
    }

    #[test]
    fn issuers_are_built_from_the_authorities() {
        let mut c = config();
        c.v2_authority = "https://127.0.0.1:9/login/".to_owned();
        c.v1_authority = "https://127.0.0.1:9/sts".to_owned();
        let issuers = c.issuers();
        assert_eq!(
            issuers[0].url,
            format!("https://127.0.0.1:9/login/{TID}/v2.0")
        );
        assert_eq!(
            issuers[0].discovery_url,
            format!("https://127.0.0.1:9/login/{TID}/v2.0/.well-known/openid-configuration")
        );
        assert_eq!(issuers[1].url, format!("https://127.0.0.1:9/sts/{TID}/"));
        assert_eq!(
            issuers[1].discovery_url,
            format!("https://127.0.0.1:9/login/{TID}/.well-known/openid-configuration")
        );
    }

    #[test]
    fn inspect_refuses_before_any_key_is_needed() {
        let c = config();
        let long = "a".repeat(DEFAULT_MAX_TOKEN_BYTES + 1);
        assert!(matches!(
            inspect(&c, &long),
            Err(TokenError::TooLarge { .. })
        ));
        assert!(matches!(inspect(&c, "a.b"), Err(TokenError::Malformed(_))));
        assert!(matches!(
            inspect(&c, "a.b.c.d"),
            Err(TokenError::Malformed(_))
        ));
        for alg in ["none", "HS256", "RS384", "ES256", "PS256"] {
            let t = token(json!({"alg": alg, "kid": "k"}), v2_claims());
            assert_eq!(
                inspect(&c, &t).err(),
                Some(TokenError::AlgorithmNotAllowed(alg.to_owned())),
                "{alg}"
            );
        }
        let t = token(json!({"alg": "RS256"}), v2_claims());
        assert_eq!(inspect(&c, &t).err(), Some(TokenError::MissingKeyId));
        let mut claims = v2_claims();
        claims["iss"] = json!("https://evil.example/x/v2.0");
        let t = token(json!({"alg": "RS256", "kid": "k"}), claims);
        assert!(matches!(
            inspect(&c, &t),
            Err(TokenError::UntrustedIssuer(_))
        ));
        let mut claims = v2_claims();
        claims["tid"] = json!("other");
        let t = token(json!({"alg": "RS256", "kid": "k"}), claims);
        assert_eq!(inspect(&c, &t).err(), Some(TokenError::TenantMismatch));
        let t = token(json!({"alg": "RS256", "kid": "k"}), v2_claims());
        let u = inspect(&c, &t).map_err(|e| e.to_string());
        assert_eq!(u.map(|u| u.issuer.version).ok(), Some(TokenVersion::V2));
    }

    #[test]
    fn claim_checks() {
        let c = config();
        let at = |secs: u64| UNIX_EPOCH + Duration::from_secs(secs);
        let claims = json!({"aud": ["x", "api://tether"], "exp": 1000, "nbf": 900});
        assert!(check_claims(&c, &claims, at(950)).is_ok());
        assert!(check_claims(&c, &claims, at(1029)).is_ok(), "within leeway");
        assert_eq!(
            check_claims(&c, &claims, at(1031)),
            Err(TokenError::Expired)
        );
        assert!(check_claims(&c, &claims, at(871)).is_ok(), "within leeway");
        assert_eq!(
            check_claims(&c, &claims, at(869)),
            Err(TokenError::NotYetValid)
        );
        let claims = json!({"aud": "other", "exp": 1000});
        assert_eq!(
            check_claims(&c, &claims, at(950)),
            Err(TokenError::WrongAudience)
        );
        let claims = json!({"exp": 1000});
        assert_eq!(
            check_claims(&c, &claims, at(950)),
            Err(TokenError::MissingClaim("aud"))
        );
        let claims = json!({"aud": "api://tether"});
        assert_eq!(
            check_claims(&c, &claims, at(950)),
            Err(TokenError::MissingClaim("exp"))
        );
    }

    fn claims(v: Value) -> Claims {
        serde_json::from_value(v).unwrap_or_default()
    }

    #[test]
    fn identity_mapping() {
        let c = claims(
            json!({"tid": "t", "oid": "o", "upn": "alice@x", "preferred_username": "p",
                              "groups": ["g1", "g2"]}),
        );
        let id = identity(&c, None).map_err(|e| e.to_string());
        let id = id.as_ref().ok();
        assert_eq!(id.map(|i| i.username.as_str()), Some("alice@x"));
        assert_eq!(id.map(|i| i.uid.as_str()), Some("o"));
        assert_eq!(id.map(|i| i.groups.len()), Some(2));
        assert_eq!(
            id.and_then(|i| i.extra.get("tid")),
            Some(&vec!["t".to_owned()])
        );
        let c = claims(json!({"tid": "t", "oid": "o", "unique_name": "u"}));
        assert_eq!(
            identity(&c, None).map(|i| i.username).ok().as_deref(),
            Some("u")
        );
        let c = claims(json!({"tid": "t", "oid": "o"}));
        assert_eq!(
            identity(&c, None).map(|i| i.username).ok().as_deref(),
            Some("o")
        );
        let c = claims(json!({"tid": "t"}));
        assert_eq!(identity(&c, None), Err(TokenError::MissingClaim("oid")));
    }

    #[test]
    fn app_tokens_become_service_principals() {
        let c =
            claims(json!({"tid": "t", "oid": "o", "sub": "o", "idtyp": "app", "azp": "client"}));
        let id = identity(&c, None).ok();
        assert_eq!(id.as_ref().map(|i| i.username.as_str()), Some("spn:client"));
        assert_eq!(
            id.as_ref().map(|i| i.kind),
            Some(PrincipalKind::ServicePrincipal)
        );
        // v1 app-only token without idtyp.
        let c = claims(json!({"tid": "t", "oid": "o", "sub": "o", "appid": "client1"}));
        assert_eq!(
            identity(&c, None).map(|i| i.username).ok().as_deref(),
            Some("spn:client1")
        );
        // A delegated token is a user even though it carries azp.
        let c = claims(
            json!({"tid": "t", "oid": "o", "sub": "s", "azp": "cli", "scp": "user.read",
                              "preferred_username": "bob"}),
        );
        assert_eq!(
            identity(&c, None).map(|i| i.kind).ok(),
            Some(PrincipalKind::User)
        );
    }

    #[test]
    fn group_overage_is_never_an_empty_list() {
        let c = claims(
            json!({"tid": "t", "oid": "o", "_claim_names": {"groups": "src1"},
                              "_claim_sources": {"src1": {"endpoint": "https://graph.example/x"}}}),
        );
        assert_eq!(identity(&c, None), Err(TokenError::GroupOverage));
        let id = identity(&c, Some(vec!["g".to_owned()])).ok();
        assert_eq!(id.map(|i| i.groups), Some(vec!["g".to_owned()]));
        let c = claims(json!({"tid": "t", "oid": "o", "hasgroups": true}));
        assert_eq!(identity(&c, None), Err(TokenError::GroupOverage));
    }

    #[test]
    fn kubernetes_identity_refuses_reserved_names_and_applies_prefixes() {
        let mut config = config();
        let c = claims(json!({"tid": "t", "oid": "o", "upn": "alice@x", "groups": ["g1"]}));
        let id = kubernetes_identity(&c, None, &config);
        assert_eq!(id.map(|i| i.username).ok().as_deref(), Some("alice@x"));
        for bad in [
            json!({"tid": "t", "oid": "o", "upn": "system:admin"}),
            json!({"tid": "t", "oid": "o", "upn": "SYSTEM:admin"}),
            json!({"tid": "t", "oid": "o", "upn": "a", "groups": ["g", "system:masters"]}),
            json!({"tid": "t", "oid": "system:node:x"}),
        ] {
            let refused = kubernetes_identity(&claims(bad.clone()), None, &config);
            assert!(
                matches!(refused, Err(TokenError::ReservedName(_))),
                "{bad}: {refused:?}"
            );
        }
        config.username_prefix = "aad:".to_owned();
        config.groups_prefix = "aad-group:".to_owned();
        let id = kubernetes_identity(&c, None, &config);
        assert_eq!(
            id.map(|i| (i.username, i.groups)),
            Ok(("aad:alice@x".to_owned(), vec!["aad-group:g1".to_owned()]))
        );
        assert!(config.validate().is_ok());
        config.groups_prefix = "System:x".to_owned();
        assert!(config.validate().is_err());
        config.groups_prefix = "a b".to_owned();
        assert!(config.validate().is_err());
    }
}
