//! `ferroccl plot FILE... -o out.svg`: bus bandwidth against size (log scale) for each
//! operation, one line per library and record, with the small sizes' latency beside it.
//!
//! Reads the records `bench --vs-nccl --json` writes (both libraries) and plain `bench --json`
//! files (ferroccl alone). Out-of-place figures are drawn; in-place ones stay in the JSON. With
//! `--best`, one line per library instead: at each size its best time over every record and both
//! halves (in and out of place), as `ferroccl best` counts it (`best::best_lines`; for a run of
//! `bench/h200.sh`: each library's best launch mode, buffer kind and placement, size by size).

use crate::best;
use crate::size::{human, parse_size};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug, Clone)]
pub struct PlotArgs {
    /// JSON records from `ferroccl bench --json` (with or without --vs-nccl)
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The SVG file to write
    #[arg(short = 'o', long = "output", default_value = "bench.svg")]
    pub output: PathBuf,
    /// Largest size in the latency panels
    #[arg(long = "latency-max", default_value = "1M", value_parser = parse_size)]
    pub latency_max: usize,
    /// One line per library (and type): its best time at each size over every record and both
    /// halves (in and out of place)
    #[arg(long)]
    pub best: bool,
    /// Only these types (comma-separated, as the records name them: float, bfloat16, ...)
    #[arg(short = 'd', long = "dtype", value_delimiter = ',')]
    pub dtypes: Vec<String>,
}

/// One line of a panel: a library's out-of-place figures from one record.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub nccl: bool,
    /// Which record and type it came from: its colour within its library's family (warm, solid
    /// ferroccl; cool, dashed NCCL).
    pub variant: usize,
    /// (size in bytes, busbw GB/s, time us), by size.
    pub points: Vec<(f64, f64, f64)>,
}

/// (size, busbw, time) of one line.
type Points = Vec<(f64, f64, f64)>;

/// Per operation, its lines. Names carry the record's label, made unique with the file name
/// where two records share one, and the type where a record has several. Out-of-place figures
/// only; rows of other types than `dtypes` (when not empty) left out.
pub fn collect(
    files: &[PathBuf],
    dtypes: &[String],
) -> Result<BTreeMap<String, Vec<Series>>, String> {
    let mut recs = Vec::new();
    for f in files {
        let rec = best::read(f)?;
        let mut flat = rec.points;
        flat.retain(|r| !r.in_place && (dtypes.is_empty() || dtypes.contains(&r.dtype)));
        recs.push((rec.label, flat, f));
    }
    let mut out: BTreeMap<String, Vec<Series>> = BTreeMap::new();
    let mut variant = 0;
    for (label, flat, path) in &recs {
        let shared = recs.iter().filter(|r| &r.0 == label).count() > 1;
        let label = if shared {
            format!(
                "{label} ({})",
                path.file_stem()
                    .map_or(String::new(), |s| s.to_string_lossy().into_owned())
            )
        } else {
            label.clone()
        };
        let mut dtypes: Vec<&String> = flat.iter().map(|r| &r.dtype).collect();
        dtypes.sort();
        dtypes.dedup();
        let mut lines: BTreeMap<(String, bool, String), Points> = BTreeMap::new();
        for p in flat {
            lines
                .entry((p.op.clone(), p.nccl, p.dtype.clone()))
                .or_default()
                .push((p.size as f64, p.busbw, p.time));
        }
        for ((op, nccl, dt), mut points) in lines {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let lib = if nccl { "NCCL" } else { "ferroccl" };
            let name = if dtypes.len() > 1 {
                format!("{lib} {label} {dt}")
            } else {
                format!("{lib} {label}")
            };
            let v = variant + dtypes.iter().position(|d| *d == &dt).unwrap_or(0);
            out.entry(op).or_default().push(Series {
                name,
                nccl,
                variant: v,
                points,
            });
        }
        variant += dtypes.len();
    }
    Ok(out)
}

