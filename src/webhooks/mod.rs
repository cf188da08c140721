//! Webhooks: the endpoints a client registers to hear how its payments
//! end. Endpoints are global, like clients (one control item of the key
//! table per client, [`store`]), so a payment worked in any region notifies
//! the same endpoints. Each has a signing secret (`whsec_...`, the Standard
//! Webhooks form), shown once when made and rotatable with a grace during
//! which the previous one signs too. A URL is checked before it is kept
//! ([`target`]): https only, and never an address inside the deployment's
//! network, unless the operator allows it (a webhook sender is an SSRF
//! vector otherwise).
//!
//! Events are written by the phase that causes them ([`queue`]), and sent
//! after the commit by the delivery worker ([`worker`]): each event and
//! endpoint is a delivery of its own ([`deliveries`]) with a `webhook-id`
//! fixed once ([`webhook_id`]), signed the Standard Webhooks way
//! ([`crate::domain::webhook_signature`]), sent to checked addresses only ([`send`]) and retried
//! on a schedule ([`schedule`]).

pub mod deliveries;
pub mod names;
pub mod queue;
pub mod schedule;
pub mod sealing;
pub mod send;
mod settings;
pub mod store;
pub mod target;
pub mod worker;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::domain::WebhookSecret;

pub use names::Names;
pub use sealing::{Sealer, SealingSettings};
pub use settings::DeliverySettings;
pub use store::{EndpointStore, InClear, Issued, WebhooksError};
pub use target::TargetPolicy;

/// The events a client may subscribe to.
pub const EVENTS: [&str; 8] = [
    "payment.succeeded",
    "payment.rejected",
    "payment.indeterminate",
    "payment.returned",
    "refund.succeeded",
    "refund.rejected",
    "refund.indeterminate",
    "refund.returned",
];

/// keyfence's namespace for event and delivery ids (fixed forever: a new
/// one would give every event in flight a new `webhook-id`).
const NAMESPACE: Uuid = Uuid::from_u128(0x6b65_7966_656e_6365_7768_6f6f_6b73_0001);

/// The id of event `event` of payment `payment`: the same in every ledger
/// that writes it, so an event written twice (by a region that failed and
/// by the one that took its work over) is one event to its receivers.
pub fn event_id(payment: Uuid, event: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("event:{payment}:{event}").as_bytes())
}

/// The `webhook-id` of an event's delivery to one endpoint: fixed for ever,
/// the receiver's idempotency key on every attempt and redelivery.
pub fn webhook_id(event: Uuid, endpoint: Uuid) -> String {
    format!("msg_{}", Uuid::new_v5(&NAMESPACE, format!("delivery:{event}:{endpoint}").as_bytes()).simple())
}

/// An account number as events carry it: its last four characters, and
/// none of one too short to keep anything back.
pub fn masked(account: &str) -> String {
    let chars: Vec<char> = account.chars().collect();
    match chars.len() {
        0..=8 => "****".to_owned(),
        n => format!("****{}", chars[n - 4..].iter().collect::<String>()),
    }
}

/// Endpoints one client may have at most.
pub const MAX_ENDPOINTS: usize = 16;

/// One registered endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub id: Uuid,
    pub url: String,
    pub events: Vec<String>,
    /// Milliseconds since the epoch.
    pub created_at: u64,
    /// The secrets that sign, newest first, sealed ([`sealing`]); a
    /// previous one until its grace ends.
    pub secrets: Vec<WebhookSecret>,
    /// Deliveries that used up their schedule since the last one that
    /// arrived: more than none flags the endpoint as failing.
    #[serde(default)]
    pub failed_deliveries: u32,
    /// Set when nothing more is sent to it, with why.
    #[serde(default)]
    pub disabled: Option<Disabled>,
}

/// Why and when an endpoint was disabled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disabled {
    pub reason: String,
    /// Milliseconds since the epoch.
    pub at: u64,
}

impl Endpoint {
    /// The endpoint as its client sees it: everything but the secrets.
    pub fn public(&self) -> serde_json::Value {
        let mut view = serde_json::json!({
            "id": self.id,
            "url": self.url,
            "events": self.events,
            "created_at": rfc3339(self.created_at),
            "status": self.status(),
        });
        if let Some(disabled) = &self.disabled {
            view["disabled_reason"] = disabled.reason.clone().into();
            view["disabled_at"] = rfc3339(disabled.at).into();
        }
        if self.failed_deliveries > 0 {
            view["failed_deliveries"] = self.failed_deliveries.into();
        }
        view
    }

    /// `enabled`, `failing` (deliveries used up their schedule since the
    /// last that arrived) or `disabled`.
    pub fn status(&self) -> &'static str {
        match (&self.disabled, self.failed_deliveries) {
            (Some(_), _) => "disabled",
            (None, 0) => "enabled",
            (None, _) => "failing",
        }
    }
}

fn rfc3339(millis: u64) -> String {
    crate::ledger::timestamp(crate::domain::Millis::new(millis))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// The events named in `requested`, checked against [`EVENTS`]: at least
/// one, each known, none twice (kept in the catalogue's order).
pub fn checked_events(requested: &[String]) -> Result<Vec<String>, String> {
    if requested.is_empty() {
        return Err(format!("name at least one event of {}", EVENTS.join(", ")));
    }
    if let Some(unknown) = requested.iter().find(|e| !EVENTS.contains(&e.as_str())) {
        return Err(format!("{unknown:?} is not an event; the events are {}", EVENTS.join(", ")));
    }
    Ok(EVENTS.iter().filter(|e| requested.iter().any(|r| r == *e)).map(|e| (*e).to_owned()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fixed_by_what_they_name() {
        let (payment, endpoint) = (Uuid::now_v7(), Uuid::now_v7());
        let event = event_id(payment, "payment.succeeded");
        assert_eq!(event, event_id(payment, "payment.succeeded"));
        assert_ne!(event, event_id(payment, "payment.rejected"));
        assert_eq!(webhook_id(event, endpoint), webhook_id(event, endpoint));
        assert_ne!(webhook_id(event, endpoint), webhook_id(event, Uuid::now_v7()));
        assert!(webhook_id(event, endpoint).starts_with("msg_"));
    }

    #[test]
    fn accounts_are_masked_to_their_last_four_characters() {
        assert_eq!(masked("DE89370400440532013000"), "****3000");
        assert_eq!(masked("ab"), "****");
        assert_eq!(masked("12345678"), "****");
    }

    #[test]
    fn events_are_checked_against_the_catalogue() {
        let asked = |events: &[&str]| checked_events(&events.iter().map(|e| (*e).to_owned()).collect::<Vec<_>>());
        assert_eq!(
            asked(&["payment.rejected", "payment.succeeded", "payment.rejected"]).unwrap(),
            ["payment.succeeded", "payment.rejected"]
        );
        assert!(asked(&[]).is_err());
        assert!(asked(&["payment.created"]).unwrap_err().contains("not an event"));
    }
}
