//! The secret every region of a deployment shares: it signs what one region
//! asks of another and what the other answers (see `http::signed`). At
//! least 32 bytes, never printed. While it is rotated, a second secret is
//! accepted beside it (never signed with), so that no region refuses
//! another's reads: first every region accepts the new secret, then every
//! region signs with it (accepting the old), then the old one goes.

use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The shortest region secret accepted, in bytes.
const MIN_SECRET: usize = 32;

/// The secret every region of a deployment shares. Never printed.
#[derive(Clone)]
pub struct RegionSecret {
    signing: Arc<[u8]>,
    /// Also accepted, during a rotation.
    accepted: Option<Arc<[u8]>>,
}

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
        Ok(Self { signing: raw.as_bytes().into(), accepted: None })
    }

    /// This secret, accepting `other`'s signatures too (a rotation).
    pub fn also_accepting(self, other: &RegionSecret) -> Self {
        Self { accepted: Some(other.signing.clone()), ..self }
    }

    /// An HMAC-SHA256 under the signing secret over `fields`, each with its
    /// length first, so no two lists of fields sign alike.
    pub(crate) fn mac(&self, fields: &[&[u8]]) -> Hmac<Sha256> {
        keyed(&self.signing, fields)
    }

    /// Whether `signature` is the HMAC of `fields` under the signing secret
    /// or the one also accepted.
    pub(crate) fn verifies(&self, fields: &[&[u8]], signature: &[u8]) -> bool {
        std::iter::once(&self.signing)
            .chain(&self.accepted)
            .any(|secret| keyed(secret, fields).verify_slice(signature).is_ok())
    }
}

fn keyed(secret: &[u8], fields: &[&[u8]]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    for field in fields {
        mac.update(&(field.len() as u64).to_be_bytes());
        mac.update(field);
    }
    mac
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
    fn a_second_secret_is_accepted_and_never_signed_with() {
        let old = RegionSecret::new("the secret every region signs with today").unwrap();
        let new = RegionSecret::new("the secret every region will sign with next").unwrap();
        let fields: &[&[u8]] = &[b"request", b"GET"];
        let by = |secret: &RegionSecret| secret.mac(fields).finalize().into_bytes();
        let rotating = old.clone().also_accepting(&new);
        assert!(rotating.verifies(fields, &by(&old)) && rotating.verifies(fields, &by(&new)));
        assert_eq!(by(&rotating), by(&old), "signed with its own");
        assert!(!old.verifies(fields, &by(&new)), "not accepted without the rotation");
    }

    #[test]
    fn fields_are_signed_with_their_lengths() {
        let secret = RegionSecret::new("a deployment-wide secret of 32 bytes or more").unwrap();
        let of = |fields: &[&[u8]]| secret.mac(fields).finalize().into_bytes();
        assert_ne!(of(&[b"ab", b"c"]), of(&[b"a", b"bc"]));
    }
}