/// Per operation, one line per library (and type, reduction and rank count, where the records
/// hold several): at each size the point of least time over every record and both halves, in
/// and out of place (`best::best_lines`, as `ferroccl best` counts it); halves found wrong by a
/// check are left out.
pub fn collect_best(
    files: &[PathBuf],
    dtypes: &[String],
) -> Result<BTreeMap<String, Vec<Series>>, String> {
    let recs = files
        .iter()
        .map(|f| best::read(f))
        .collect::<Result<Vec<_>, _>>()?;
    let best = best::best_lines(&recs, |p| dtypes.is_empty() || dtypes.contains(&p.dtype));
    type Line = best::Line;
    // Which of type, reduction and rank count vary within an operation name its lines.
    let varies = |op: &str, f: fn(&Line) -> String| {
        let mut v: Vec<String> = best.keys().filter(|k| k.0 == op).map(f).collect();
        v.sort();
        v.dedup();
        v.len() > 1
    };
    let names: Vec<String> = best
        .keys()
        .map(|k| {
            let (op, nccl, dt, redop, nranks) = k;
            let mut name = format!("{} best", if *nccl { "NCCL" } else { "ferroccl" });
            if varies(op, |k| k.2.clone()) {
                name += &format!(" {dt}");
            }
            if varies(op, |k| k.3.clone()) {
                name += &format!(" {redop}");
            }
            if varies(op, |k| k.4.to_string()) {
                name += &format!(" {nranks} ranks");
            }
            name
        })
        .collect();
    let mut out: BTreeMap<String, Vec<Series>> = BTreeMap::new();
    // Colours step through each operation's own lines (type, reduction, rank count).
    let mut variants: BTreeMap<(String, String, String, u64), usize> = BTreeMap::new();
    for (((op, nccl, dt, redop, nranks), points), name) in best.into_iter().zip(names) {
        let n = variants.keys().filter(|k| k.0 == op).count();
        let variant = *variants.entry((op.clone(), dt, redop, nranks)).or_insert(n);
        out.entry(op).or_default().push(Series {
            name,
            nccl,
            variant,
            points: points
                .into_iter()
                .map(|(size, c)| (size as f64, c.busbw, c.time_us))
                .collect(),
        });
    }
    Ok(out)
}

