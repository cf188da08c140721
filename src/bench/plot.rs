//! Plots of a front-door sweep: throughput and the serve process's CPU per
//! request against concurrency, for payments, replays and their floors, drawn
//! to PNG files. Text is set in a TrueType font read from the system (the
//! DejaVu or Liberation sans faces most distributions ship), or from
//! `KEYFENCE_PLOT_FONT`.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::front_door::{Figures, Report};

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error(
        "no font to label the plots with: set KEYFENCE_PLOT_FONT to a .ttf file \
         (on Debian/Ubuntu: apt-get install fonts-dejavu-core)"
    )]
    NoFont,
    #[error("drawing {path}: {reason}")]
    Draw { path: PathBuf, reason: String },
}

/// One line of a plot: a label, a colour, and a figure read off each run.
struct Series {
    label: &'static str,
    colour: RGBColor,
    value: fn(&Report) -> Option<f64>,
}

/// Draws `throughput.png` and `cpu.png` into `dir`, each with a panel for
/// first requests and one for replays; returns their paths.
pub fn draw(runs: &[Report], dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    register_font()?;
    let pictures: [(PathBuf, &str, [Panel; 2]); 2] = [
        (
            dir.join("throughput.png"),
            "requests per second",
            [
                Panel {
                    title: "First requests",
                    series: vec![
                        Series { label: "payments", colour: BLUE, value: |r| Some(r.payments.per_second) },
                        Series { label: "floor", colour: CYAN, value: |r| Some(r.floor.per_second) },
                    ],
                },
                Panel {
                    title: "Replays",
                    series: vec![
                        Series { label: "replays", colour: RED, value: |r| Some(r.replays.per_second) },
                        Series { label: "replay floor", colour: MAGENTA, value: |r| Some(r.replay_floor.per_second) },
                    ],
                },
            ],
        ),
        (
            dir.join("cpu.png"),
            "serve CPU ms per request",
            [
                Panel {
                    title: "First requests",
                    series: vec![Series { label: "payments", colour: BLUE, value: |r| cpu(&r.payments) }],
                },
                Panel {
                    title: "Replays",
                    series: vec![Series { label: "replays", colour: RED, value: |r| cpu(&r.replays) }],
                },
            ],
        ),
    ];
    let mut drawn = Vec::new();
    for (path, axis, panels) in pictures {
        picture(runs, &path, axis, &panels)
            .map_err(|e| PlotError::Draw { path: path.clone(), reason: e.to_string() })?;
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
    figures.serve_cpu_ms_per_request
}

fn picture(runs: &[Report], path: &Path, axis: &str, panels: &[Panel]) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    for (area, panel) in root.split_evenly((1, panels.len())).iter().zip(panels) {
        chart(runs, area, axis, panel)?;
    }
    root.present()?;
    Ok(())
}

fn chart(
    runs: &[Report],
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
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
        let points: Vec<(f64, f64)> =
            runs.iter().filter_map(|r| Some((r.concurrency.max(1) as f64, (line.value)(r)?))).collect();
        let colour = line.colour;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), colour.stroke_width(2)))?
            .label(line.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
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

/// Makes a TrueType face the plots' `sans-serif`.
fn register_font() -> Result<(), PlotError> {
    let chosen = std::env::var_os("KEYFENCE_PLOT_FONT").map(PathBuf::from);
    let candidates = chosen.into_iter().chain(FONT_PATHS.iter().map(PathBuf::from));
    let bytes = candidates.filter_map(|path| std::fs::read(path).ok()).next().ok_or(PlotError::NoFont)?;
    // plotters keeps the face for the life of the process.
    plotters::style::register_font("sans-serif", FontStyle::Normal, Vec::leak(bytes)).map_err(|_| PlotError::NoFont)
}
