//! Benchmarks, as subcommands that write their figures to a file:
//! [`front_door`] measures payments and replays against a running stack and
//! the floor of its store and rail calls; [`reconcile`] measures how fast the
//! reconciler compares and repairs, at several table sizes.

pub mod front_door;
pub mod reconcile;

use std::time::Duration;

/// The `q` quantile of sorted latencies, in milliseconds.
pub fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index].as_secs_f64() * 1000.0
}
