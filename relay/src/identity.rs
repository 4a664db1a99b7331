//! Cluster identities: the agent CA that issues one client certificate per cluster from the agent's CSR, the
//! TLS verifier that lets those certificates (and no others) through the listener, and reading the certificate
//! an agent presents.
//!
//! Files in the data dir: `agent-ca.pem` and `agent-ca-key.pem` (0600), generated once and kept separate
//! from the server CA (`ca.pem`), which clients trust for the relay's own name.
//!
//! An issued certificate has CN = NAME, SAN URI `tether://cluster/NAME`, EKU clientAuth, a random serial
//! and `notAfter = now + validity`. The subject and extensions the agent asked for are ignored; only its
//! public key (whose possession the CSR's signature proves) is kept.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName as TlsName, RootCertStore,
};
use sha2::{Digest, Sha256};
use time::{Duration, OffsetDateTime};

use crate::certs::write_file;
use crate::error::RelayError;

/// The agent CA certificate, in the data dir.
pub(crate) const AGENT_CA_CERT: &str = "agent-ca.pem";
/// Its private key (0600).
pub(crate) const AGENT_CA_KEY: &str = "agent-ca-key.pem";

const AGENT_CA_VALIDITY: Duration = Duration::days(3650);
/// Issued certificates start a little in the past, for agents whose clock is behind.
const NOT_BEFORE_SKEW: Duration = Duration::minutes(5);
/// The SAN URI prefix naming a cluster.
const CLUSTER_URI_PREFIX: &str = "tether://cluster/";
/// The SAN URI prefix naming a relay replica (peer link certificates).
pub(crate) const REPLICA_URI_PREFIX: &str = "tether://replica/";
/// A replica's DNS name on the peer link is its id and this suffix (a reserved top-level domain, never
/// resolved: the peer link maps it to the address the store holds).
pub(crate) const REPLICA_NAME_SUFFIX: &str = ".replica.tether.invalid";

/// The CA that issues cluster identities.
pub(crate) struct AgentCa {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    pem: String,
}

impl fmt::Debug for AgentCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentCa").finish_non_exhaustive()
    }
}

/// A certificate issued to a cluster.
#[derive(Debug, Clone)]
pub(crate) struct Issued {
    /// PEM, as sent to the agent.
    pub(crate) pem: String,
    /// SHA-256 of the DER, lowercase hex.
    pub(crate) fingerprint: String,
    /// Its expiry (whole seconds, as encoded in the certificate).
    pub(crate) not_after: OffsetDateTime,
}

/// Why a certificate could not be issued.
#[derive(Debug, thiserror::Error)]
pub(crate) enum IssueError {
    /// The agent's CSR is malformed, badly signed, or asks for something unsupported.
    #[error("invalid certificate signing request: {0}")]
    InvalidCsr(String),
    /// Signing failed (a relay problem).
    #[error("cannot sign the certificate: {0}")]
    Sign(String),
}

/// What the relay reads from a client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerCert {
    /// The cluster named by the SAN URI `tether://cluster/NAME`, when there is exactly one such URI.
    pub(crate) cluster: Option<String>,
    /// The subject's common name.
    pub(crate) common_name: Option<String>,
    /// SHA-256 of the DER, lowercase hex.
    pub(crate) fingerprint: String,
    /// The certificate's expiry.
    pub(crate) not_after: OffsetDateTime,
}

impl PeerCert {
    /// True when both the SAN URI and the CN name `cluster`.
    pub(crate) fn names(&self, cluster: &str) -> bool {
        self.cluster.as_deref() == Some(cluster) && self.common_name.as_deref() == Some(cluster)
    }
}

/// SHA-256 of a certificate's DER, lowercase hex.
pub(crate) fn fingerprint(der: &[u8]) -> String {
    hex::encode(Sha256::digest(der))
}

/// Reads names, fingerprint and expiry from a DER certificate.
pub(crate) fn parse_peer(der: &[u8]) -> Result<PeerCert, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("unparsable certificate: {e}"))?;
    let not_after = OffsetDateTime::from_unix_timestamp(cert.validity().not_after.timestamp())
        .map_err(|e| format!("certificate expiry out of range: {e}"))?;
    let common_name = {
        let mut names = cert.subject().iter_common_name();
        match (names.next(), names.next()) {
            (Some(cn), None) => cn.as_str().ok().map(str::to_owned),
            _ => None,
        }
    };
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("bad subjectAltName: {e}"))?;
    let mut clusters = san
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => uri.strip_prefix(CLUSTER_URI_PREFIX),
            _ => None,
        });
    let cluster = match (clusters.next(), clusters.next()) {
        (Some(one), None) => Some(one.to_owned()),
        _ => None,
    };
    Ok(PeerCert {
        cluster,
        common_name,
        fingerprint: fingerprint(der),
        not_after,
    })
}

