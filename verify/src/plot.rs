//! The picture of a failing check (`ssd-oracle check --plot FILE.svg`): per failing tensor, the
//! heat map of the error/bound ratio over (token, head) (for `chunk_states` (chunk, head), for
//! `final_states` (state, channel)) with chunk boundaries, sequence starts and the padding of
//! the last chunk marked, and beside it the profile of the largest ratio per position in the
//! chunk (per chunk for `chunk_states`, per head for `final_states`) on a log scale with the
//! bound drawn at 1.
//!
//! Each heat-map cell is the largest ratio of the elements it covers ([`crate::diagnose::Heat`]:
//! at most [`crate::diagnose::MAX_COLS`] x [`crate::diagnose::MAX_ROWS`] cells, so a 65k-token,
//! 80-head case is drawn as readily as a small one). The colour scale changes hue at 1, the
//! bound: blues at or below it (darker towards 1), yellow to dark red above it (darker as the
//! ratio grows, one step per quarter decade, up to `10^4`).
//!
//! The picture is SVG, drawn with plotters' SVG backend (text as SVG text: no font files, no
//! system library) and written atomically (a temporary file, then a rename).

use std::path::Path;

use plotters::prelude::*;

use crate::diagnose::{Heat, Profile, TensorMap};
use crate::error::VerifyError;
use crate::report::Report;
use crate::tolerance::OutputName;

/// `log10` of the lowest and highest ratio the colour scale tells apart.
const LOG_LO: f64 = -3.0;
const LOG_HI: f64 = 4.0;
const WIDTH: u32 = 1200;
const HEADER: u32 = 128;
const PANEL: u32 = 330;
const HEAT_WIDTH: u32 = 820;

/// Checks that `path` names an SVG file (`.svg`, any case).
///
/// # Errors
/// [`VerifyError::Usage`] with a one-line reason otherwise.
pub fn check_plot_path(path: &Path) -> Result<(), VerifyError> {
    let svg = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    if svg && path.file_name().is_some() {
        Ok(())
    } else {
        Err(VerifyError::Usage(format!(
            "--plot `{}`: the picture is SVG, give a file name ending in .svg",
            path.display()
        )))
    }
}

/// Draws the report's map and writes it to `path` (an `.svg` file), atomically. A passing
/// report gives a picture that says so.
///
/// # Errors
/// [`VerifyError::Usage`] for a path that does not end in `.svg`, [`VerifyError::Io`] when
/// the file cannot be written (nothing is left behind).
pub fn write_plot(report: &Report, path: &Path) -> Result<(), VerifyError> {
    check_plot_path(path)?;
    let svg = render_svg(report)?;
    crate::fixture::write_atomic(path, svg.as_bytes())
}

fn draw_err<E: std::fmt::Debug>(e: E) -> VerifyError {
    VerifyError::Usage(format!("cannot draw the picture: {e:?}"))
}

/// The colour of one ratio (see the module documentation).
pub fn colour(r: f64) -> RGBColor {
    if r <= 0.0 {
        return RGBColor(250, 250, 250);
    }
    let v = if r.is_finite() {
        (r.log10() * 4.0).round() / 4.0
    } else {
        LOG_HI
    };
    let v = v.clamp(LOG_LO, LOG_HI);
    let mix = |a: (f64, f64, f64), b: (f64, f64, f64), t: f64| {
        let t = t.clamp(0.0, 1.0);
        RGBColor(
            (a.0 + (b.0 - a.0) * t).round() as u8,
            (a.1 + (b.1 - a.1) * t).round() as u8,
            (a.2 + (b.2 - a.2) * t).round() as u8,
        )
    };
    if r <= 1.0 {
        mix(
            (232.0, 240.0, 250.0),
            (60.0, 110.0, 185.0),
            (v - LOG_LO) / -LOG_LO,
        )
    } else {
        let t = v / LOG_HI;
        if t < 0.5 {
            mix((255.0, 215.0, 60.0), (235.0, 90.0, 25.0), t * 2.0)
        } else {
            mix((235.0, 90.0, 25.0), (110.0, 0.0, 20.0), t * 2.0 - 1.0)
        }
    }
}

