//! The shared test identity provider (`tether_testkit::idp`: an Entra-shaped HTTPS IdP and tokens minted by
//! PyJWT, an implementation independent of ours) with the agent's Entra settings for it.

use std::path::Path;

use anyhow::Result;

#[allow(unused_imports)]
pub use tether_testkit::idp::{ALICE, ALICE_GROUPS, ALICE_OID, Idp, Minted, TENANT};

pub const AUDIENCE: &str = "api://tether-guard";

/// Whether python3 with PyJWT is here: under CI its absence fails the test, elsewhere a printed skip.
pub fn pyjwt_available() -> bool {
    tether_testkit::tools::require(tether_testkit::tools::Tool::PyJwt).is_some()
}

/// Mints the test token set for this IdP and publishes its keys `k1` and `e1`.
pub fn mint(idp: &Idp) -> Result<Minted> {
    let minted = tether_testkit::idp::mint(idp, AUDIENCE)?;
    idp.set_keys(vec![minted.key("k1"), minted.key("e1")]);
    Ok(minted)
}

/// The agent's Entra settings for this IdP.
pub fn entra_config(idp: &Idp, dir: &Path) -> Result<tether_agent::EntraConfig> {
    Ok(tether_agent::EntraConfig {
        tenants: vec![TENANT.to_owned()],
        audiences: vec![AUDIENCE.to_owned()],
        authority: Some(idp.v2_authority()),
        authority_ca: Some(idp.write_ca(dir)?),
        ..Default::default()
    })
}
