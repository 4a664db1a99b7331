//! Small certificate helpers on top of rcgen: a throwaway CA, server and client certificates it signs, PEM files,
//! and a rustls server configuration. Usable by any test that needs TLS material.
//!
//! Keys are ECDSA P-256 (rcgen's default). Certificates are valid from one hour ago for one year.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Why certificate material could not be made, written or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen refused to generate a key or certificate.
    #[error("cannot generate certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A subject alternative name is neither an IP address nor a valid DNS name.
    #[error("invalid subject alternative name {0:?}")]
    InvalidName(String),
    /// A PEM file could not be written or read.
    #[error("cannot access {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The PEM text held no usable certificate or key.
    #[error("invalid PEM: {0}")]
    InvalidPem(String),
    /// rustls rejected the certificate or key.
    #[error("TLS configuration rejected: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A certificate and its private key, both as PEM text.
#[derive(Clone)]
pub struct CertifiedPem {
    /// The certificate (one PEM block).
    pub cert_pem: String,
    /// The PKCS#8 private key (one PEM block).
    pub key_pem: String,
    cert_der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl CertifiedPem {
    /// The certificate in DER form.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    /// The private key in DER (PKCS#8) form.
    pub fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl std::fmt::Debug for CertifiedPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertifiedPem")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"***")
            .finish()
    }
}

/// A self-signed certificate authority that can sign server and client certificates.
pub struct Ca {
    pem: CertifiedPem,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("cert_pem", &self.pem.cert_pem)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// Generates a new CA whose subject common name is `common_name`.
    pub fn new(common_name: &str) -> Result<Ca, CertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(common_name, &[]);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut params);
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        let pem = CertifiedPem {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().clone(),
            key_der: key.serialize_der(),
        };
        Ok(Ca {
            pem,
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate as PEM text (what clients trust).
    pub fn cert_pem(&self) -> &str {
        &self.pem.cert_pem
    }

    /// The CA certificate and key.
    pub fn certified(&self) -> &CertifiedPem {
        &self.pem
    }

    /// Issues a server certificate for `names` (DNS names and/or IP addresses); the first is the common name.
    pub fn issue_server(&self, names: &[String]) -> Result<CertifiedPem, CertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name =
            name(names.first().map(String::as_str).unwrap_or("server"), &[]);
        params.subject_alt_names = names.iter().map(|n| san(n)).collect::<Result<_, _>>()?;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params);
        self.sign(&params)
    }

    /// Issues a client certificate with common name `user` and organizations `groups` (how Kubernetes maps
    /// client certificates to a user and groups).
    pub fn issue_client(&self, user: &str, groups: &[&str]) -> Result<CertifiedPem, CertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(user, groups);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params);
        self.sign(&params)
    }

    fn sign(&self, params: &CertificateParams) -> Result<CertifiedPem, CertError> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertifiedPem {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().clone(),
            key_der: key.serialize_der(),
        })
    }
}

fn name(common_name: &str, organizations: &[&str]) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    for org in organizations {
        dn.push(DnType::OrganizationName, *org);
    }
    dn
}

fn san(name: &str) -> Result<SanType, CertError> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'*'));
    if !valid {
        return Err(CertError::InvalidName(name.to_string()));
    }
    let dns = name
        .to_string()
        .try_into()
        .map_err(|_| CertError::InvalidName(name.to_string()))?;
    Ok(SanType::DnsName(dns))
}

fn set_validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(365);
}

/// Writes PEM text to `path`, readable by the owner only where the platform supports it (keys are secrets).
pub fn write_pem(path: &Path, pem: &str) -> Result<(), CertError> {
    write_private(path, pem.as_bytes())
}

/// Writes `bytes` to `path` with mode 0600 on Unix.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), CertError> {
    let io_err = |source| CertError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(io_err)?;
    std::io::Write::write_all(&mut file, bytes).map_err(io_err)
}

/// Parses every certificate in PEM text.
pub fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let certs = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::InvalidPem(e.to_string()))?;
    if certs.is_empty() {
        return Err(CertError::InvalidPem("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// Parses the first private key in PEM text.
pub fn parse_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, CertError> {
    rustls_pemfile::private_key(&mut &pem[..])
        .map_err(|e| CertError::InvalidPem(e.to_string()))?
        .ok_or_else(|| CertError::InvalidPem("no PRIVATE KEY block".into()))
}

/// A rustls server configuration (aws-lc-rs provider, ALPN `h2` and `http/1.1`) for a certificate chain and key.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<rustls::ServerConfig>, CertError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A rustls client configuration (aws-lc-rs provider) trusting only the CA certificates in `ca_pem`.
pub fn client_config(
    ca_pem: &[u8],
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>, CertError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in parse_certs(ca_pem)? {
        roots.add(cert)?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_cert_chains_to_ca_and_round_trips_through_pem() -> Result<(), CertError> {
        let ca = Ca::new("test-ca")?;
        let server = ca.issue_server(&["localhost".into(), "127.0.0.1".into(), "::1".into()])?;
        assert!(server.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert_eq!(
            parse_certs(server.cert_pem.as_bytes())?,
            vec![server.cert_der()]
        );
        parse_key(server.key_pem.as_bytes())?;
        server_config(vec![server.cert_der()], server.key_der())?;
        client_config(ca.cert_pem().as_bytes(), &[b"h2"])?;
        Ok(())
    }

    #[test]
    fn rejects_bad_names_and_pem() {
        let ca = Ca::new("test-ca");
        assert!(matches!(
            ca.map(|ca| ca.issue_server(&["not a name".into()])),
            Ok(Err(CertError::InvalidName(_)))
        ));
        assert!(parse_certs(b"garbage").is_err());
        assert!(parse_key(b"").is_err());
    }

    #[test]
    fn debug_hides_the_key() -> Result<(), CertError> {
        let ca = Ca::new("test-ca")?;
        let text = format!("{:?}", ca.issue_client("alice", &["dev"])?);
        assert!(text.contains("***"));
        assert!(!text.contains("PRIVATE KEY"));
        Ok(())
    }
}
