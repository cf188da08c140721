//! A region's instances keep their own ledger's region fence in line with
//! the registry: when the registry records a newer change of this region
//! than the ledger follows, the instance sets the fence to match (failed:
//! fenced; active: open). So `regions restore` without `--ledger` cannot
//! leave a region that serves claims but commits no phase, and a failed
//! region whose ledger its instances can still reach is fenced there too.
//! The ledger's own epoch check makes this safe beside the SRE's command
//! and beside every other instance doing the same.

use std::time::Duration;

use tokio::sync::watch;

use super::{RegionState, RegionView};
use crate::ledger::{FenceChange, Ledger};

/// Checks every `every` until `stop`'s sender is dropped; a ledger change
/// is written only when the registry moved past what the ledger follows.
pub async fn follow_registry(
    view: RegionView,
    ledger: Ledger,
    region: String,
    every: Duration,
    mut stop: watch::Receiver<()>,
) {
    let mut followed: Option<u64> = None;
    loop {
        let registry = view.current().await;
        if let Some(change) = registry.regions.get(&region).filter(|c| followed < Some(c.epoch)) {
            let failed = change.state == RegionState::Failed;
            match ledger.set_region_fence(failed, &region, change.epoch, &change.reason).await {
                Ok(FenceChange::Set(fence)) => {
                    if followed.is_some() || fence.failed {
                        tracing::warn!(
                            region,
                            epoch = change.epoch,
                            state = fence.state(),
                            "ledger fence follows the registry"
                        );
                    }
                    followed = Some(change.epoch);
                }
                Ok(FenceChange::Newer(fence)) => followed = Some(u64::try_from(fence.epoch).unwrap_or(change.epoch)),
                Err(e) => {
                    tracing::warn!(region, error = %e, "could not bring the ledger fence in line with the registry")
                }
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}