/// Axis labels at powers of two: "8", "1K", "64M", "2G".
fn size_label(x: &f64) -> String {
    let x = x.round();
    for (u, s) in [(1u64 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")] {
        if x >= u as f64 {
            let v = x / u as f64;
            return if v.fract() == 0.0 {
                format!("{v}{s}")
            } else {
                format!("{v:.1}{s}")
            };
        }
    }
    format!("{x}")
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Line colours: ferroccl in warm hues, NCCL in cool ones, so that the two libraries differ by
/// colour as well as by dash (a dashed line is hard to tell at a glance where lines cross);
/// records and types step through each family.
const FERROCCL_COLOURS: [RGBColor; 5] = [
    RGBColor(217, 72, 1),
    RGBColor(203, 24, 29),
    RGBColor(231, 41, 138),
    RGBColor(166, 86, 40),
    RGBColor(240, 160, 0),
];
const NCCL_COLOURS: [RGBColor; 5] = [
    RGBColor(33, 113, 181),
    RGBColor(35, 139, 69),
    RGBColor(106, 81, 163),
    RGBColor(0, 150, 160),
    RGBColor(82, 82, 82),
];

fn line_colour(nccl: bool, variant: usize) -> RGBColor {
    let family = if nccl {
        &NCCL_COLOURS
    } else {
        &FERROCCL_COLOURS
    };
    family[variant % family.len()]
}

/// A log axis drawn as a linear one over log2 of the value, labelled with the value: plotters'
/// own log axis labels only the powers of ten, two ticks for a typical latency range.
fn log2_label(v: &f64) -> String {
    let x = v.exp2();
    if x >= 10.0 {
        format!("{x:.0}")
    } else if x >= 1.0 {
        format!("{}", (x * 10.0).round() / 10.0)
    } else {
        format!("{}", (x * 100.0).round() / 100.0)
    }
}

/// One panel: `y` picks busbw or time; points outside `max_size` or not positive are left out
/// (a log axis has no zero).
/// The legend goes in the bandwidth panel only: the latency panel beside it uses the same
/// colours, and its lines would be hidden under a second legend.
#[allow(clippy::too_many_arguments)]
fn panel(
    area: &Area,
    title: &str,
    series: &[Series],
    max_size: f64,
    y_label: &str,
    y: fn(&(f64, f64, f64)) -> f64,
    log_y: bool,
    legend: bool,
) -> Result<(), String> {
    let ty = |v: f64| if log_y { v.log2() } else { v };
    let pts = |s: &Series| -> Vec<(f64, f64)> {
        s.points
            .iter()
            .filter(|p| p.0 > 0.0 && p.0 <= max_size && y(p) > 0.0)
            .map(|p| (p.0, ty(y(p))))
            .collect()
    };
    let all: Vec<(f64, f64)> = series.iter().flat_map(pts).collect();
    if all.is_empty() {
        return Ok(());
    }
    let (x0, x1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let x1 = if x1 <= x0 { x0 * 2.0 } else { x1 };
    // Log: a quarter of an octave of room each side, and at least two octaves in view, so that
    // the axis has several powers of two to label. Linear: from zero.
    let yr = if log_y {
        let (lo, hi) = (y0 - 0.25, y1 + 0.25);
        let pad = (2.0 - (hi - lo)).max(0.0) / 2.0;
        (lo - pad)..(hi + pad)
    } else {
        0.0..y1 * 1.1
    };
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let mut b = ChartBuilder::on(area);
    b.caption(title, ("sans-serif", 18))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(56);
    let mut chart = b
        .build_cartesian_2d((x0..x1).log_scale().base(2.0), yr)
        .map_err(|x| e(&x))?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc("size")
        .y_desc(y_label)
        .x_label_formatter(&size_label);
    if log_y {
        mesh.y_labels(12).y_label_formatter(&log2_label);
    }
    mesh.draw().map_err(|x| e(&x))?;
    for s in series {
        let c = line_colour(s.nccl, s.variant).to_rgba();
        let p = pts(s);
        if s.nccl {
            chart
                .draw_series(DashedLineSeries::new(p.clone(), 6, 4, c.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(&s.name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            chart
                .draw_series(p.iter().map(|&q| TriangleMarker::new(q, 4, c.filled())))
                .map_err(|x| e(&x))?;
        } else {
            chart
                .draw_series(LineSeries::new(p.clone(), c.stroke_width(3)))
                .map_err(|x| e(&x))?
                .label(&s.name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3))
                });
            chart
                .draw_series(p.iter().map(|&q| Circle::new(q, 3, c.filled())))
                .map_err(|x| e(&x))?;
        }
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }
    Ok(())
}

/// Draws every operation's panels into `out`.
pub fn render(
    by_op: &BTreeMap<String, Vec<Series>>,
    out: &Path,
    latency_max: usize,
    best: bool,
) -> Result<(), String> {
    if by_op.is_empty() {
        return Err("nothing to plot: the records have no rows".into());
    }
    let (w, h) = (1400u32, 420 * by_op.len() as u32);
    let root = SVGBackend::new(out, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let rows = root.split_evenly((by_op.len(), 2));
    for (i, (op, series)) in by_op.iter().enumerate() {
        panel(
            &rows[2 * i],
            &if best {
                format!("{op}: bus bandwidth (best of records, in or out of place)")
            } else {
                format!("{op}: bus bandwidth (out of place)")
            },
            series,
            f64::MAX,
            "busbw (GB/s)",
            |p| p.1,
            false,
            true,
        )?;
        panel(
            &rows[2 * i + 1],
            &format!("{op}: time up to {}", human(latency_max)),
            series,
            latency_max as f64,
            "time (us)",
            |p| p.2,
            true,
            false,
        )?;
    }
    root.present()
        .map_err(|e| format!("writing {}: {e}", out.display()))
}

pub fn main(a: &PlotArgs) -> Result<(), String> {
    let by_op = if a.best {
        collect_best(&a.files, &a.dtypes)?
    } else {
        collect(&a.files, &a.dtypes)?
    };
    render(&by_op, &a.output, a.latency_max, a.best)?;
    println!("wrote {}", a.output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::record::{tests::sample, write};

    #[test]
    fn sample_record_plots_with_every_series_named() {
        let dir = std::env::temp_dir().join(format!("ferroccl-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = dir.join("threads.json");
        write(&a, &sample()).unwrap();
        let mut other = sample();
        other.label = "processes, graph".into();
        let b = dir.join("procs.json");
        write(&b, &other).unwrap();
        let by_op = collect(&[a.clone(), b.clone()], &[]).unwrap();
        assert_eq!(by_op.keys().collect::<Vec<_>>(), ["all-reduce", "alltoall"]);
        let names: Vec<&str> = by_op["all-reduce"]
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "ferroccl threads",
                "NCCL threads",
                "ferroccl processes, graph",
                "NCCL processes, graph"
            ]
        );
        let out = dir.join("out.svg");
        render(&by_op, &out, 1 << 20, false).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
        // Titles, legends and axis labels are SVG text, drawn without any font file.
        for s in [
            "all-reduce: bus bandwidth",
            "alltoall: time up to 1 MiB",
            "ferroccl threads",
            "NCCL processes, graph",
            "busbw (GB/s)",
        ] {
            assert!(svg.contains(s), "missing {s:?}");
        }
        assert!(
            svg.contains("<polyline") || svg.contains("<path"),
            "no lines drawn"
        );
        // The same label twice gets the file names.
        let by_op = collect(&[a.clone(), a.clone()], &[]).unwrap();
        assert!(
            by_op["alltoall"][0].name.ends_with("(threads)"),
            "{}",
            by_op["alltoall"][0].name
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_libraries_differ_in_colour_and_the_latency_axis_labels_several_ticks() {
        for v in 0..FERROCCL_COLOURS.len() {
            for w in 0..NCCL_COLOURS.len() {
                assert_ne!(
                    line_colour(false, v),
                    line_colour(true, w),
                    "ferroccl {v} vs NCCL {w}"
                );
            }
            for w in 0..v {
                assert_ne!(line_colour(false, v), line_colour(false, w));
                assert_ne!(line_colour(true, v), line_colour(true, w));
            }
        }
        // 3 to 200 us: every power of two between gets its label.
        let dir = std::env::temp_dir().join(format!("ferroccl-plot-ticks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = |nccl: bool, t: &[f64]| Series {
            name: if nccl {
                "NCCL x".into()
            } else {
                "ferroccl x".into()
            },
            nccl,
            variant: 0,
            points: t
                .iter()
                .enumerate()
                .map(|(i, &t)| ((1024usize << (2 * i)) as f64, 1.0, t))
                .collect(),
        };
        let by_op = BTreeMap::from([(
            "all-reduce".to_string(),
            vec![
                line(false, &[3.0, 5.0, 20.0, 200.0]),
                line(true, &[4.0, 7.0, 30.0, 150.0]),
            ],
        )]);
        let out = dir.join("ticks.svg");
        render(&by_op, &out, 1 << 30, false).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        // Every text element's content.
        let texts: Vec<&str> = svg
            .split("</text>")
            .filter_map(|t| t.rsplit('>').next())
            .map(str::trim)
            .collect();
        for t in ["4", "8", "16", "32", "64", "128"] {
            assert!(
                texts.contains(&t),
                "no tick {t} on the latency axis: {texts:?}"
            );
        }
        for c in [line_colour(false, 0), line_colour(true, 0)] {
            assert!(
                svg.to_lowercase()
                    .contains(&format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)),
                "colour {c:?} not drawn"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn plain_bench_records_plot_as_ferroccl_only() {
        let dir = std::env::temp_dir().join(format!("ferroccl-plot-plain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("plain.json");
        std::fs::write(&p, r#"{"mode":"threads of one process","rows":[{"op":"all-reduce","size":1024,"dtype":"float","out_of_place":{"time_us":10.0,"busbw":0.2}}]}"#).unwrap();
        let by_op = collect(std::slice::from_ref(&p), &[]).unwrap();
        assert_eq!(by_op["all-reduce"].len(), 1);
        assert!(!by_op["all-reduce"][0].nccl);
        std::fs::write(&p, "{}").unwrap();
        assert!(collect(std::slice::from_ref(&p), &[])
            .unwrap_err()
            .contains("no rows"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `--best`: one line per library, each size at its least time over the records and both
    /// halves, whichever record and half gave it; `--dtype` keeps the types named.
    #[test]
    fn best_lines_take_each_size_from_whichever_record_and_half_was_fastest() {
        let dir = std::env::temp_dir().join(format!("ferroccl-plot-best-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Record a: ferroccl's out of place fastest at 8 B; record b: its in place fastest at
        // 1 MiB, NCCL's out of place at 1 GiB; bfloat16 rows that the filter drops.
        let mut a = sample();
        let mut b = sample();
        b.label = "processes".into();
        let meas = |t: f64, size: usize| crate::bench::table::Measure {
            time_us: t,
            algbw: size as f64 / t / 1e3,
            busbw: size as f64 / t / 1e3,
            wrong: None,
        };
        for r in a.rows.iter_mut().filter(|r| r.size == 8) {
            r.ferroccl.out_of_place = meas(1.5, 8);
        }
        for r in b.rows.iter_mut().filter(|r| r.size == 1 << 20) {
            r.ferroccl.in_place = Some(meas(7.0, 1 << 20));
        }
        for r in b.rows.iter_mut().filter(|r| r.size == 1 << 30) {
            r.nccl.out_of_place = meas(2500.0, 1 << 30);
        }
        // A faster half that a check found wrong is never the best.
        for r in a.rows.iter_mut().filter(|r| r.size == 1 << 30) {
            r.ferroccl.out_of_place = crate::bench::table::Measure {
                wrong: Some(3),
                ..meas(1000.0, 1 << 30)
            };
        }
        let mut bf = a.rows[0].clone();
        bf.dtype = "bfloat16".into();
        bf.ferroccl.out_of_place = meas(0.5, 8);
        let mut bf_max = bf.clone();
        bf_max.redop = "max".into();
        a.rows.extend([bf, bf_max]);
        let (pa, pb) = (dir.join("a.json"), dir.join("b.json"));
        write(&pa, &a).unwrap();
        write(&pb, &b).unwrap();
        let files = [pa, pb];
        let by_op = collect_best(&files, &["float".to_string()]).unwrap();
        let lines = &by_op["all-reduce"];
        let names: Vec<&str> = lines.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["ferroccl best", "NCCL best"]);
        let times = |s: &Series| s.points.iter().map(|p| (p.0, p.2)).collect::<Vec<_>>();
        // sample(): ferroccl 40 / 30 / 4000 us, NCCL 9 / 20 / 3000 us at 8 B / 1 MiB / 1 GiB.
        assert_eq!(
            times(&lines[0]),
            [
                (8.0, 1.5),
                ((1 << 20) as f64, 7.0),
                ((1 << 30) as f64, 4000.0)
            ]
        );
        assert_eq!(
            times(&lines[1]),
            [
                (8.0, 9.0),
                ((1 << 20) as f64, 20.0),
                ((1 << 30) as f64, 2500.0)
            ]
        );
        // Without the filter the bfloat16 rows make lines of their own, named by type and, as
        // the reductions differ within the operation, by reduction.
        let all = collect_best(&files, &[]).unwrap();
        let names: Vec<&str> = all["all-reduce"].iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "ferroccl best bfloat16 max",
                "ferroccl best bfloat16 sum",
                "ferroccl best float sum",
                "NCCL best bfloat16 max",
                "NCCL best bfloat16 sum",
                "NCCL best float sum"
            ]
        );
        // One type and one reduction in alltoall: its lines are named by neither.
        let names: Vec<&str> = all["alltoall"].iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["ferroccl best", "NCCL best"]);
        // Colours step through each operation's own lines: alltoall's first as all-reduce's.
        let v = |op: &str| all[op].iter().map(|s| s.variant).collect::<Vec<_>>();
        assert_eq!(
            (v("all-reduce"), v("alltoall")),
            (vec![0, 1, 2, 0, 1, 2], vec![0, 0])
        );
        let out = dir.join("best.svg");
        render(&by_op, &out, 1 << 20, true).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.contains("best of records, in or out of place"));
        assert!(svg.contains("ferroccl best") && svg.contains("NCCL best"));
        // The plain collection keeps out-of-place figures only, filtered the same way.
        let plain = collect(&files, &["float".to_string()]).unwrap();
        assert_eq!(plain["all-reduce"].len(), 4);
        assert_eq!(times(&plain["all-reduce"][0])[1], ((1 << 20) as f64, 30.0));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
