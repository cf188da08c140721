//! The engine: the idempotency protocol itself. It claims a key (or branches
//! on the item a failed claim returns), then drives an [`Operation`] through
//! its steps: local phases, each one fenced ledger transaction, and external
//! calls, each bracketed by an intent committed before and an outcome
//! committed after. A request taken over from a dead owner resumes at its
//! recovery point; nothing committed ever runs again.
//!
//! Data flows one way: callers (the HTTP layer, the recovery worker) call in;
//! the engine calls the key store, the ledger and the rails.

mod answers;
mod derived_key;
mod error;
mod holds;
mod lease;
mod moved;
mod operation;
mod recover;
mod run;
mod submit;

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

use crate::domain::{Retention, SharedClock, StoredResponse};
use crate::ledger::Ledger;
use crate::rail::RailClient;
use crate::regions::RegionView;

pub use derived_key::derived_key;
pub use error::{Cause, EngineError, Fenced};
pub use moved::{Moved, moved_away};
pub use operation::{ExternalStep, Operation, Step, StepContext};
pub use recover::Recovery;
pub use submit::Submission;

/// The external systems operations call, by the names their steps give
/// them ([`ExternalStep::rail`]).
#[derive(Clone, Debug)]
pub struct Rails(BTreeMap<&'static str, RailClient>);

impl Rails {
    /// Each client under its own name.
    pub fn new(clients: impl IntoIterator<Item = RailClient>) -> Self {
        Self(clients.into_iter().map(|client| (client.name(), client)).collect())
    }

    fn get(&self, rail: &str) -> Result<&RailClient, EngineError> {
        self.0.get(rail).ok_or_else(|| EngineError::Fault(format!("no rail named {rail} is configured")))
    }
}

/// How this instance takes part in the protocol.
#[derive(Clone, Debug)]
pub struct EngineSettings {
    /// The region this instance works in; requests first claimed elsewhere
    /// are only replayed here, never worked, unless their region has been
    /// declared failed: then they are taken over and worked here.
    pub region: String,
    /// Names this instance in every lease it holds.
    pub instance: String,
    /// How long a lease lasts without a heartbeat.
    pub lease: Duration,
    /// How long a finished key is kept (its DynamoDB time-to-live), and
    /// the margin for clock skew around its end.
    pub retention: Retention,
    /// After this many attempts with an unknown outcome, a request is
    /// marked indeterminate and listed for settlement (it is still probed).
    pub max_unknown_attempts: i32,
    /// How long the recovery worker leaves a parked request before probing it again.
    pub probe_backoff: crate::domain::ProbeBackoff,
    /// The largest final answer a request may store, in bytes
    /// ([`StoredResponse::size`](crate::domain::StoredResponse::size)).
    pub answer_limit: usize,
    /// What leases, expiry and holds are reckoned by.
    pub clock: SharedClock,
}

/// The engine, over any key store (DynamoDB in the service).
pub struct Engine<K> {
    keys: K,
    ledger: Ledger,
    rails: Rails,
    regions: RegionView,
    settings: EngineSettings,
    /// Finished answers seen here, so a replay needs no key-store read.
    answers: answers::Answers,
}

/// What a submission came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The final answer, worked now or replayed from an earlier attempt.
    Final { response: StoredResponse, replayed: bool },
    /// Another attempt holds the key; retry after this long.
    InFlight { retry_after: Duration },
    /// The key was used before with another request.
    Mismatch,
    /// An external outcome is unknown: the request is parked, resumable,
    /// and must not be reported as failed.
    Pending { payment_id: Uuid },
    /// The operation's hold ([`Operation::hold`]) is more than its balance
    /// has left: nothing was held, committed or stored, so the same request
    /// may succeed later (once another hold is released).
    Exceeded { left: i64 },
}

impl<K> Engine<K> {
    pub fn new(keys: K, ledger: Ledger, rails: Rails, regions: RegionView, settings: EngineSettings) -> Self {
        Self { keys, ledger, rails, regions, settings, answers: answers::Answers::new() }
    }

    pub fn regions(&self) -> &RegionView {
        &self.regions
    }

    pub fn keys(&self) -> &K {
        &self.keys
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The region this engine works in.
    pub fn region(&self) -> &str {
        &self.settings.region
    }

    /// The name this instance holds leases under.
    pub fn instance(&self) -> &str {
        &self.settings.instance
    }

    /// How long finished keys are kept.
    pub fn retention(&self) -> Retention {
        self.settings.retention
    }

    /// The clock this engine reckons leases, expiry and holds by.
    pub fn clock(&self) -> &SharedClock {
        &self.settings.clock
    }
}
