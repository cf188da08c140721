//! `RegionStore`: the registry's control item in the key table,
//! `pk = "control#regions"` (no key item's partition key can look like it:
//! those begin with a client's UUID). Reads are strongly consistent; a
//! change is one conditional update on the epoch it read, retried on a
//! fresh read when another change won in between.

use std::collections::{BTreeMap, HashMap};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::types::AttributeValue;

use super::{Change, RegionState, Registry};
use crate::domain::Millis;

/// The registry item's partition key.
const REGISTRY_PK: &str = "control#regions";

/// What begins the attribute a region advertises its URL in (`url#{region}`):
/// one attribute per region, so a policy can let each region's instances
/// write their own URL and nothing else of the registry.
const URL_ATTRIBUTE: &str = "url#";

/// Changes the registry item keeps in its history, newest last. Every
/// change is also logged where it is made; older ones are dropped, so the
/// item stays far below DynamoDB's 400 KB item limit however often regions
/// change state.
pub const HISTORY_KEPT: usize = 64;

/// Longest URL a region may advertise, in bytes.
const URL_LIMIT: usize = 2048;

/// Longest `by` and `reason` a change records, in characters.
pub const TEXT_LIMIT: usize = 500;

#[derive(Debug, thiserror::Error)]
pub enum RegionsError {
    #[error("the region registry could not be read or written: {0}")]
    Store(String),
    #[error("the region registry is malformed: {0}")]
    Malformed(String),
    #[error("other changes kept winning; try again")]
    Contended,
    #[error("the region registry does not exist yet: `keyfence migrate` makes it")]
    Missing,
    #[error("{0}")]
    Invalid(String),
}

/// What a change came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changed {
    /// This change won and made the new epoch.
    Made(Change),
    /// The region was already in that state (perhaps by a rival's change
    /// that won first): its last change, if it ever had one.
    AlreadySo(Option<Change>),
}

#[derive(Clone, Debug)]
pub struct RegionStore {
    client: Client,
    table: String,
}

type Attrs = HashMap<String, AttributeValue>;

impl RegionStore {
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self { client, table: table.into() }
    }

    /// The registry as it stands (an empty one if never written).
    pub async fn read(&self) -> Result<Registry, RegionsError> {
        Ok(self.read_whole().await?.0)
    }

    /// The registry, and the attributes of URLs that do not read as one
    /// (which a change removes).
    async fn read_whole(&self) -> Result<(Registry, Vec<String>), RegionsError> {
        metrics::counter!("keyfence_registry_reads_total").increment(1);
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(REGISTRY_PK.into()))
            .consistent_read(true)
            .send()
            .await
            .map_err(store)?;
        Ok(out.item().map(decode).transpose()?.unwrap_or_default())
    }

    /// Moves `region` to `state`, recording who and why.
    pub async fn change(
        &self,
        region: &str,
        state: RegionState,
        by: &str,
        reason: &str,
    ) -> Result<Changed, RegionsError> {
        for (name, text) in [("--by", by), ("--reason", reason)] {
            if text.chars().count() > TEXT_LIMIT {
                return Err(RegionsError::Invalid(format!("{name} is longer than {TEXT_LIMIT} characters")));
            }
        }
        self.create().await?;
        for _ in 0..10 {
            let (current, unreadable) = self.read_whole().await?;
            if current.state_of(region) == state {
                return Ok(Changed::AlreadySo(current.regions.get(region).cloned()));
            }
            let change = Change {
                region: region.to_owned(),
                state,
                epoch: current.epoch + 1,
                by: by.to_owned(),
                at: Millis::now().get(),
                reason: reason.to_owned(),
            };
            // The condition on the epoch read makes this read-modify-write safe.
            let kept = current.history.len().saturating_sub(HISTORY_KEPT - 1);
            let history: Vec<AttributeValue> =
                current.history[kept..].iter().chain([&change]).map(encode_change).collect();
            // A URL that does not read as one goes with the change.
            let mut update = "SET epoch = :next, regions.#r = :change, history = :history".to_owned();
            let mut names = HashMap::from([("#r".to_owned(), region.to_owned())]);
            for (i, name) in unreadable.iter().enumerate() {
                update.push_str(if i == 0 { " REMOVE " } else { ", " });
                update.push_str(&format!("#u{i}"));
                names.insert(format!("#u{i}"), name.clone());
            }
            let sent = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("pk", AttributeValue::S(REGISTRY_PK.into()))
                .update_expression(update)
                .condition_expression("epoch = :seen")
                .set_expression_attribute_names(Some(names))
                .expression_attribute_values(":next", n(change.epoch))
                .expression_attribute_values(":seen", n(current.epoch))
                .expression_attribute_values(":change", encode_change(&change))
                .expression_attribute_values(":history", AttributeValue::L(history))
                .send()
                .await;
            match sent {
                Ok(_) => {
                    tracing::warn!(
                        region,
                        state = state.as_str(),
                        epoch = change.epoch,
                        by,
                        reason,
                        "region state changed"
                    );
                    return Ok(Changed::Made(change));
                }
                // Another change won the epoch: read again and decide anew.
                Err(e) if e.as_service_error().is_some_and(|e| e.code() == Some("ConditionalCheckFailedException")) => {
                }
                Err(e) => return Err(store(e)),
            }
        }
        Err(RegionsError::Contended)
    }

    /// Records where `region`'s front door answers, in its own attribute
    /// (the only one of the registry `serve` may write). Not a change of
    /// state: the epoch stays. The registry must exist ([`Self::create`]).
    pub async fn advertise(&self, region: &str, url: &str) -> Result<(), RegionsError> {
        if url.len() > URL_LIMIT {
            return Err(RegionsError::Invalid(format!("a region's URL is at most {URL_LIMIT} bytes")));
        }
        let sent = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(REGISTRY_PK.into()))
            .update_expression("SET #url = :url")
            .condition_expression("attribute_exists(pk)")
            .expression_attribute_names("#url", format!("{URL_ATTRIBUTE}{region}"))
            .expression_attribute_values(":url", AttributeValue::S(url.into()))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(e) if e.as_service_error().is_some_and(|e| e.code() == Some("ConditionalCheckFailedException")) => {
                Err(RegionsError::Missing)
            }
            Err(e) => Err(store(e)),
        }
    }

    /// Makes the registry, with every region active, unless it exists (or
    /// completes one that lacks its parts): `keyfence migrate`'s, and a
    /// first change's.
    pub async fn create(&self) -> Result<(), RegionsError> {
        self.client
            .update_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(REGISTRY_PK.into()))
            .update_expression(
                "SET kind = :kind, epoch = if_not_exists(epoch, :zero), regions = if_not_exists(regions, :none), \
                 history = if_not_exists(history, :empty)",
            )
            .expression_attribute_values(":kind", AttributeValue::S("registry".into()))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":none", AttributeValue::M(HashMap::new()))
            .expression_attribute_values(":empty", AttributeValue::L(Vec::new()))
            .send()
            .await
            .map_err(store)?;
        Ok(())
    }
}

