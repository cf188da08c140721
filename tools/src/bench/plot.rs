//! Plots of a front-door sweep against concurrency: throughput, CPU per
//! request and the ratios to the floors, for payments, replays and their
//! floors, each point the median of its runs with a bar from the lowest to
//! the highest. Drawn as SVG files whose text stays text, set by whatever
//! shows them, so drawing needs no font on the machine.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::front_door::{Figures, Report};
use super::summary::{Spread, levels};

#[derive(Debug, thiserror::Error)]
#[error("drawing {path}: {reason}")]
pub struct PlotError {
    path: PathBuf,
    reason: String,
}

/// The colour of the floors behind HTTP, and of ratios over them.
const BEHIND_HTTP: RGBColor = RGBColor(230, 120, 0);

/// One line of a plot: a label, a colour, and a figure read off each run.
struct Series {
    label: &'static str,
    colour: RGBColor,
    value: fn(&Report) -> Option<f64>,
}

/// Draws `throughput.svg`, `cpu.svg` and `ratios.svg` into `dir`, each
/// with a panel for first requests and one for replays; returns their paths.
pub fn draw(runs: &[Report], dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let pictures: [(PathBuf, &str, [Panel; 2]); 3] = [
        (
            dir.join("throughput.svg"),
            "requests per second",
            [
                Panel {
                    title: "First requests",
                    series: vec![
                        Series { label: "payments", colour: BLUE, value: |r| Some(r.payments.per_second) },
                        Series { label: "floor", colour: CYAN, value: |r| Some(r.floor.per_second) },
                        Series {
                            label: "floor over HTTP",
                            colour: BEHIND_HTTP,
                            value: |r| Some(r.http_floor.per_second),
                        },
                    ],
                },
                Panel {
                    title: "Replays",
                    series: vec![
                        Series {
                            label: "cold replays",
                            colour: RED,
                            value: |r| Some(r.cold_replays.as_ref()?.per_second),
                        },
                        Series { label: "replay floor", colour: MAGENTA, value: |r| Some(r.replay_floor.per_second) },
                        Series {
                            label: "replay floor over HTTP",
                            colour: BEHIND_HTTP,
                            value: |r| Some(r.http_replay_floor.per_second),
                        },
                    ],
                },
            ],
        ),
        (
            dir.join("cpu.svg"),
            "CPU ms per request",
            [
                Panel {
                    title: "First requests",
                    series: vec![
                        Series { label: "payments (serve)", colour: BLUE, value: |r| cpu(&r.payments) },
                        Series { label: "floor (its loop)", colour: CYAN, value: |r| cpu(&r.floor) },
                        Series {
                            label: "floor over HTTP (its server)",
                            colour: BEHIND_HTTP,
                            value: |r| cpu(&r.http_floor),
                        },
                    ],
                },
                Panel {
                    title: "Replays",
                    series: vec![
                        Series { label: "cold replays (serve)", colour: RED, value: |r| cpu(r.cold_replays.as_ref()?) },
                        Series { label: "from memory (serve)", colour: GREEN, value: |r| cpu(&r.replays) },
                        Series { label: "replay floor (its loop)", colour: MAGENTA, value: |r| cpu(&r.replay_floor) },
                        Series {
                            label: "replay floor over HTTP (its server)",
                            colour: BEHIND_HTTP,
                            value: |r| cpu(&r.http_replay_floor),
                        },
                    ],
                },
            ],
        ),
        (
            dir.join("ratios.svg"),
            "over the floor",
            [
                Panel {
                    title: "Payments over the floor",
                    series: vec![
                        Series { label: "throughput", colour: BLUE, value: |r| Some(r.payments_over_floor()) },
                        Series { label: "p50 latency", colour: CYAN, value: |r| Some(r.p50_over_floor()) },
                        Series { label: "CPU", colour: BLACK, value: Report::cpu_over_floor },
                        Series {
                            label: "throughput over the floor behind HTTP's",
                            colour: BEHIND_HTTP,
                            value: |r| Some(r.payments_over_http_floor()),
                        },
                        Series {
                            label: "CPU over the floor behind HTTP's",
                            colour: MAGENTA,
                            value: Report::cpu_over_http_floor,
                        },
                    ],
                },
                Panel {
                    title: "Cold replays over the replay floor",
                    series: vec![
                        Series { label: "throughput", colour: RED, value: Report::cold_replays_over_floor },
                        Series { label: "CPU", colour: BLACK, value: Report::cold_cpu_over_floor },
                        Series {
                            label: "throughput over the replay floor behind HTTP's",
                            colour: BEHIND_HTTP,
                            value: Report::cold_replays_over_http_floor,
                        },
                        Series {
                            label: "CPU over the replay floor behind HTTP's",
                            colour: MAGENTA,
                            value: Report::cold_cpu_over_http_floor,
                        },
                    ],
                },
            ],
        ),
    ];
    let mut drawn = Vec::new();
    for (path, axis, panels) in pictures {
        picture(runs, &path, axis, &panels).map_err(|e| PlotError { path: path.clone(), reason: e.to_string() })?;
        drawn.push(path);
    }
    Ok(drawn)
}