fn ca_params(now: OffsetDateTime) -> CertificateParams {
    crate::certs::ca_params_named("Tether agent CA", now, AGENT_CA_VALIDITY)
}

impl AgentCa {
    /// Loads `agent-ca.pem`/`agent-ca-key.pem` from `dir`, or generates them the first time.
    pub(crate) fn load_or_generate(dir: &Path) -> Result<Self, RelayError> {
        let cert_path = dir.join(AGENT_CA_CERT);
        let key_path = dir.join(AGENT_CA_KEY);
        let tls = |what: &str, e: &dyn fmt::Display| RelayError::Tls(format!("{what}: {e}"));
        let (cert_pem, key) = if cert_path.is_file() && key_path.is_file() {
            let cert = std::fs::read_to_string(&cert_path)
                .map_err(|e| RelayError::io("cannot read", &cert_path, e))?;
            let key_pem = std::fs::read_to_string(&key_path)
                .map_err(|e| RelayError::io("cannot read", &key_path, e))?;
            let key = KeyPair::from_pem(&key_pem)
                .map_err(|e| tls(&key_path.display().to_string(), &e))?;
            (cert, key)
        } else {
            let key = KeyPair::generate().map_err(|e| tls("generating the agent CA key", &e))?;
            let cert = ca_params(OffsetDateTime::now_utc())
                .self_signed(&key)
                .map_err(|e| tls("signing the agent CA", &e))?;
            write_file(dir, AGENT_CA_KEY, key.serialize_pem().as_bytes(), 0o600)?;
            write_file(dir, AGENT_CA_CERT, cert.pem().as_bytes(), 0o644)?;
            tracing::info!(dir = %dir.display(), "generated the agent CA");
            (cert.pem(), key)
        };
        let cert_der = rustls_pemfile::certs(&mut cert_pem.as_bytes())
            .next()
            .and_then(Result::ok)
            .ok_or_else(|| {
                RelayError::Tls(format!("{}: no certificate found", cert_path.display()))
            })?;
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)
            .map_err(|e| tls(&cert_path.display().to_string(), &e))?;
        Ok(Self {
            issuer,
            cert_der,
            pem: cert_pem,
        })
    }

    /// The CA certificate, PEM.
    pub(crate) fn pem(&self) -> &str {
        &self.pem
    }

    /// Issues `cluster`'s certificate for the key in `csr_pem`, valid from a little before `now` for
    /// `validity`.
    pub(crate) fn issue(
        &self,
        cluster: &str,
        csr_pem: &str,
        validity: std::time::Duration,
        now: OffsetDateTime,
    ) -> Result<Issued, IssueError> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| IssueError::InvalidCsr(e.to_string()))?;
        let sign = |e: rcgen::Error| IssueError::Sign(e.to_string());
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cluster);
        params.distinguished_name = dn;
        let uri = format!("{CLUSTER_URI_PREFIX}{cluster}");
        params.subject_alt_names = vec![SanType::URI(uri.try_into().map_err(sign)?)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let mut serial = [0u8; 16];
        rand::fill(&mut serial);
        // Positive, and no leading zero byte to strip.
        serial[0] = (serial[0] & 0x7f) | 0x40;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let validity = Duration::try_from(validity)
            .map_err(|e| IssueError::Sign(format!("validity out of range: {e}")))?;
        params.not_before = now - NOT_BEFORE_SKEW;
        params.not_after = now + validity;
        csr.params = params;
        let cert = csr.signed_by(&self.issuer).map_err(sign)?;
        let parsed = parse_peer(cert.der()).map_err(IssueError::Sign)?;
        Ok(Issued {
            pem: cert.pem(),
            fingerprint: parsed.fingerprint,
            not_after: parsed.not_after,
        })
    }

    /// The CA certificate, DER (the peer link's trust anchor).
    pub(crate) fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// Issues this replica's peer-link certificate for a new key: CN `tether relay replica ID`, SAN URI
    /// `tether://replica/ID` and DNS `ID.replica.tether.invalid`, EKU server and client auth, valid from a
    /// little before `now` for `validity`. Returns the certificate and the key, PEM.
    pub(crate) fn issue_replica(
        &self,
        replica: &str,
        validity: std::time::Duration,
        now: OffsetDateTime,
    ) -> Result<(String, String), IssueError> {
        let sign = |e: rcgen::Error| IssueError::Sign(e.to_string());
        let key = KeyPair::generate().map_err(sign)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            format!("tether relay replica {replica}"),
        );
        params.distinguished_name = dn;
        params.subject_alt_names = vec![
            SanType::URI(
                format!("{REPLICA_URI_PREFIX}{replica}")
                    .try_into()
                    .map_err(sign)?,
            ),
            SanType::DnsName(
                format!("{replica}{REPLICA_NAME_SUFFIX}")
                    .try_into()
                    .map_err(sign)?,
            ),
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let mut serial = [0u8; 16];
        rand::fill(&mut serial);
        serial[0] = (serial[0] & 0x7f) | 0x40;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let validity = Duration::try_from(validity)
            .map_err(|e| IssueError::Sign(format!("validity out of range: {e}")))?;
        params.not_before = now - NOT_BEFORE_SKEW;
        params.not_after = now + validity;
        let cert = params.signed_by(&key, &self.issuer).map_err(sign)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// The listener's client-certificate verifier: see [`AgentCertVerifier`].
    pub(crate) fn verifier(&self) -> Result<Arc<dyn ClientCertVerifier>, RelayError> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.cert_der.clone())
            .map_err(|e| RelayError::Tls(format!("unusable agent CA: {e}")))?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .allow_unauthenticated()
            .build()
            .map_err(|e| RelayError::Tls(format!("agent CA verifier: {e}")))?;
        Ok(Arc::new(AgentCertVerifier { inner }))
    }
}

