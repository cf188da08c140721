//! A client's profile: the debtor accounts it holds and the limits it pays
//! within, kept in the client's record (global like the client itself).
//! Accounts are kept in their normal form
//! ([`crate::domain::normal_account`]) as a string set, so adding and
//! removing are single atomic updates; limits absent mean none (and its own
//! fair use absent, the instance's defaults).

use std::collections::{BTreeSet, HashMap};

use aws_sdk_dynamodb::types::AttributeValue;
use serde::Serialize;

use super::ClientRecord;
use super::store::{Attrs, ClientStore, ClientsError, decode as decode_record, number, record_pk, store};
use crate::domain::{ClientId, PaymentRequest};

/// What a client may pay from, and within which limits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Profile {
    pub accounts: BTreeSet<String>,
    /// The currencies it may pay in; `None`: any.
    pub currencies: Option<BTreeSet<String>>,
    /// The largest amount of one payment, in minor units; `None`: no limit
    /// beyond the API's own.
    pub max_amount_minor: Option<i64>,
    /// Its own fair use, each `None`: the instance's default.
    #[serde(flatten)]
    pub fair_use: FairUse,
}

/// A client's own allowance of one instance; `None`: the default
/// (`KEYFENCE_CLIENT_RATE`, `_BURST`, `_IN_FLIGHT`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FairUse {
    /// Requests a second.
    pub rate: Option<u32>,
    /// Requests at once after a quiet spell.
    pub burst: Option<u32>,
    /// Payments in flight at once.
    pub in_flight: Option<u32>,
}

/// Why a payment is refused before anything is claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The debtor account is not one the client holds (whoever else holds
    /// it, or nobody: the same answer).
    AccountNotPermitted,
    /// Over one of the client's limits, named.
    OverLimit { limit: &'static str, detail: String },
}

impl Profile {
    /// Whether the client may make `payment`.
    pub fn permits(&self, payment: &PaymentRequest) -> Result<(), Refusal> {
        if !self.accounts.contains(&payment.debtor_account) {
            return Err(Refusal::AccountNotPermitted);
        }
        if let Some(currencies) = self.currencies.as_ref().filter(|c| !c.contains(&payment.currency)) {
            let allowed = currencies.iter().cloned().collect::<Vec<_>>().join(", ");
            return Err(Refusal::OverLimit {
                limit: "currencies",
                detail: format!("this client pays in {allowed} only"),
            });
        }
        if let Some(max) = self.max_amount_minor.filter(|max| payment.amount_minor > *max) {
            return Err(Refusal::OverLimit {
                limit: "max_amount_minor",
                detail: format!("this client's payments are at most {max} minor units"),
            });
        }
        Ok(())
    }
}

/// A change of a client's limits; `None` leaves a limit as it is.
#[derive(Debug, Clone, Default)]
pub struct Limits {
    pub currencies: Option<BTreeSet<String>>,
    pub max_amount_minor: Option<i64>,
    pub fair_use: FairUse,
}

/// A client's record and profile, as read.
pub(super) type Decoded = (ClientRecord, Profile);

/// A record item's record and profile.
pub(super) fn decoded(item: &Attrs) -> Result<Decoded, ClientsError> {
    Ok((decode_record(item)?, decode(item)?))
}

impl ClientStore {
    /// Client `id`'s record and profile, if it exists.
    pub async fn record(&self, id: ClientId) -> Result<Option<Decoded>, ClientsError> {
        self.record_item(id).await?.as_ref().map(decoded).transpose()
    }

    /// The profile of client `id` (empty if it has none, or is unknown).
    pub async fn profile(&self, id: ClientId) -> Result<Profile, ClientsError> {
        Ok(self.record(id).await?.map(|(_, profile)| profile).unwrap_or_default())
    }

    /// The profile of client `id`, which must exist.
    async fn existing_profile(&self, id: ClientId) -> Result<Profile, ClientsError> {
        self.record(id).await?.map(|(_, profile)| profile).ok_or(ClientsError::Unknown(id))
    }

    /// Adds (or with `add` false, removes) accounts, in normal form.
    pub async fn change_accounts(&self, id: ClientId, accounts: &[String], add: bool) -> Result<Profile, ClientsError> {
        if accounts.is_empty() {
            return self.existing_profile(id).await;
        }
        let verb = if add { "ADD" } else { "DELETE" };
        let mut values = HashMap::new();
        values.insert(":accounts".to_owned(), AttributeValue::Ss(accounts.to_vec()));
        self.update(id, &format!("{verb} accounts :accounts"), values).await
    }

    /// Sets the limits given, leaving the others as they are.
    pub async fn set_limits(&self, id: ClientId, limits: &Limits) -> Result<Profile, ClientsError> {
        let mut values = HashMap::new();
        if let Some(currencies) = &limits.currencies {
            values.insert(":currencies".to_owned(), AttributeValue::Ss(currencies.iter().cloned().collect()));
        }
        let numbers = [
            ("max_amount_minor", limits.max_amount_minor),
            ("rate", limits.fair_use.rate.map(i64::from)),
            ("burst", limits.fair_use.burst.map(i64::from)),
            ("in_flight", limits.fair_use.in_flight.map(i64::from)),
        ];
        for (name, number) in numbers {
            if let Some(number) = number {
                values.insert(format!(":{name}"), AttributeValue::N(number.to_string()));
            }
        }
        if values.is_empty() {
            return self.existing_profile(id).await;
        }
        let sets: Vec<String> = values.keys().map(|value| format!("{} = {value}", &value[1..])).collect();
        self.update(id, &format!("SET {}", sets.join(", ")), values).await
    }

    /// Changes client `id`'s record (which must exist) by `expression`.
    async fn update(
        &self,
        id: ClientId,
        expression: &str,
        values: HashMap<String, AttributeValue>,
    ) -> Result<Profile, ClientsError> {
        let out = self
            .client()
            .update_item()
            .table_name(self.table())
            .key("pk", AttributeValue::S(record_pk(id)))
            .update_expression(expression)
            .condition_expression("attribute_exists(pk)")
            .set_expression_attribute_values(Some(values))
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .send()
            .await;
        match out {
            Ok(out) => {
                let profile = out.attributes().map(decode).transpose()?.unwrap_or_default();
                self.changed(id).await;
                Ok(profile)
            }
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                Err(ClientsError::Unknown(id))
            }
            Err(e) => Err(store(e)),
        }
    }
}

pub(super) fn decode(item: &HashMap<String, AttributeValue>) -> Result<Profile, ClientsError> {
    let set = |name: &str| match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::Ss(values)) => Ok(Some(values.iter().cloned().collect::<BTreeSet<_>>())),
        Some(_) => Err(ClientsError::Malformed(name.to_owned())),
    };
    Ok(Profile {
        accounts: set("accounts")?.unwrap_or_default(),
        currencies: set("currencies")?,
        max_amount_minor: number(item, "max_amount_minor")?,
        fair_use: FairUse {
            rate: number(item, "rate")?,
            burst: number(item, "burst")?,
            in_flight: number(item, "in_flight")?,
        },
    })
}
