//! The peer link's trust: mutual TLS between relay replicas, with certificates each replica issues itself at
//! startup from the agent CA the fleet shares.
//!
//! A replica's certificate names it twice — SAN URI `tether://replica/ID` and DNS `ID.replica.tether.invalid` —
//! with EKU server and client auth. Each side checks the other's chain against the agent CA (and nothing
//! else) *and* requires the replica URI:
//! - the peer listener requires a client certificate ([`ReplicaClientVerifier`]): no certificate, a chain
//!   from another CA, or an agent CA certificate without a replica URI (an agent's cluster identity, whose
//!   only URI is `tether://cluster/NAME`) ends the handshake;
//! - a replica dialing a peer checks the chain and the DNS name it dialed (`ID.replica.tether.invalid`, ID
//!   from the store's route), then that the replica URI names the same ID ([`ReplicaServerVerifier`]), so a
//!   request meant for replica A never goes to whatever else answers at A's old address.
//!
//! What it does not do: decide what a peer may ask (the peer handler serves only user requests, over local
//! tunnels, with a plausible credential).

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore};
use time::OffsetDateTime;

use crate::config::valid_replica_id;
use crate::error::RelayError;
use crate::identity::{AgentCa, REPLICA_NAME_SUFFIX, REPLICA_URI_PREFIX};

/// How long a replica's peer-link certificate is valid (a new key and certificate at every start).
const REPLICA_CERT_VALIDITY: std::time::Duration = std::time::Duration::from_secs(365 * 86_400);

/// The DNS name a replica is dialed by on the peer link.
pub(crate) fn server_name(replica: &str) -> String {
    format!("{replica}{REPLICA_NAME_SUFFIX}")
}

/// The replica a certificate names: its one `tether://replica/ID` URI with a valid ID, and no other
/// `tether://` URI. `None` for anything else (an agent's cluster identity included).
pub(crate) fn replica_of(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let mut replicas = Vec::new();
    for name in &san.value.general_names {
        if let x509_parser::extensions::GeneralName::URI(uri) = name {
            match uri.strip_prefix(REPLICA_URI_PREFIX) {
                Some(id) => replicas.push(id.to_owned()),
                None if uri.starts_with("tether://") => return None,
                None => {}
            }
        }
    }
    match replicas.as_slice() {
        [one] if valid_replica_id(one) => Some(one.clone()),
        _ => None,
    }
}

/// This replica's peer-link identity: certificate and key, PEM (`Debug` hides the key).
pub(crate) struct ReplicaIdentity {
    cert_pem: String,
    key_pem: String,
    /// The agent CA: the only trust anchor of the peer link.
    roots: Arc<RootCertStore>,
}

impl std::fmt::Debug for ReplicaIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaIdentity")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

fn tls(what: &str, e: impl std::fmt::Display) -> RelayError {
    RelayError::Tls(format!("peer link: {what}: {e}"))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

impl ReplicaIdentity {
    /// Issues replica `id`'s certificate from `ca`, for a key made now.
    pub(crate) fn issue(ca: &AgentCa, id: &str) -> Result<ReplicaIdentity, RelayError> {
        let (cert_pem, key_pem) = ca
            .issue_replica(id, REPLICA_CERT_VALIDITY, OffsetDateTime::now_utc())
            .map_err(|e| tls("issuing this replica's certificate", e))?;
        let mut roots = RootCertStore::empty();
        roots
            .add(ca.cert_der().clone())
            .map_err(|e| tls("unusable agent CA", e))?;
        Ok(ReplicaIdentity {
            cert_pem,
            key_pem,
            roots: Arc::new(roots),
        })
    }

    fn chain_and_key(
        &self,
    ) -> Result<
        (
            Vec<CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        ),
        RelayError,
    > {
        let chain = rustls_pemfile::certs(&mut self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls("own certificate", e))?;
        let key = rustls_pemfile::private_key(&mut self.key_pem.as_bytes())
            .map_err(|e| tls("own key", e))?
            .ok_or_else(|| tls("own key", "missing"))?;
        Ok((chain, key))
    }

    /// The peer listener's TLS: this replica's certificate, a client certificate required and checked by
    /// [`ReplicaClientVerifier`], ALPN `h2` and `http/1.1`.
    pub(crate) fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, RelayError> {
        let inner = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .map_err(|e| tls("client verifier", e))?;
        let (chain, key) = self.chain_and_key()?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls("protocol versions", e))?
            .with_client_cert_verifier(Arc::new(ReplicaClientVerifier { inner }))
            .with_single_cert(chain, key)
            .map_err(|e| tls("server certificate", e))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// The TLS of a connection to a peer: this replica's certificate as the client's, the server checked by
    /// [`ReplicaServerVerifier`]; ALPN is left to the connector (h2, or http/1.1 for upgrades).
    pub(crate) fn client_config(&self) -> Result<rustls::ClientConfig, RelayError> {
        let inner = WebPkiServerVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .map_err(|e| tls("server verifier", e))?;
        let (chain, key) = self.chain_and_key()?;
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls("protocol versions", e))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ReplicaServerVerifier { inner }))
            .with_client_auth_cert(chain, key)
            .map_err(|e| tls("client certificate", e))
    }
}

/// The peer listener's client verification: a certificate is required, must chain to the agent CA (the
/// webpki verifier, client auth usage), and must name a replica ([`replica_of`]).
#[derive(Debug)]
struct ReplicaClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for ReplicaClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if replica_of(end_entity).is_none() {
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ));
        }
        Ok(verified)
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

/// A peer's server verification: the webpki verifier (chain to the agent CA, server auth usage, the DNS
/// name dialed), then the replica URI must name the replica that DNS name names.
#[derive(Debug)]
struct ReplicaServerVerifier {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ReplicaServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let dialed = match server_name {
            ServerName::DnsName(name) => name.as_ref().strip_suffix(REPLICA_NAME_SUFFIX),
            _ => None,
        };
        match (dialed, replica_of(end_entity)) {
            (Some(dialed), Some(named)) if dialed == named => Ok(verified),
            _ => Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName,
            )),
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

    fn der(pem: &str) -> CertificateDer<'static> {
        rustls_pemfile::certs(&mut pem.as_bytes())
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| CertificateDer::from(Vec::new()))
    }

    #[test]
    fn replica_certificates_name_their_replica_and_cluster_ones_do_not() -> anyhow::Result<()> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let ca = AgentCa::load_or_generate(dir.path())?;
        let me = ReplicaIdentity::issue(&ca, "relay-a")?;
        assert_eq!(replica_of(&der(&me.cert_pem)).as_deref(), Some("relay-a"));
        assert!(
            !format!("{me:?}").contains("PRIVATE"),
            "the key is not printed"
        );
        // An agent's identity from the same CA names a cluster, never a replica.
        let key = rcgen::KeyPair::generate()?;
        let csr = rcgen::CertificateParams::new(Vec::<String>::new())?
            .serialize_request(&key)?
            .pem()?;
        let issued = ca.issue(
            "edge",
            &csr,
            std::time::Duration::from_secs(60),
            OffsetDateTime::now_utc(),
        )?;
        assert_eq!(replica_of(&der(&issued.pem)), None);
        assert_eq!(server_name("relay-a"), "relay-a.replica.tether.invalid");
        Ok(())
    }
}