/// Client-certificate verification for the relay's listener.
///
/// - A client certificate is asked for (with the agent CA as the acceptable issuer, so clients such as Go's
///   `crypto/tls` that pick a certificate by issuer send none) but not required: users and operators have none.
/// - A certificate is accepted only if it chains to the agent CA. A chain that fails *only* because it expired
///   is accepted too (verified again at its own `notAfter`), so that the tunnel endpoint can refuse it with a
///   reason ("identity expired") rather than a TLS alert the agent cannot explain.
/// - The handshake signature is always checked: the client holds the certificate's key.
///
/// Accepting a certificate here authorises nothing: the tunnel endpoint checks the name, the fingerprint the
/// store holds for the cluster, and the expiry; the other endpoints ignore client certificates.
#[derive(Debug)]
struct AgentCertVerifier {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for AgentCertVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[TlsName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        match self
            .inner
            .verify_client_cert(end_entity, intermediates, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::Expired | CertificateError::ExpiredContext { .. },
            )) => {
                let not_after = parse_peer(end_entity)
                    .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?
                    .not_after
                    .unix_timestamp();
                let at = UnixTime::since_unix_epoch(std::time::Duration::from_secs(
                    u64::try_from(not_after).unwrap_or(0),
                ));
                self.inner.verify_client_cert(end_entity, intermediates, at)
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr(subject_cn: &str) -> anyhow::Result<(KeyPair, String)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["evil.example.com".to_string()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, subject_cn);
        let pem = params.serialize_request(&key)?.pem()?;
        Ok((key, pem))
    }

