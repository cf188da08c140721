//! What happened in a chaos run, in order and timed from its start: every
//! request's final answer, every fault and its end, every operator step.
//! Written to the run's log folder.

use std::sync::Mutex;
use std::time::Instant;

pub struct Journal {
    began: Instant,
    lines: Mutex<Vec<String>>,
}

impl Journal {
    pub fn new() -> Self {
        Self { began: Instant::now(), lines: Mutex::default() }
    }

    pub fn note(&self, what: impl AsRef<str>) {
        let line = format!("{:>9.3}s {}", self.began.elapsed().as_secs_f64(), what.as_ref());
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