/// The SVG text of the picture.
///
/// # Errors
/// [`VerifyError::Usage`] if plotters fails to draw (it does not for a report's maps).
pub fn render_svg(report: &Report) -> Result<String, VerifyError> {
    let n = report.error_map.len().max(1) as u32;
    let height = HEADER + n * PANEL;
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (header, body) = root.split_vertically(HEADER);
        draw_header(&header, report)?;
        if report.error_map.is_empty() {
            body.draw_text(
                "PASS: every element within its bound, nothing to draw",
                &("sans-serif", 18).into_text_style(&body),
                (20, 20),
            )
            .map_err(draw_err)?;
        }
        let panels = body.split_evenly((n as usize, 1));
        for (m, area) in report.error_map.iter().zip(panels.iter()) {
            draw_panel(area, m)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(buf)
}

fn draw_header<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    report: &Report,
) -> Result<(), VerifyError> {
    let title = ("sans-serif", 17).into_text_style(area);
    let small = ("sans-serif", 13).into_text_style(area);
    let verdict = if report.passed { "PASS" } else { "FAIL" };
    area.draw_text(
        &format!(
            "{verdict}: {} against {}, --precision {} (worst error/bound {:.3e})",
            report.case, report.candidate, report.precision, report.worst_ratio
        ),
        &title,
        (12, 8),
    )
    .map_err(draw_err)?;
    let hint = report.hints.first().map_or_else(
        || "no hint: the pattern names no stage".to_string(),
        |h| format!("hint: {} ({}): {}", h.stage, h.confidence, h.text),
    );
    for (k, line) in wrap(&hint, 165).iter().take(2).enumerate() {
        area.draw_text(line, &small, (12, 32 + 17 * k as i32))
            .map_err(draw_err)?;
    }
    area.draw_text(
        "cells: largest error/bound; lines: grey chunk boundaries, black sequence starts, purple padding past seqlen",
        &small,
        (12, 68),
    )
    .map_err(draw_err)?;
    // The colour bar: log10 ratio from LOG_LO to LOG_HI, the bound at 1.
    let (x0, y0, w, h) = (120i32, 92i32, 600i32, 14i32);
    let steps = ((LOG_HI - LOG_LO) * 4.0) as i32;
    for s in 0..steps {
        let v = LOG_LO + (s as f64 + 0.5) / 4.0;
        let xa = x0 + w * s / steps;
        let xb = x0 + w * (s + 1) / steps;
        area.draw(&Rectangle::new(
            [(xa, y0), (xb, y0 + h)],
            colour(10f64.powf(v)).filled(),
        ))
        .map_err(draw_err)?;
    }
    area.draw_text("error/bound", &small, (12, y0))
        .map_err(draw_err)?;
    for k in LOG_LO as i32..=LOG_HI as i32 {
        let x = x0 + (w as f64 * (k as f64 - LOG_LO) / (LOG_HI - LOG_LO)) as i32;
        let label = if k == 0 {
            "1 = bound".to_string()
        } else {
            format!("1e{k}")
        };
        let style = if k == 0 {
            BLACK.stroke_width(3)
        } else {
            BLACK.stroke_width(1)
        };
        area.draw(&PathElement::new(vec![(x, y0 - 3), (x, y0 + h + 3)], style))
            .map_err(draw_err)?;
        area.draw_text(
            &label,
            &("sans-serif", 12).into_text_style(area),
            (x - 8, y0 + h + 4),
        )
        .map_err(draw_err)?;
    }
    Ok(())
}

/// `text` in lines of at most about `width` characters, broken at spaces (the second line
/// ends with "..." when more would follow).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split(' ') {
        let last = lines.last_mut().expect("one line");
        if !last.is_empty() && last.len() + 1 + word.len() > width {
            lines.push(word.to_string());
        } else {
            if !last.is_empty() {
                last.push(' ');
            }
            last.push_str(word);
        }
    }
    if lines.len() > 2 {
        lines.truncate(2);
        lines[1].push_str(" ...");
    }
    lines
}