fn n(value: u64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

fn store(e: impl std::error::Error + 'static) -> RegionsError {
    RegionsError::Store(DisplayErrorContext(&e).to_string())
}

fn encode_change(c: &Change) -> AttributeValue {
    AttributeValue::M(HashMap::from([
        ("region".to_owned(), AttributeValue::S(c.region.clone())),
        ("state".to_owned(), AttributeValue::S(c.state.as_str().to_owned())),
        ("epoch".to_owned(), n(c.epoch)),
        ("by".to_owned(), AttributeValue::S(c.by.clone())),
        ("at".to_owned(), n(c.at)),
        ("reason".to_owned(), AttributeValue::S(c.reason.clone())),
    ]))
}

/// The registry an item holds, and the names of its URL attributes that do
/// not read as a URL. Each region's instances may write their own URL
/// attribute, and nothing else of the item (its policy says so): such an
/// attribute is skipped rather than making the whole registry unreadable.
fn decode(item: &Attrs) -> Result<(Registry, Vec<String>), RegionsError> {
    // Parts the item lacks (made by a URL written before `migrate` made
    // the registry) are empty.
    let regions = match item.get("regions") {
        None => Ok(BTreeMap::new()),
        Some(AttributeValue::M(map)) => {
            map.values().map(decode_change).map(|c| c.map(|c| (c.region.clone(), c))).collect()
        }
        _ => Err(malformed("regions")),
    }?;
    let history = match item.get("history") {
        None => Ok(Vec::new()),
        Some(AttributeValue::L(list)) => list.iter().map(decode_change).collect(),
        _ => Err(malformed("history")),
    }?;
    // Where regions advertised before each had an attribute of its own: a
    // map, which a region's own attribute overrides.
    let mut urls: BTreeMap<String, String> = match item.get("urls") {
        None => BTreeMap::new(),
        Some(AttributeValue::M(map)) => map
            .iter()
            .map(|(region, url)| url.as_s().map(|u| (region.clone(), u.clone())).map_err(|_| malformed("urls")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(malformed("urls")),
    };
    let mut unreadable = Vec::new();
    for (name, url) in item {
        let Some(region) = name.strip_prefix(URL_ATTRIBUTE) else { continue };
        match url.as_s() {
            Ok(url) if url.len() <= URL_LIMIT => {
                urls.insert(region.to_owned(), url.clone());
            }
            _ => {
                tracing::warn!(attribute = name, "a region's URL in the registry does not read as one; skipped");
                unreadable.push(name.clone());
            }
        }
    }
    let epoch = if item.contains_key("epoch") { number(item, "epoch")? } else { 0 };
    Ok((Registry { epoch, regions, history, urls }, unreadable))
}

fn decode_change(value: &AttributeValue) -> Result<Change, RegionsError> {
    let AttributeValue::M(m) = value else { return Err(malformed("a change")) };
    let text = |name: &str| match m.get(name) {
        Some(AttributeValue::S(s)) => Ok(s.clone()),
        _ => Err(malformed(name)),
    };
    let state = match text("state")?.as_str() {
        "active" => RegionState::Active,
        "failed" => RegionState::Failed,
        other => return Err(malformed(other)),
    };
    Ok(Change {
        region: text("region")?,
        state,
        epoch: number(m, "epoch")?,
        by: text("by")?,
        at: number(m, "at")?,
        reason: text("reason")?,
    })
}

fn number(m: &Attrs, name: &str) -> Result<u64, RegionsError> {
    match m.get(name) {
        Some(AttributeValue::N(v)) => v.parse().map_err(|_| malformed(name)),
        _ => Err(malformed(name)),
    }
}

fn malformed(what: &str) -> RegionsError {
    RegionsError::Malformed(what.to_owned())
}
