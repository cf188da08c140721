//! A sweep's runs summarised: at each concurrency, the median of the
//! repeated runs of every ratio and its spread, and each against the
//! target keyfence holds itself to.

use serde::Serialize;

use super::front_door::Report;

/// Every run of one `keyfence bench` and where it ran.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    pub machine: super::Machine,
    pub runs: Vec<Report>,
    pub summary: Vec<Summary>,
}

impl Sweep {
    pub fn new(machine: super::Machine, runs: Vec<Report>) -> Self {
        let summary = levels(&runs)
            .into_iter()
            .map(|c| Summary::of(c, runs.iter().filter(|r| r.concurrency == c).collect::<Vec<_>>()))
            .collect();
        Self { machine, runs, summary }
    }

    /// The summary table and the targets, for people.
    pub fn table(&self) -> String {
        let mut out = String::from("medians of each concurrency's runs (min-max)\n");
        out += &format!("{:<40}", "ratio");
        for s in &self.summary {
            out += &format!(" {:>20}", format!("c={} ({} runs)", s.concurrency, s.runs));
        }
        out += "\n";
        for ratio in &RATIOS {
            out += &format!("{:<40}", ratio.name);
            for s in &self.summary {
                let cell = s.spread(ratio).map_or_else(|| "-".to_owned(), |x| x.to_string());
                out += &format!(" {cell:>20}");
            }
            out += "\n";
        }
        for line in self.verdicts() {
            out += &line;
            out += "\n";
        }
        out
    }

    /// One line per target: where its median is met and where it is not.
    pub fn verdicts(&self) -> Vec<String> {
        RATIOS
            .iter()
            .filter_map(|ratio| {
                let target = ratio.target?;
                let judged: Vec<(usize, bool)> = self
                    .summary
                    .iter()
                    .filter(|s| target.at.is_none_or(|at| at == s.concurrency))
                    .filter_map(|s| Some((s.concurrency, target.holds(s.spread(ratio)?.median))))
                    .collect();
                let missed: Vec<String> = judged.iter().filter(|(_, met)| !met).map(|(c, _)| c.to_string()).collect();
                let verdict = match (judged.is_empty(), missed.is_empty()) {
                    (true, _) => "not measured".to_owned(),
                    (false, true) => "met".to_owned(),
                    (false, false) => format!("not met at c={}", missed.join(",")),
                };
                Some(format!("target {} {}: {verdict}", ratio.name, target))
            })
            .collect()
    }
}

/// The concurrencies some runs were measured at, each once, lowest first.
pub fn levels(runs: &[Report]) -> Vec<usize> {
    let mut levels: Vec<usize> = runs.iter().map(|r| r.concurrency).collect();
    levels.sort_unstable();
    levels.dedup();
    levels
}

/// The runs at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub concurrency: usize,
    pub runs: usize,
    /// Each ratio's median and spread, by name.
    pub ratios: Vec<(&'static str, Option<Spread>)>,
}

impl Summary {
    fn of(concurrency: usize, runs: Vec<&Report>) -> Self {
        let ratios =
            RATIOS.iter().map(|ratio| (ratio.name, Spread::of(runs.iter().filter_map(|r| (ratio.value)(r))))).collect();
        Self { concurrency, runs: runs.len(), ratios }
    }

    fn spread(&self, ratio: &Ratio) -> Option<Spread> {
        self.ratios.iter().find(|(name, _)| *name == ratio.name).and_then(|(_, spread)| *spread)
    }
}

/// The median of some runs' figure and its range.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: impl Iterator<Item = f64>) -> Option<Self> {
        let mut sorted: Vec<f64> = values.collect();
        sorted.sort_by(f64::total_cmp);
        let (min, max) = (*sorted.first()?, *sorted.last()?);
        let middle = sorted.len() / 2;
        let median = if sorted.len() % 2 == 1 { sorted[middle] } else { (sorted[middle - 1] + sorted[middle]) / 2.0 };
        Some(Self { median, min, max })
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2} ({:.2}-{:.2})", self.median, self.min, self.max)
    }
}

/// A figure of one run divided by its floor's, and what it should be.
pub struct Ratio {
    pub name: &'static str,
    pub value: fn(&Report) -> Option<f64>,
    pub target: Option<Target>,
}

/// A bound on a ratio's median, at one concurrency or at all of them.
#[derive(Clone, Copy)]
pub struct Target {
    pub at_least: bool,
    pub bound: f64,
    pub at: Option<usize>,
}

impl Target {
    fn holds(&self, median: f64) -> bool {
        if self.at_least { median >= self.bound } else { median <= self.bound }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:.2}", if self.at_least { ">=" } else { "<=" }, self.bound)?;
        match self.at {
            Some(c) => write!(f, " at c={c}"),
            None => write!(f, " at every concurrency"),
        }
    }
}

const fn at_least(bound: f64) -> Option<Target> {
    Some(Target { at_least: true, bound, at: None })
}

const fn at_most(bound: f64, at: Option<usize>) -> Option<Target> {
    Some(Target { at_least: false, bound, at })
}

/// Every ratio the bench reports, in the order its tables show them.
pub const RATIOS: [Ratio; 13] = [
    Ratio { name: "payments/floor throughput", value: |r| Some(r.payments_over_floor()), target: at_least(0.95) },
    Ratio { name: "payments/floor p50", value: |r| Some(r.p50_over_floor()), target: at_most(1.10, Some(1)) },
    Ratio { name: "payments/floor CPU", value: Report::cpu_over_floor, target: at_most(1.25, None) },
    Ratio { name: "cold replays/floor throughput", value: Report::cold_replays_over_floor, target: at_least(0.95) },
    Ratio { name: "cold replays/floor CPU", value: Report::cold_cpu_over_floor, target: at_most(1.25, None) },
    Ratio { name: "memory replays/floor throughput", value: |r| Some(r.replays_over_floor()), target: None },
    Ratio { name: "floor over HTTP/floor throughput", value: |r| Some(r.http_floor_over_floor()), target: None },
    Ratio { name: "floor over HTTP/floor p50", value: |r| Some(r.http_floor_p50_over_floor()), target: None },
    Ratio {
        name: "replay floor over HTTP/floor throughput",
        value: |r| Some(r.http_replay_floor_over_floor()),
        target: None,
    },
    Ratio { name: "payments/floor over HTTP throughput", value: |r| Some(r.payments_over_http_floor()), target: None },
    Ratio { name: "payments/floor over HTTP CPU", value: Report::cpu_over_http_floor, target: None },
    Ratio {
        name: "cold replays/floor over HTTP throughput",
        value: Report::cold_replays_over_http_floor,
        target: None,
    },
    Ratio { name: "cold replays/floor over HTTP CPU", value: Report::cold_cpu_over_http_floor, target: None },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_median_is_the_middle_run_and_the_spread_its_extremes() {
        assert_eq!(Spread::of([1.2, 0.8, 1.0].into_iter()), Some(Spread { median: 1.0, min: 0.8, max: 1.2 }));
        assert_eq!(Spread::of([2.0, 1.0].into_iter()), Some(Spread { median: 1.5, min: 1.0, max: 2.0 }));
        assert_eq!(Spread::of(std::iter::empty()), None);
    }

    #[test]
    fn a_target_is_judged_on_the_median() {
        let floor = Target { at_least: true, bound: 0.95, at: None };
        assert!(floor.holds(0.95) && !floor.holds(0.94));
        let ceiling = Target { at_least: false, bound: 1.25, at: None };
        assert!(ceiling.holds(1.25) && !ceiling.holds(1.26));
    }
}
