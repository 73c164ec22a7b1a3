//! Line charts as standalone SVG files, for the benchmark sweeps (`cargo xtask bench --sweep`):
//! one or more series over a shared x axis, each axis linear or logarithmic, with ticks, grid,
//! legend and axis labels. No dependencies: the SVG is written by hand.

use std::fmt::Write as _;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's name of the line.
    pub name: String,
    /// Its points (x, y); points with a non-finite or (on a log axis) non-positive coordinate are
    /// left out.
    pub points: Vec<(f64, f64)>,
}

/// A chart.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Title above the plot.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis.
    pub y_label: String,
    /// Base-2 logarithmic x axis (sizes, queue pair counts).
    pub x_log2: bool,
    /// Base-10 logarithmic y axis.
    pub y_log10: bool,
    /// The lines.
    pub series: Vec<Series>,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 60.0;
/// Line colours, in series order (distinguishable in colour and in grey).
const COLOURS: [&str; 5] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
/// Dash patterns, in series order (so the lines differ without colour too).
const DASHES: [&str; 5] = ["", "6,4", "2,3", "8,3,2,3", "1,2"];

/// An axis mapping data values to pixels.
struct Axis {
    log: Option<f64>,
    lo: f64,
    hi: f64,
    from: f64,
    to: f64,
}

impl Axis {
    fn new(values: impl Iterator<Item = f64>, log: Option<f64>, from: f64, to: f64, zero: bool) -> Axis {
        let t = |v: f64| log.map_or(v, |b| v.log(b));
        let (mut lo, mut hi) =
            values.map(t).fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
        if !lo.is_finite() || !hi.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        match log {
            Some(_) => {
                lo = lo.floor();
                hi = hi.ceil().max(lo + 1.0);
            }
            None => {
                if zero {
                    lo = lo.min(0.0);
                }
                let step = nice_step((hi - lo).max(f64::MIN_POSITIVE) / 5.0);
                lo = (lo / step).floor() * step;
                hi = ((hi / step).ceil() * step).max(lo + step);
            }
        }
        Axis { log, lo, hi, from, to }
    }

    fn pos(&self, v: f64) -> f64 {
        let t = self.log.map_or(v, |b| v.log(b));
        self.from + (t - self.lo) / (self.hi - self.lo) * (self.to - self.from)
    }

    /// Tick values (data units).
    fn ticks(&self) -> Vec<f64> {
        match self.log {
            Some(b) => {
                let span = (self.hi - self.lo) as i64;
                // At most about 12 labels: every k-th power.
                let k = (span / 12 + 1).max(1);
                (self.lo as i64..=self.hi as i64).filter(|e| e % k == 0).map(|e| b.powi(e as i32)).collect()
            }
            None => {
                let step = nice_step((self.hi - self.lo) / 5.0);
                let n = ((self.hi - self.lo) / step).round() as i64;
                (0..=n).map(|i| self.lo + i as f64 * step).collect()
            }
        }
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= raw {
            return m * p;
        }
    }
    10.0 * p
}

