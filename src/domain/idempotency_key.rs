//! `IdempotencyKey`: the client-supplied key, validated at the edge. It is
//! untrusted input that becomes part of a storage key, so its length and
//! alphabet are restricted.

use std::fmt;

/// The longest key accepted, in bytes (all accepted characters are ASCII).
pub const MAX_LEN: usize = 255;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKey {
    #[error("the idempotency key is empty")]
    Empty,
    #[error("the idempotency key is longer than {MAX_LEN} characters")]
    TooLong,
    #[error("the idempotency key may contain only ASCII letters, digits and '-', '_', '.', ':'")]
    BadCharacter,
}

impl IdempotencyKey {
    pub fn parse(raw: &str) -> Result<Self, InvalidKey> {
        if raw.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if raw.len() > MAX_LEN {
            return Err(InvalidKey::TooLong);
        }
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
        if !raw.chars().all(allowed) {
            return Err(InvalidKey::BadCharacter);
        }
        Ok(Self(raw.to_owned()))
    }

    /// The key as an `Idempotency-Key` header carries it: bare, or as a
    /// Structured Field string (`"…"`, what the IETF draft specifies). Both
    /// forms of one value are the same key; anything else (an unclosed
    /// quote, parameters, escapes) is refused, as is any character a key
    /// may not hold.
    pub fn from_header(raw: &str) -> Result<Self, InvalidKey> {
        match raw.strip_prefix('"') {
            Some(quoted) => match quoted.strip_suffix('"') {
                Some(inner) if !inner.is_empty() => Self::parse(inner),
                Some(_) => Err(InvalidKey::Empty),
                None => Err(InvalidKey::BadCharacter),
            },
            None => Self::parse(raw),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_may_quote_the_key_as_a_structured_field_string() {
        let bare = IdempotencyKey::from_header("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap();
        let quoted = IdempotencyKey::from_header("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").unwrap();
        assert_eq!(bare, quoted, "one key, two spellings");
        for ambiguous in ["\"abc", "abc\"", "\"a\"b\"", "\"a\\\"b\"", "\"abc\";p=1", "\"\"", "\""] {
            assert!(IdempotencyKey::from_header(ambiguous).is_err(), "{ambiguous}");
        }
    }

    #[test]
    fn accepts_uuids_and_simple_references() {
        for raw in ["8e0f7a4c-5b1d-4f8e-9a52-3f0c2f1e9b77", "order-123", "a", "batch:7.row_9"] {
            assert_eq!(IdempotencyKey::parse(raw).unwrap().as_str(), raw);
        }
        assert!(IdempotencyKey::parse(&"k".repeat(MAX_LEN)).is_ok());
    }

    #[test]
    fn rejects_empty_long_and_foreign_characters() {
        assert_eq!(IdempotencyKey::parse(""), Err(InvalidKey::Empty));
        assert_eq!(IdempotencyKey::parse(&"k".repeat(MAX_LEN + 1)), Err(InvalidKey::TooLong));
        for raw in ["a b", "a#b", "ключ", "a/b", "a\n", "' OR 1=1"] {
            assert_eq!(IdempotencyKey::parse(raw), Err(InvalidKey::BadCharacter), "{raw:?}");
        }
    }
}
