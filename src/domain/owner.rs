//! `Owner`: who holds a key's lease. One value per attempt (instance id plus a
//! random suffix), so a retried write that already succeeded can recognise
//! its own earlier success instead of mistaking it for a rival's.

use std::fmt;

use uuid::Uuid;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner(String);

impl Owner {
    /// A fresh owner identity for one attempt by the named instance.
    pub fn attempt_of(instance: &str) -> Self {
        Self(format!("{instance}/{}", Uuid::new_v4().simple()))
    }

    /// An owner identity read back from storage.
    pub fn from_stored(raw: String) -> Self {
        Self(raw)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
