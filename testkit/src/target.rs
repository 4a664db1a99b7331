//! Which object a resource request addresses: the router parses it, the handlers act on it.

use crate::resources::Resource;

/// Which object a resource request addresses.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Target {
    pub(crate) resource: Resource,
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) subresource: Option<String>,
}
