//! A client's profile: the debtor accounts it holds and the limits it pays
//! within, one control item per client (`control#profile#{client id}`),
//! global like the client itself. Accounts are kept in their normal form
//! ([`crate::domain::normal_account`]) as a string set, so adding and
//! removing are single atomic updates; limits absent mean none (and its own
//! fair use absent, the instance's defaults).

use std::collections::{BTreeSet, HashMap};

use aws_sdk_dynamodb::types::AttributeValue;
use serde::Serialize;

use super::{ClientStore, ClientsError, store};
use crate::domain::{ClientId, PaymentRequest};

const PREFIX: &str = "control#profile#";

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

impl ClientStore {
    /// The profile of client `id` (empty if none was ever written).
    pub async fn profile(&self, id: ClientId) -> Result<Profile, ClientsError> {
        let out = self
            .client()
            .get_item()
            .table_name(self.table())
            .key("pk", AttributeValue::S(format!("{PREFIX}{id}")))
            .consistent_read(true)
            .send()
            .await
            .map_err(store)?;
        Ok(out.item().map(decode).transpose()?.unwrap_or_default())
    }

    /// Adds (or with `add` false, removes) accounts, in normal form.
    pub async fn change_accounts(&self, id: ClientId, accounts: &[String], add: bool) -> Result<Profile, ClientsError> {
        self.require(id).await?;
        if accounts.is_empty() {
            return self.profile(id).await;
        }
        let verb = if add { "ADD" } else { "DELETE" };
        self.update(id, &format!("SET kind = :kind, client_id = :id {verb} accounts :accounts"), |values| {
            values.insert(":accounts".into(), AttributeValue::Ss(accounts.to_vec()));
        })
        .await
    }

    /// Sets the limits given, leaving the others as they are.
    pub async fn set_limits(&self, id: ClientId, limits: &Limits) -> Result<Profile, ClientsError> {
        self.require(id).await?;
        let mut values = HashMap::new();
        if let Some(currencies) = &limits.currencies {
            values.insert("currencies", AttributeValue::Ss(currencies.iter().cloned().collect()));
        }
        let numbers = [
            ("max_amount_minor", limits.max_amount_minor),
            ("rate", limits.fair_use.rate.map(i64::from)),
            ("burst", limits.fair_use.burst.map(i64::from)),
            ("in_flight", limits.fair_use.in_flight.map(i64::from)),
        ];
        for (name, number) in numbers {
            if let Some(number) = number {
                values.insert(name, AttributeValue::N(number.to_string()));
            }
        }
        let sets: Vec<String> = ["kind = :kind".to_owned(), "client_id = :id".to_owned()]
            .into_iter()
            .chain(values.keys().map(|name| format!("{name} = :{name}")))
            .collect();
        self.update(id, &format!("SET {}", sets.join(", ")), |all| {
            all.extend(values.into_iter().map(|(name, value)| (format!(":{name}"), value)));
        })
        .await
    }

    async fn update(
        &self,
        id: ClientId,
        expression: &str,
        values: impl FnOnce(&mut HashMap<String, AttributeValue>),
    ) -> Result<Profile, ClientsError> {
        let mut all = HashMap::from([
            (":kind".to_owned(), AttributeValue::S("profile".into())),
            (":id".to_owned(), AttributeValue::S(id.to_string())),
        ]);
        values(&mut all);
        let out = self
            .client()
            .update_item()
            .table_name(self.table())
            .key("pk", AttributeValue::S(format!("{PREFIX}{id}")))
            .update_expression(expression)
            .set_expression_attribute_values(Some(all))
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .send()
            .await
            .map_err(store)?;
        Ok(out.attributes().map(decode).transpose()?.unwrap_or_default())
    }

    /// Refuses a change for a client that does not exist.
    async fn require(&self, id: ClientId) -> Result<(), ClientsError> {
        if self.list().await?.iter().any(|c| c.id == id) { Ok(()) } else { Err(ClientsError::Unknown(id)) }
    }
}

fn decode(item: &HashMap<String, AttributeValue>) -> Result<Profile, ClientsError> {
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

fn number<T: std::str::FromStr>(item: &HashMap<String, AttributeValue>, name: &str) -> Result<Option<T>, ClientsError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::N(n)) => n.parse().map(Some).map_err(|_| ClientsError::Malformed(name.to_owned())),
        Some(_) => Err(ClientsError::Malformed(name.to_owned())),
    }
}