/// The profile drawn beside the heat map, and its axis name.
fn side_profile(m: &TensorMap) -> Option<(&Profile, &'static str)> {
    let key = match m.tensor {
        OutputName::Out | OutputName::DACumsum => "position_in_chunk",
        OutputName::ChunkStates => "chunk",
        OutputName::FinalStates => "head",
        // Gradients have no error map (see `diagnose`).
        _ => "head",
    };
    let axis = match key {
        "position_in_chunk" => "position in chunk",
        k => k,
    };
    m.by.get(key).map(|p| (p, axis))
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    m: &TensorMap,
) -> Result<(), VerifyError> {
    let (left, right) = area.split_horizontally(HEAT_WIDTH);
    draw_heat(&left, m)?;
    if let Some((p, axis)) = side_profile(m) {
        draw_profile(&right, p, axis)?;
    }
    Ok(())
}

fn draw_heat<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    m: &TensorMap,
) -> Result<(), VerifyError> {
    let h: &Heat = &m.heat;
    let worst = h.values.iter().copied().fold(0.0_f64, f64::max);
    let caption = format!(
        "{}: {} of {} elements over the bound (worst {:.3e}); {} x {}, {} per cell",
        m.tensor,
        m.over,
        m.elements,
        worst,
        h.x_axis,
        h.y_axis,
        if h.x_bin * h.y_bin == 1 {
            "1 element".to_string()
        } else {
            format!("{} x {}", h.x_bin, h.y_bin)
        }
    );
    let (xl, yl) = (h.x_len.max(1) as f64, h.y_len.max(1) as f64);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(46)
        .build_cartesian_2d(0f64..xl, yl..0f64)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(h.x_axis)
        .y_desc(h.y_axis)
        .x_labels(10)
        .y_labels(8)
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .y_label_formatter(&|v| format!("{}", v.round() as i64))
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(draw_err)?;
    // Runs of equal colour along each row, one rectangle each.
    let mut rects = Vec::new();
    for row in 0..h.rows {
        let y0 = (row * h.y_bin) as f64;
        let y1 = ((row + 1) * h.y_bin).min(h.y_len) as f64;
        let mut c = 0;
        while c < h.cols {
            let col = colour(h.values[row * h.cols + c]);
            let mut e = c + 1;
            while e < h.cols && colour(h.values[row * h.cols + e]) == col {
                e += 1;
            }
            let x0 = (c * h.x_bin) as f64;
            let x1 = (e * h.x_bin).min(h.x_len) as f64;
            rects.push(Rectangle::new([(x0, y0), (x1, y1)], col.filled()));
            c = e;
        }
    }
    chart.draw_series(rects).map_err(draw_err)?;
    let line = |x: usize, style: ShapeStyle| {
        PathElement::new(vec![(x as f64, 0.0), (x as f64, yl)], style)
    };
    // At most about 100 chunk lines (every k-th chunk beyond), so that the cells stay visible.
    let every = h.chunk_marks.len().div_ceil(100).max(1);
    chart
        .draw_series(
            h.chunk_marks
                .iter()
                .step_by(every)
                .map(|&x| line(x, RGBColor(120, 120, 120).stroke_width(1))),
        )
        .map_err(draw_err)?;
    chart
        .draw_series(
            h.pad_marks
                .iter()
                .map(|&x| line(x, RGBColor(150, 0, 170).stroke_width(2))),
        )
        .map_err(draw_err)?;
    let every = h.seq_marks.len().div_ceil(500).max(1);
    chart
        .draw_series(
            h.seq_marks
                .iter()
                .step_by(every)
                .map(|&x| line(x, BLACK.stroke_width(2))),
        )
        .map_err(draw_err)?;
    Ok(())
}

