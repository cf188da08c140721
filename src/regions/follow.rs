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

/// Checks every `every` until `stop`'s sender is dropped: binds the ledger
/// to this region first, then reads its fence (without the phases' lock)
/// and writes it only when the registry records a newer change of this
/// region than the ledger follows, so a fence lost with a ledger failover
/// is put back too, and an aligned ledger costs one read a tick.
pub async fn follow_registry(
    view: RegionView,
    ledger: Ledger,
    region: String,
    every: Duration,
    mut stop: watch::Receiver<()>,
) {
    let mut bound = false;
    loop {
        if !bound {
            match ledger.bind_region_fence(&region).await {
                Ok(fence) if fence.region.as_deref() != Some(region.as_str()) => tracing::error!(
                    region,
                    ledger_region = fence.region.as_deref().unwrap_or_default(),
                    "this instance's ledger belongs to another region: check DATABASE_URL"
                ),
                Ok(_) => bound = true,
                Err(e) => tracing::warn!(region, error = %e, "could not read the ledger's region fence"),
            }
        }
        if bound {
            follow_once(&view, &ledger, &region).await;
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// One comparison of the registry with the ledger, and a write if behind.
async fn follow_once(view: &RegionView, ledger: &Ledger, region: &str) {
    let registry = view.current().await;
    let Some(change) = registry.regions.get(region) else { return };
    let behind = match ledger.region_fence().await {
        Ok(fence) => u64::try_from(fence.epoch).unwrap_or(0) < change.epoch,
        Err(e) => {
            tracing::warn!(region, error = %e, "could not read the ledger's region fence");
            return;
        }
    };
    if !behind {
        return;
    }
    let failed = change.state == RegionState::Failed;
    match ledger.set_region_fence(failed, region, change.epoch, &change.reason).await {
        Ok(FenceChange::Set(fence)) => {
            tracing::warn!(region, epoch = change.epoch, state = fence.state(), "ledger fence follows the registry")
        }
        Ok(FenceChange::Newer(_)) => {}
        Err(e) => tracing::warn!(region, error = %e, "could not bring the ledger fence in line with the registry"),
    }
}