/// A tick label: sizes in binary units on a log2 axis, plain numbers otherwise.
fn label(v: f64, log2: bool) -> String {
    if log2 {
        let v = v.round() as u64;
        return match v {
            _ if v >= 1 << 20 && v % (1 << 20) == 0 => format!("{}M", v >> 20),
            _ if v >= 1 << 10 && v % (1 << 10) == 0 => format!("{}K", v >> 10),
            _ => v.to_string(),
        };
    }
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

impl Chart {
    fn usable(&self, p: (f64, f64)) -> bool {
        p.0.is_finite() && p.1.is_finite() && (!self.x_log2 || p.0 > 0.0) && (!self.y_log10 || p.1 > 0.0)
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        self.svg_styled(&[])
    }

    /// [`svg`](Self::svg) with the style of series `i` given by `styles[i]`: (colour index,
    /// dash index) into the chart's palettes (modulo their length), e.g. one colour per level
    /// and one dash pattern per kind of line. Series past the end of `styles` are styled by
    /// their index, as in `svg`.
    pub fn svg_styled(&self, styles: &[(usize, usize)]) -> String {
        let pts = || self.series.iter().flat_map(|s| s.points.iter().copied()).filter(|&p| self.usable(p));
        let x = Axis::new(pts().map(|p| p.0), self.x_log2.then_some(2.0), LEFT, WIDTH - RIGHT, false);
        let y = Axis::new(pts().map(|p| p.1), self.y_log10.then_some(10.0), HEIGHT - BOTTOM, TOP, true);
        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<text x="{}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
            (LEFT + WIDTH - RIGHT) / 2.0,
            esc(&self.title)
        );
        for t in x.ticks() {
            let px = x.pos(t);
            let _ = writeln!(
                o,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{}" stroke="#e0e0e0"/><text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##,
                HEIGHT - BOTTOM,
                HEIGHT - BOTTOM + 18.0,
                label(t, self.x_log2)
            );
        }
        for t in y.ticks() {
            let py = y.pos(t);
            let _ = writeln!(
                o,
                r##"<line x1="{LEFT}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                WIDTH - RIGHT,
                LEFT - 6.0,
                py + 4.0,
                label(t, false)
            );
        }
        let _ = writeln!(
            o,
            r#"<rect x="{LEFT}" y="{TOP}" width="{}" height="{}" fill="none" stroke="black"/>"#,
            WIDTH - RIGHT - LEFT,
            HEIGHT - BOTTOM - TOP
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            (LEFT + WIDTH - RIGHT) / 2.0,
            HEIGHT - 14.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            o,
            r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">{1}</text>"#,
            (TOP + HEIGHT - BOTTOM) / 2.0,
            esc(&self.y_label)
        );
        for (i, s) in self.series.iter().enumerate() {
            let (c, d) = styles.get(i).copied().unwrap_or((i, i));
            let colour = COLOURS[c % COLOURS.len()];
            let dash = DASHES[d % DASHES.len()];
            let mut points: Vec<(f64, f64)> = s.points.iter().copied().filter(|&p| self.usable(p)).collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let path: Vec<String> =
                points.iter().map(|&(a, b)| format!("{:.1},{:.1}", x.pos(a), y.pos(b))).collect();
            let dash_attr =
                if dash.is_empty() { String::new() } else { format!(r#" stroke-dasharray="{dash}""#) };
            if !path.is_empty() {
                let _ = writeln!(
                    o,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"{dash_attr}/>"#,
                    path.join(" ")
                );
            }
            for &(a, b) in &points {
                let _ = writeln!(
                    o,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>"#,
                    x.pos(a),
                    y.pos(b)
                );
            }
            let ly = TOP + 10.0 + 22.0 * i as f64;
            let lx = WIDTH - RIGHT + 14.0;
            let _ = writeln!(
                o,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash_attr}/><text x="{}" y="{}">{}</text>"#,
                lx + 28.0,
                lx + 34.0,
                ly + 4.0,
                esc(&s.name)
            );
        }
        o.push_str("</svg>\n");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(x_log2: bool, y_log10: bool) -> Chart {
        Chart {
            title: "write_bw <size>".into(),
            x_label: "message size [B]".into(),
            y_label: "MB/s".into(),
            x_log2,
            y_log10,
            series: vec![
                Series {
                    name: "ours (safe)".into(),
                    points: vec![(2.0, 0.5), (4096.0, 30.0), (1048576.0, 50.0)],
                },
                Series {
                    name: "perftest".into(),
                    points: vec![(2.0, 0.4), (4096.0, f64::NAN), (1048576.0, 49.0)],
                },
            ],
        }
    }

    #[test]
    fn svg_has_every_series_legend_and_escaped_text() {
        let svg = chart(true, false).svg();
        assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        // NaN points are left out: 3 + 2 markers.
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains("ours (safe)") && svg.contains("perftest"));
        assert!(svg.contains("write_bw &lt;size&gt;"));
        assert!(svg.contains(">1M<") && svg.contains(">4K<"), "binary size labels");
    }

    #[test]
    fn points_map_inside_the_plot_area() {
        let c = chart(true, true);
        let pts = || c.series.iter().flat_map(|s| s.points.iter().copied()).filter(|&p| c.usable(p));
        let x = Axis::new(pts().map(|p| p.0), Some(2.0), LEFT, WIDTH - RIGHT, false);
        let y = Axis::new(pts().map(|p| p.1), Some(10.0), HEIGHT - BOTTOM, TOP, true);
        for (a, b) in pts() {
            let (px, py) = (x.pos(a), y.pos(b));
            assert!((LEFT..=WIDTH - RIGHT).contains(&px), "{a} → {px}");
            assert!((TOP..=HEIGHT - BOTTOM).contains(&py), "{b} → {py}");
        }
        // Larger values are higher up (smaller y pixel).
        assert!(y.pos(50.0) < y.pos(0.5));
    }

    #[test]
    fn nice_steps_and_labels() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(12.0), 20.0);
        assert_eq!(label(65536.0, true), "64K");
        assert_eq!(label(2.0, true), "2");
        assert_eq!(label(2.5, false), "2.5");
        assert_eq!(label(0.25, false), "0.25");
        let styled = chart(true, false).svg_styled(&[(2, 0), (2, 1)]);
        assert_eq!(styled.matches(r##"stroke="#2ca02c""##).count(), 4, "both lines and legends in colour 2");
        assert_eq!(styled.matches(r#"stroke-dasharray="6,4""#).count(), 2, "the second dashed");
        let empty = Chart { series: vec![], ..chart(false, false) };
        assert!(empty.svg().contains("</svg>"), "an empty chart still renders");
    }
}
