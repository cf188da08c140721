//! The secrets the rails sign their notifications with (Standard Webhooks
//! secrets, `whsec_` and base64), by the name a rail has in its path (`e1`,
//! `e2`): a rail without one is not listened to. Never printed.

use std::collections::BTreeMap;

/// Each rail's notification secret, by the rail's name.
#[derive(Clone, Default)]
pub struct RailSecrets(BTreeMap<String, String>);

impl RailSecrets {
    pub fn new(secrets: BTreeMap<String, String>) -> Self {
        Self(secrets)
    }

    pub fn get(&self, rail: &str) -> Option<&str> {
        self.0.get(rail).map(String::as_str)
    }
}

/// Never shows a secret.
impl std::fmt::Debug for RailSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}
