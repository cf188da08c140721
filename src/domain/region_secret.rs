//! The secret every region of a deployment shares: it signs what one region
//! asks of another and what the other answers (see `http::signed`). At
//! least 32 bytes, never printed.

use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The shortest region secret accepted, in bytes.
const MIN_SECRET: usize = 32;

/// The secret every region of a deployment shares. Never printed.
#[derive(Clone)]
pub struct RegionSecret(Arc<[u8]>);

impl std::fmt::Debug for RegionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RegionSecret(..)")
    }
}

impl RegionSecret {
    /// A secret of at least 32 bytes (surrounding whitespace dropped).
    pub fn new(raw: &str) -> Result<Self, String> {
        let raw = raw.trim();
        if raw.len() < MIN_SECRET {
            return Err(format!("the region secret must be at least {MIN_SECRET} bytes"));
        }
        Ok(Self(raw.as_bytes().into()))
    }

    /// An HMAC-SHA256 under the secret over `fields`, each with its length
    /// first, so no two lists of fields sign alike.
    pub(crate) fn mac(&self, fields: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for field in fields {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_secret_is_refused_and_none_is_printed() {
        assert!(RegionSecret::new("short").is_err());
        let secret = RegionSecret::new("a deployment-wide secret of 32 bytes or more").unwrap();
        assert_eq!(format!("{secret:?}"), "RegionSecret(..)");
    }

    #[test]
    fn fields_are_signed_with_their_lengths() {
        let secret = RegionSecret::new("a deployment-wide secret of 32 bytes or more").unwrap();
        let of = |fields: &[&[u8]]| secret.mac(fields).finalize().into_bytes();
        assert_ne!(of(&[b"ab", b"c"]), of(&[b"a", b"bc"]));
    }
}