    fn der(pem: &str) -> anyhow::Result<CertificateDer<'static>> {
        rustls_pemfile::certs(&mut pem.as_bytes())
            .next()
            .ok_or_else(|| anyhow::anyhow!("no certificate"))?
            .map_err(Into::into)
    }

    fn unix(t: OffsetDateTime) -> UnixTime {
        UnixTime::since_unix_epoch(std::time::Duration::from_secs(t.unix_timestamp() as u64))
    }

    #[test]
    fn issues_the_clusters_name_not_the_csrs() -> anyhow::Result<()> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let ca = AgentCa::load_or_generate(dir.path())?;
        let (_key, csr) = csr("prod")?;
        let now = OffsetDateTime::now_utc();
        let issued = ca.issue("edge", &csr, std::time::Duration::from_secs(3600), now)?;
        let peer = parse_peer(&der(&issued.pem)?).map_err(anyhow::Error::msg)?;
        assert_eq!(peer.cluster.as_deref(), Some("edge"));
        assert_eq!(peer.common_name.as_deref(), Some("edge"));
        assert!(peer.names("edge") && !peer.names("prod"));
        assert_eq!(peer.fingerprint, issued.fingerprint);
        assert_eq!(peer.not_after, issued.not_after);
        let expected = (now + Duration::hours(1)).unix_timestamp();
        assert!((issued.not_after.unix_timestamp() - expected).abs() <= 1);

        let cert_der = der(&issued.pem)?;
        let (_, cert) =
            x509_parser::parse_x509_certificate(&cert_der).map_err(|e| anyhow::anyhow!("{e}"))?;
        let eku = cert
            .extended_key_usage()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .ok_or_else(|| anyhow::anyhow!("no EKU"))?;
        assert!(eku.value.client_auth && !eku.value.server_auth);
        let sans = cert
            .subject_alternative_name()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .ok_or_else(|| anyhow::anyhow!("no SAN"))?;
        assert_eq!(
            sans.value.general_names.len(),
            1,
            "the CSR's DNS SAN is dropped"
        );

        // Two issues for the same key differ (random serial).
        let again = ca.issue("edge", &csr, std::time::Duration::from_secs(3600), now)?;
        assert_ne!(again.fingerprint, issued.fingerprint);
        Ok(())
    }

    #[test]
    fn a_tampered_or_garbage_csr_is_refused() -> anyhow::Result<()> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let ca = AgentCa::load_or_generate(dir.path())?;
        let validity = std::time::Duration::from_secs(60);
        let now = OffsetDateTime::now_utc();
        assert!(matches!(
            ca.issue("edge", "not a csr", validity, now),
            Err(IssueError::InvalidCsr(_))
        ));
        // Flip one byte of the signed body: the CSR's signature no longer verifies.
        let (_key, pem) = csr("x")?;
        let block = pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect::<String>();
        use base64::Engine;
        let engine = base64::engine::general_purpose::STANDARD;
        let mut raw = engine.decode(block)?;
        let i = raw.len() / 3;
        raw[i] ^= 0x01;
        let tampered = format!(
            "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
            engine.encode(raw)
        );
        assert!(matches!(
            ca.issue("edge", &tampered, validity, now),
            Err(IssueError::InvalidCsr(_))
        ));
        Ok(())
    }

    #[test]
    fn the_ca_is_generated_once_with_a_private_key() -> anyhow::Result<()> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let first = AgentCa::load_or_generate(dir.path())?;
        let second = AgentCa::load_or_generate(dir.path())?;
        assert_eq!(first.cert_der, second.cert_der);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(AGENT_CA_KEY))?
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // A certificate from the reloaded CA verifies against the first one's verifier.
        let (_key, csr) = csr("edge")?;
        let now = OffsetDateTime::now_utc();
        let issued = second.issue("edge", &csr, std::time::Duration::from_secs(60), now)?;
        first
            .verifier()?
            .verify_client_cert(&der(&issued.pem)?, &[], unix(now))?;
        Ok(())
    }

    #[test]
    fn the_verifier_accepts_expired_chains_but_not_foreign_ones() -> anyhow::Result<()> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let ca = AgentCa::load_or_generate(dir.path())?;
        let verifier = ca.verifier()?;
        assert!(verifier.offer_client_auth());
        assert!(!verifier.client_auth_mandatory());
        assert!(!verifier.root_hint_subjects().is_empty());

        let (_key, csr_pem) = csr("edge")?;
        let now = OffsetDateTime::now_utc();
        let issued = ca.issue("edge", &csr_pem, std::time::Duration::from_secs(60), now)?;
        let cert = der(&issued.pem)?;
        // Long after expiry (virtual time: the verifier takes `now`).
        verifier.verify_client_cert(&cert, &[], unix(now + Duration::days(30)))?;
        // Before it is valid: not only expired, refused.
        assert!(
            verifier
                .verify_client_cert(&cert, &[], unix(now - Duration::days(1)))
                .is_err()
        );

        // Same name, another CA.
        let other_dir = tempfile::tempdir()?;
        let other = AgentCa::load_or_generate(other_dir.path())?;
        let foreign = other.issue("edge", &csr_pem, std::time::Duration::from_secs(60), now)?;
        assert!(
            verifier
                .verify_client_cert(&der(&foreign.pem)?, &[], unix(now))
                .is_err()
        );
        let foreign_expired =
            verifier.verify_client_cert(&der(&foreign.pem)?, &[], unix(now + Duration::days(30)));
        assert!(
            foreign_expired.is_err(),
            "expiry must not hide a bad issuer"
        );
        Ok(())
    }
}
