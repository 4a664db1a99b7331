//! Throwaway TLS material: a CA and a server certificate for the upstream (like an apiserver's), and key
//! pairs with CSRs for simulated agents.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A CA and a server certificate for `127.0.0.1` and `localhost`, as PEM.
#[derive(Clone)]
pub struct ServerTls {
    /// The CA certificate clients trust.
    pub ca_pem: String,
    /// The server's certificate.
    pub cert_pem: String,
    /// The server's private key.
    pub key_pem: String,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("key_pem", &"***")
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Generates a fresh CA and a server certificate signed by it (ECDSA P-256, valid for a day).
    pub fn generate() -> anyhow::Result<Self> {
        let now = time::OffsetDateTime::now_utc();
        let mut ca = CertificateParams::default();
        ca.distinguished_name = common_name("tether-loadtest upstream CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        ca.not_before = now - time::Duration::hours(1);
        ca.not_after = now + time::Duration::days(1);
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);

        let mut server = CertificateParams::default();
        server.distinguished_name = common_name("127.0.0.1");
        server.subject_alt_names = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::DnsName("localhost".try_into()?),
        ];
        server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        server.not_before = now - time::Duration::hours(1);
        server.not_after = now + time::Duration::days(1);
        let key = KeyPair::generate()?;
        let cert = server.signed_by(&key, &issuer)?;
        Ok(Self {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A rustls server config for this certificate with ALPN `h2` and `http/1.1`.
    pub fn server_config(&self) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        let certs = parse_certs(self.cert_pem.as_bytes())?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).context("server key")?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

fn common_name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

/// The aws-lc-rs provider (the only one in the tree).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Every certificate in a PEM text.
pub fn parse_certs(pem: &[u8]) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .context("invalid PEM certificate")?;
    anyhow::ensure!(!certs.is_empty(), "no certificate in PEM");
    Ok(certs)
}

/// A TLS client config trusting every CA in `ca_pems`, with `alpn`, and optionally a client certificate.
pub fn client_config(
    ca_pems: &[&str],
    alpn: &[&[u8]],
    client_identity: Option<(&str, &str)>,
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for pem in ca_pems {
        for cert in parse_certs(pem.as_bytes())? {
            roots.add(cert)?;
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match client_identity {
        Some((cert_pem, key_pem)) => {
            let certs = parse_certs(cert_pem.as_bytes())?;
            let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).context("client key")?;
            builder.with_client_auth_cert(certs, key)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A fresh ECDSA P-256 key pair and a CSR for it (PEM), as an agent makes for onboarding.
pub fn key_and_csr(cluster: &str) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name(cluster);
    let csr = params.serialize_request(&key)?.pem()?;
    Ok((key.serialize_pem(), csr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_material_loads_into_rustls() -> anyhow::Result<()> {
        let tls = ServerTls::generate()?;
        tls.server_config()?;
        client_config(&[&tls.ca_pem], &[b"h2"], None)?;
        client_config(&[&tls.ca_pem], &[], Some((&tls.cert_pem, &tls.key_pem)))?;
        let (key, csr) = key_and_csr("c1")?;
        assert!(key.contains("PRIVATE KEY"));
        assert!(csr.contains("CERTIFICATE REQUEST"));
        assert!(!format!("{tls:?}").contains("PRIVATE"));
        Ok(())
    }
}