/// One side of a picture: its title and its lines.
struct Panel {
    title: &'static str,
    series: Vec<Series>,
}

fn cpu(figures: &Figures) -> Option<f64> {
    figures.cpu_ms_per_request
}

/// A series at each concurrency: the median of its runs, the lowest and
/// the highest.
fn points(runs: &[Report], line: &Series) -> Vec<(f64, Spread)> {
    levels(runs)
        .into_iter()
        .filter_map(|c| {
            let values = runs.iter().filter(|r| r.concurrency == c).filter_map(|r| (line.value)(r));
            Some((c.max(1) as f64, Spread::of(values)?))
        })
        .collect()
}

fn picture(runs: &[Report], path: &Path, axis: &str, panels: &[Panel]) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    for (area, panel) in root.split_evenly((1, panels.len())).iter().zip(panels) {
        chart(runs, area, axis, panel)?;
    }
    root.present()?;
    Ok(())
}

fn chart(
    runs: &[Report],
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    axis: &str,
    panel: &Panel,
) -> Result<(), Box<dyn std::error::Error>> {
    let highest = runs.iter().flat_map(|r| panel.series.iter().filter_map(|s| (s.value)(r))).fold(0.0_f64, f64::max);
    let widest = runs.iter().map(|r| r.concurrency).max().unwrap_or(1).max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..widest * 1.08, 0.0..(highest * 1.2).max(f64::EPSILON))?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("requests in flight")
        .y_desc(axis)
        .x_label_formatter(&|c| format!("{c:.0}"))
        .label_style(("sans-serif", 14))
        .draw()?;
    for line in &panel.series {
        let points = points(runs, line);
        let colour = line.colour;
        chart
            .draw_series(LineSeries::new(points.iter().map(|&(c, s)| (c, s.median)), colour.stroke_width(2)))?
            .label(line.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(points.iter().map(|&(c, s)| Circle::new((c, s.median), 4, colour.filled())))?;
        chart.draw_series(
            points.iter().map(|&(c, s)| PathElement::new([(c, s.min), (c, s.max)], colour.stroke_width(1))),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn figures(label: &'static str, per_second: f64) -> Figures {
        Figures {
            label,
            requests: 100,
            failures: 0,
            seconds: 1.0,
            per_second,
            p50_ms: 5.0,
            p99_ms: 9.0,
            statuses: BTreeMap::from([(201, 100)]),
            cpu_ms_per_request: Some(2.5),
            postgres_cpu_ms_per_request: Some(1.5),
            machine_cpu_ms_per_request: Some(6.0),
        }
    }

    fn run(concurrency: usize) -> Report {
        Report {
            requests: 100,
            concurrency,
            payments: figures("payments", 90.0 * concurrency as f64),
            replays: figures("replays", 3000.0 * concurrency as f64),
            cold_replays: Some(figures("cold replays", 300.0 * concurrency as f64)),
            floor: figures("floor", 100.0 * concurrency as f64),
            replay_floor: figures("replay floor", 320.0 * concurrency as f64),
            http_floor: figures("floor over HTTP", 95.0 * concurrency as f64),
            http_replay_floor: figures("replay floor over HTTP", 310.0 * concurrency as f64),
        }
    }

    /// With no font anywhere to be found, both plots are drawn, their labels
    /// as text.
    #[test]
    fn plots_are_svg_with_their_labels_as_text() {
        let dir = std::env::temp_dir().join(format!("keyfence-plots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let drawn = draw(&[run(1), run(1), run(8), run(32)], &dir).unwrap();
        assert_eq!(drawn.len(), 3);
        for path in &drawn {
            let svg = std::fs::read_to_string(path).unwrap();
            assert!(svg.starts_with("<svg"), "{} is not SVG", path.display());
            assert!(svg.contains("<text") && svg.contains("requests in flight"), "{} lacks its labels", path.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
