//! Why a client could not be made, and why a payment could not be made at
//! all. Both may gain variants in a later version.

use crate::journal::JournalError;

/// Why [`ClientBuilder::build`](crate::ClientBuilder::build) made no client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A client needs somewhere to send payments.
    #[error("no region URL: a client needs at least one")]
    NoRegions,
    /// A region URL that does not parse.
    #[error("region URL {url:?} is not a URL")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: url::ParseError,
    },
    /// Every request carries the API key and a payment: over plain `http`
    /// to another machine both could be read or changed on the way.
    #[error(
        "region URL {url:?} is not https: the API key and the payment would cross the network in clear \
         (plain http is for localhost, 127.0.0.0/8 and ::1 only)"
    )]
    NotHttps {
        /// The URL as given.
        url: String,
    },
    /// The journal could not be opened (or another process holds it).
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The HTTP client could not be set up (its TLS roots, for one).
    #[error("the HTTP client could not be set up")]
    Http(#[source] reqwest::Error),
}

/// Why a payment could not be made at all. None of these is a lost or
/// unknown outcome: each means keyfence refused the request as it stands.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PayError {
    /// `422`: this key was used before with a different request. A
    /// programming error on the caller's side: one operation, one request.
    #[error("idempotency key {key} was already used for a different request: {detail}")]
    KeyReused {
        /// The key that was sent.
        key: String,
        /// keyfence's explanation.
        detail: String,
    },
    /// `400`, `401`, `404`, `413`, a redirect and the like: retrying cannot
    /// help.
    #[error("keyfence refused the payment ({status}): {detail}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// keyfence's explanation.
        detail: String,
    },
    /// The journal could not be read or written; nothing was sent.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// `pay` needs a journal to keep keys in; `pay_with_key` does not.
    #[error("no journal: build the client with .journal(path) to pay by operation")]
    NoJournal,
}
