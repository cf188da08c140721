//! Regions: which are active and which an SRE has declared failed. The
//! status of every region lives in one control item of the key table (the
//! registry), with an epoch that rises at every change, like a failover
//! version: each change is one conditional write on the epoch it read, so
//! two SREs declaring at once cannot both win with the same epoch, and every
//! change is kept in the item's history with who, when and why.
//!
//! A region never written to the registry is active. Instances read the
//! registry through a [`RegionView`], cached for a second (a failed region's
//! instances stop claiming and committing within that delay); decisions
//! that move a request to another region read it fresh.

mod follow;
mod store;
mod view;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::domain::Millis;
use crate::ledger::{FenceChange, Ledger, LedgerError};

pub use follow::follow_registry;
pub use store::{Changed, HISTORY_KEPT, RegionStore, RegionsError, TEXT_LIMIT};
pub use view::RegionView;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionState {
    Active,
    Failed,
}

impl RegionState {
    pub fn as_str(self) -> &'static str {
        match self {
            RegionState::Active => "active",
            RegionState::Failed => "failed",
        }
    }
}

/// One change of a region's state, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub region: String,
    pub state: RegionState,
    /// The registry's epoch this change created.
    pub epoch: u64,
    pub by: String,
    /// Milliseconds since the epoch.
    pub at: u64,
    pub reason: String,
}

/// Every region's last change, and the history of all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Registry {
    pub epoch: u64,
    pub regions: BTreeMap<String, Change>,
    pub history: Vec<Change>,
    /// Where each region's front door answers, as its instances advertise
    /// it; regions ask each other for what they do not hold.
    pub urls: BTreeMap<String, String>,
}

impl Registry {
    pub fn state_of(&self, region: &str) -> RegionState {
        self.regions.get(region).map_or(RegionState::Active, |c| c.state)
    }

    pub fn is_failed(&self, region: &str) -> bool {
        self.state_of(region) == RegionState::Failed
    }

    /// The regions declared failed, other than `except`.
    pub fn failed_except<'a>(&'a self, except: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.regions
            .values()
            .filter(move |c| c.state == RegionState::Failed && c.region != except)
            .map(|c| c.region.as_str())
    }

    /// The registry as a table for people.
    pub fn table(&self) -> String {
        let mut out = format!("{:<16} {:<8} {:>6}  {:<24} {:<16} reason\n", "region", "state", "epoch", "since", "by");
        for c in self.regions.values() {
            out += &format!(
                "{:<16} {:<8} {:>6}  {:<24} {:<16} {}\n",
                c.region,
                c.state.as_str(),
                c.epoch,
                crate::ledger::timestamp(Millis::new(c.at))
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_default(),
                c.by,
                c.reason
            );
        }
        out += &format!("registry epoch {}; {} change(s) recorded\n", self.epoch, self.history.len());
        out
    }
}

/// Why a declaration did not go through whole.
#[derive(Debug, thiserror::Error)]
pub enum DeclareError {
    #[error(transparent)]
    Registry(#[from] RegionsError),
    /// The registry changed, but the region's own ledger could not be fenced
    /// (or unfenced); its instances still stop within a second through the
    /// registry. Run the command again to fence the ledger.
    #[error("the registry says {state} (epoch {epoch}), but the region's ledger could not be updated: {source}")]
    Ledger { state: &'static str, epoch: u64, source: LedgerError },
}

/// Declares `region` failed or active again: one conditional write on the
/// registry, then, when the SRE can still reach the region's ledger, the
/// same state in that ledger's fence (unless the ledger already follows a
/// newer declaration), so its phases stop (or resume) in the same
/// transaction that would commit them. Without the ledger, the region's own
/// instances bring its fence in line within a second or so
/// ([`follow_registry`]).
pub async fn declare(
    store: &RegionStore,
    ledger: Option<&Ledger>,
    region: &str,
    state: RegionState,
    by: &str,
    reason: &str,
) -> Result<(Changed, Option<FenceChange>), DeclareError> {
    let changed = store.change(region, state, by, reason).await?;
    let Some(ledger) = ledger else { return Ok((changed, None)) };
    let epoch = match &changed {
        Changed::Made(change) => change.epoch,
        Changed::AlreadySo(change) => change.as_ref().map_or(0, |c| c.epoch),
    };
    let fenced = ledger.set_region_fence(state == RegionState::Failed, region, epoch, reason).await;
    let fenced = fenced.map_err(|source| DeclareError::Ledger { state: state.as_str(), epoch, source })?;
    Ok((changed, Some(fenced)))
}
