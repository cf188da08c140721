//! Benchmarks, as subcommands that write their figures to a file:
//! [`front_door`] measures payments and replays against a running stack and
//! against the [`floor`] of their store and rail calls, bare and
//! [behind HTTP](http_floor); [`summary`] takes the median of
//! its repeated runs and judges them against the targets; [`reconcile`]
//! measures how fast the reconciler compares and repairs, at several table
//! sizes; [`plot`] draws the front door's figures against concurrency;
//! [`cpu`] reads the CPU time they divide.

pub mod cpu;
pub mod floor;
pub mod front_door;
pub mod http_floor;
pub mod plot;
pub mod reconcile;
pub mod summary;

use std::time::Duration;

use serde::Serialize;

/// The machine figures were taken on, written beside them.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu: String,
    pub os: String,
}

impl Machine {
    pub fn this() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("model name")?.split_once(':').map(|(_, m)| m.trim().to_owned()))
            .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
        Self {
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            cpu,
            os: std::env::consts::OS.to_owned(),
        }
    }
}

/// The `q` quantile of sorted latencies, in milliseconds.
pub fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index].as_secs_f64() * 1000.0
}