fn draw_profile<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    p: &Profile,
    axis: &str,
) -> Result<(), VerifyError> {
    let top = p
        .max_ratio
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(10.0_f64, f64::max)
        .min(1e12)
        * 2.0;
    let lo = 10f64.powf(LOG_LO);
    let n = p.max_ratio.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("largest error/bound per {axis}"),
            ("sans-serif", 13),
        )
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(52)
        .build_cartesian_2d(-0.5f64..n - 0.5, (lo..top).log_scale())
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_desc(axis)
        .y_desc("error / bound")
        .x_labels(8)
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(draw_err)?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(-0.5, 1.0), (n - 0.5, 1.0)],
            RGBColor(200, 0, 0).stroke_width(2),
        )))
        .map_err(draw_err)?;
    let pts: Vec<(f64, f64)> = p
        .max_ratio
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as f64, if v.is_finite() { v.max(lo) } else { top }))
        .collect();
    chart
        .draw_series(LineSeries::new(
            pts.clone(),
            RGBColor(40, 40, 40).stroke_width(1),
        ))
        .map_err(draw_err)?;
    if pts.len() <= 64 {
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, colour(y).filled())),
            )
            .map_err(draw_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_colour_changes_hue_at_the_bound() {
        let below = colour(0.99);
        let above = colour(1.01);
        // Blue below (blue channel highest), warm above (red channel highest).
        assert!(
            below.2 > below.0 && above.0 > above.2,
            "{below:?} {above:?}"
        );
        assert_eq!(colour(0.0), RGBColor(250, 250, 250));
        assert_eq!(colour(f64::INFINITY), colour(1e9));
    }

    #[test]
    fn only_svg_paths_are_taken() {
        assert!(check_plot_path(Path::new("a/b.svg")).is_ok());
        assert!(check_plot_path(Path::new("B.SVG")).is_ok());
        for bad in ["b.png", "b", "dir/", ".svg/x.txt"] {
            let e = check_plot_path(Path::new(bad)).unwrap_err().to_string();
            assert!(e.contains(".svg") && !e.contains('\n'), "{bad}: {e}");
        }
    }

    /// A 65,536-token, 80-head `out` map (headdim and dstate 1 to keep the problem small; the
    /// map's grid does not depend on them): the heat map stays at most 400 cells wide, one row
    /// per head, and the panel is drawn quickly and compactly.
    #[test]
    fn a_65k_token_80_head_map_is_drawn_aggregated() {
        use ssd_reference::random::{random_problem, ProblemSpec, SeqIdx};
        use ssd_reference::Dims;
        let dims = Dims::new(1, 65_536, 80, 1, 1, 1);
        let spec = ProblemSpec {
            seq_idx: SeqIdx::Segments {
                segments: 4,
                first: 0,
            },
            ..ProblemSpec::full(dims, 256)
        };
        let p = random_problem(&spec, 1).unwrap();
        // Ratios growing with the chunk index, over the bound from chunk 1 on in odd heads.
        let r = ndarray::Array4::from_shape_fn((1, 65_536, 80, 1), |(_, t, h, _)| {
            if h % 2 == 1 {
                (t / 256) as f64 * 0.5
            } else {
                1e-2
            }
        })
        .into_dyn();
        let t0 = std::time::Instant::now();
        let m = crate::diagnose::error_map(&p, OutputName::Out, &r);
        let map_s = t0.elapsed().as_secs_f64();
        assert_eq!((m.heat.cols, m.heat.rows), (400, 80));
        assert_eq!(m.heat.x_bin, 164);
        assert_eq!(m.heat.chunk_marks.len(), 255);
        assert_eq!(m.heat.seq_marks.len(), 3);
        let t0 = std::time::Instant::now();
        let mut buf = String::new();
        {
            let root = SVGBackend::with_string(&mut buf, (WIDTH, PANEL)).into_drawing_area();
            draw_panel(&root, &m).unwrap();
            root.present().unwrap();
        }
        let draw_s = t0.elapsed().as_secs_f64();
        println!("map {map_s:.3} s, panel {draw_s:.3} s, {} bytes", buf.len());
        assert!(buf.len() < 8 << 20, "{} bytes", buf.len());
    }

    #[test]
    fn wrap_breaks_at_spaces_in_two_lines_at_most() {
        let w = wrap("aaa bbb ccc ddd eee", 7);
        assert_eq!(w, vec!["aaa bbb".to_string(), "ccc ddd ...".to_string()]);
        assert_eq!(wrap("short", 7), vec!["short".to_string()]);
    }
}
