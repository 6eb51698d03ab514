//! SVG pictures of a replay (plotters, SVG backend only): the latency CDF, one curve per group, and the
//! mean per-stage split as stacked bars.

use std::path::Path;

use plotters::prelude::*;

use super::run::Stages;

/// One CDF curve: a group's label and its request latencies.
pub struct Curve {
    pub label: String,
    pub values_ms: Vec<f64>,
}

type PlotResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn err<E: std::fmt::Display>(e: E) -> Box<dyn std::error::Error + Send + Sync> {
    e.to_string().into()
}

/// `latency_cdf.svg`: fraction of requests answered within x seconds, with the 15 s budget marked.
pub fn latency_cdf(path: &Path, curves: &[Curve]) -> PlotResult {
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max_s = curves.iter().flat_map(|c| c.values_ms.iter()).fold(0.0f64, |m, &v| m.max(v)) / 1e3;
    let x_max = (max_s * 1.05).max(0.1);
    let mut chart = ChartBuilder::on(&root)
        .caption("Replay latency CDF (query in → final answer)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..x_max, 0f64..1.0)
        .map_err(err)?;
    chart.configure_mesh().x_desc("latency (s)").y_desc("fraction of requests").draw().map_err(err)?;
    for (i, c) in curves.iter().enumerate() {
        let mut v: Vec<f64> = c.values_ms.iter().map(|x| x / 1e3).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let mut points = vec![(0.0, 0.0)];
        for (k, x) in v.iter().enumerate() {
            points.push((*x, k as f64 / n));
            points.push((*x, (k + 1) as f64 / n));
        }
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(c.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    if x_max >= 15.0 {
        chart.draw_series(LineSeries::new([(15.0, 0.0), (15.0, 1.0)], RED.mix(0.5))).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// A stage's name and how to read it from [`Stages`].
type Part = (&'static str, fn(&Stages) -> f64);

/// `stages.svg`: one stacked bar per group, mean ms per stage.
pub fn stages(path: &Path, bars: &[(String, Stages)]) -> PlotResult {
    let parts: [Part; 6] = [
        ("prompt", |s| s.prompt_ms),
        ("prefill", |s| s.prefill_ms),
        ("decode", |s| s.decode_ms),
        ("tools", |s| s.tools_ms),
        ("hooks", |s| s.hooks_ms),
        ("other", |s| s.other_ms),
    ];
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let total_max = bars.iter().map(|(_, s)| parts.iter().map(|(_, f)| f(s)).sum::<f64>()).fold(0.0f64, f64::max);
    let labels: Vec<String> = bars.iter().map(|(l, _)| l.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption("Mean time per stage (ms)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(bars.len().max(1) as f64 - 0.5), 0f64..(total_max * 1.1).max(1.0))
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.len().max(1))
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 { labels.get(i as usize).cloned().unwrap_or_default() } else { String::new() }
        })
        .y_desc("ms")
        .draw()
        .map_err(err)?;
    for (k, (name, f)) in parts.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        let rects: Vec<Rectangle<(f64, f64)>> = bars
            .iter()
            .enumerate()
            .map(|(i, (_, s))| {
                let below: f64 = parts[..k].iter().map(|(_, g)| g(s)).sum();
                let x = i as f64;
                Rectangle::new([(x - 0.3, below), (x + 0.3, below + f(s))], color.filled())
            })
            .collect();
        chart
            .draw_series(rects)
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
