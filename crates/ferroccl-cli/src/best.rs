//! `ferroccl best PATH...`: each library's best figure at each size over several records, the
//! least time over every record given and both halves (in and out of place), halves a check
//! found wrong left out. For a run of `bench/h200.sh` that is each library's best launch mode,
//! buffer kind and placement, size by size: the README's tables (`--md`) and, through
//! [`best_lines`], `ferroccl plot --best`'s lines.
//!
//! Reads `bench --vs-nccl --json` records (both libraries) and plain `bench --json` ones
//! (ferroccl alone), gzipped or not (a `.gz` goes through `gzip -dc`), folders of them, and the
//! bundles `bench/results/*/records.json.gz` keeps them in (`{"records": {"group/name": record}}`;
//! `--group` picks one group, such as a run of `bench/h200.sh`).

use crate::bench::record;
use crate::size::human;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug, Clone)]
pub struct BestArgs {
    /// `bench --json` records (with or without --vs-nccl; `.json` or `.json.gz`), or folders
    /// holding them
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Only the records of this group of a results bundle (their names start with `GROUP/`)
    #[arg(long)]
    pub group: Option<String>,
    /// The type whose rows count (as the records name it: float, bfloat16, ...)
    #[arg(short = 'd', long = "dtype", default_value = "float")]
    pub dtype: String,
    /// The reduction whose rows of the reducing kinds count (the other kinds' "none" always does)
    #[arg(long, default_value = "sum")]
    pub redop: String,
    /// A markdown table instead: ferroccl / NCCL at the README's sizes, us up to 512 KiB and
    /// GB/s above, ferroccl in bold where it is ahead
    #[arg(long)]
    pub md: bool,
    /// Also write every cell (each library's best, the record and half it came from, the ratio)
    /// as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One half of one library's row.
#[derive(Clone, Debug)]
pub struct Point {
    pub nccl: bool,
    pub op: String,
    pub dtype: String,
    /// The reduction and the record's rank count: what a best line must not mix.
    pub redop: String,
    pub nranks: u64,
    pub size: u64,
    pub busbw: f64,
    pub time: f64,
    pub in_place: bool,
    /// Checked and found wrong: never a best figure.
    pub wrong: bool,
    pub blocks: Option<u32>,
}

/// One record's rows, as halves.
pub struct Record {
    /// The launch mode the record names ("a process per GPU", ...).
    pub label: String,
    /// Its file's name without `.json` or `.json.gz`.
    pub name: String,
    pub points: Vec<Point>,
}

fn text_of(path: &Path) -> Result<String, String> {
    if path.extension().is_some_and(|e| e == "gz") {
        let out = std::process::Command::new("gzip")
            .arg("-dc")
            .arg(path)
            .output()
            .map_err(|e| format!("{}: running gzip -dc: {e}", path.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{}: gzip -dc failed: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        return String::from_utf8(out.stdout)
            .map_err(|e| format!("{}: not UTF-8: {e}", path.display()));
    }
    std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

/// One record file.
pub fn read(path: &Path) -> Result<Record, String> {
    let text = text_of(path)?;
    parse(&text, record_name(path), path)
}

/// A record file's name without `.json` or `.json.gz`.
fn record_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map_or(String::new(), |s| s.to_string_lossy().into_owned());
    let stem = file.strip_suffix(".gz").unwrap_or(&file);
    stem.strip_suffix(".json").unwrap_or(stem).to_string()
}

/// The records of a results bundle (`{"records": {"group/name": record}}`, as
/// `bench/results/*/records.json.gz` keeps them), by name; None for any other text.
fn bundle(text: &str) -> Option<Vec<(String, String)>> {
    let j: serde_json::Value = serde_json::from_str(text).ok()?;
    if !j["rows"].is_null() {
        return None;
    }
    let recs = j["records"].as_object()?;
    Some(
        recs.iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect(),
    )
}

/// One record's text, named `name`, from `path` (for messages).
fn parse(text: &str, name: String, path: &Path) -> Result<Record, String> {
    let mut points = Vec::new();
    if let Ok(rec) = record::parse(text, path) {
        for r in &rec.rows {
            for (nccl, lib) in [(false, &r.ferroccl), (true, &r.nccl)] {
                for (in_place, m) in [
                    (false, Some(&lib.out_of_place)),
                    (true, lib.in_place.as_ref()),
                ] {
                    let Some(m) = m else { continue };
                    points.push(Point {
                        nccl,
                        op: r.op.clone(),
                        dtype: r.dtype.clone(),
                        redop: r.redop.clone(),
                        nranks: rec.nranks as u64,
                        size: r.size as u64,
                        busbw: m.busbw,
                        time: m.time_us,
                        in_place,
                        wrong: m.wrong.is_some_and(|w| w > 0),
                        blocks: lib.blocks,
                    });
                }
            }
        }
        return Ok(Record {
            label: rec.label,
            name,
            points,
        });
    }
    // A plain `bench --json` record: ferroccl only.
    let j: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    let rows = j["rows"].as_array().ok_or_else(|| {
        format!(
            "{} ({name}): no rows (not a `ferroccl bench --json` record)",
            path.display()
        )
    })?;
    for r in rows {
        let (Some(op), Some(dt), Some(size)) =
            (r["op"].as_str(), r["dtype"].as_str(), r["size"].as_u64())
        else {
            return Err(format!(
                "{} ({name}): a row lacks op, dtype or size",
                path.display()
            ));
        };
        for (in_place, m) in [(false, &r["out_of_place"]), (true, &r["in_place"])] {
            if m.is_null() {
                continue;
            }
            points.push(Point {
                nccl: false,
                op: op.into(),
                dtype: dt.into(),
                redop: r["redop"].as_str().unwrap_or("").into(),
                nranks: j["nranks"].as_u64().unwrap_or(0),
                size,
                busbw: m["busbw"].as_f64().unwrap_or(0.0),
                time: m["time_us"].as_f64().unwrap_or(0.0),
                in_place,
                wrong: m["wrong"].as_u64().is_some_and(|w| w > 0),
                blocks: r["blocks"].as_u64().and_then(|b| u32::try_from(b).ok()),
            });
        }
    }
    Ok(Record {
        label: j["mode"].as_str().unwrap_or("ferroccl bench").to_string(),
        name,
        points,
    })
}

/// Every record the paths name: files as given, folders' `.json` and `.json.gz` files in name
/// order, a bundle's records in name order; those of a folder or bundle that are not bench
/// records (an anchor's figures beside them) skipped with a note. With `group`, only the records
/// named `group/...` (a bundle's).
pub fn read_all(paths: &[PathBuf], group: Option<&str>) -> Result<Vec<Record>, String> {
    let mut recs = read_paths(paths)?;
    if let Some(g) = group {
        let prefix = format!("{g}/");
        recs.retain(|r| r.name.starts_with(&prefix));
    }
    Ok(recs)
}

fn read_paths(paths: &[PathBuf]) -> Result<Vec<Record>, String> {
    let mut recs = Vec::new();
    for p in paths {
        if !p.is_dir() {
            read_file(p, &mut recs)?;
            continue;
        }
        let mut inside: Vec<PathBuf> = std::fs::read_dir(p)
            .map_err(|e| format!("reading {}: {e}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| {
                let n = f.to_string_lossy();
                n.ends_with(".json") || n.ends_with(".json.gz")
            })
            .collect();
        inside.sort();
        for f in inside {
            if let Err(e) = read_file(&f, &mut recs) {
                eprintln!("skipping {e}");
            }
        }
    }
    Ok(recs)
}

/// The records of one file (one record, or a bundle's, whose stray entries are skipped with a
/// note) onto `recs`.
fn read_file(p: &Path, recs: &mut Vec<Record>) -> Result<(), String> {
    let text = text_of(p)?;
    let Some(inside) = bundle(&text) else {
        recs.push(parse(&text, record_name(p), p)?);
        return Ok(());
    };
    for (name, text) in inside {
        match parse(&text, name, p) {
            Ok(r) => recs.push(r),
            Err(e) => eprintln!("skipping {e}"),
        }
    }
    Ok(())
}

/// A library's best at one size, and where it came from.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Cell {
    pub time_us: f64,
    pub busbw: f64,
    /// The record's name.
    pub record: String,
    /// "out_of_place" or "in_place".
    pub half: &'static str,
    pub blocks: Option<u32>,
}

/// (operation, NCCL's?, type, reduction, rank count): what one best line holds alone.
pub type Line = (String, bool, String, String, u64);

/// Per line, per size, the half of least time over `recs` among the points `keep` accepts
/// (never one found wrong, nor a time that is not positive). Ties keep the first seen.
pub fn best_lines<'a>(
    recs: impl IntoIterator<Item = &'a Record>,
    keep: impl Fn(&Point) -> bool,
) -> BTreeMap<Line, BTreeMap<u64, Cell>> {
    let mut best: BTreeMap<Line, BTreeMap<u64, Cell>> = BTreeMap::new();
    for rec in recs {
        for p in &rec.points {
            if p.wrong || p.time <= 0.0 || !keep(p) {
                continue;
            }
            let cell = Cell {
                time_us: p.time,
                busbw: p.busbw,
                record: rec.name.clone(),
                half: if p.in_place {
                    "in_place"
                } else {
                    "out_of_place"
                },
                blocks: p.blocks,
            };
            let line = (
                p.op.clone(),
                p.nccl,
                p.dtype.clone(),
                p.redop.clone(),
                p.nranks,
            );
            let at = best.entry(line).or_default();
            match at.get(&p.size) {
                Some(c) if c.time_us <= p.time => {}
                _ => {
                    at.insert(p.size, cell);
                }
            }
        }
    }
    best
}

/// One operation and size: each library's best (None where it has no figure).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Compared {
    pub op: String,
    pub size: u64,
    pub dtype: String,
    pub ferroccl: Option<Cell>,
    pub nccl: Option<Cell>,
    /// NCCL's time over ferroccl's: above 1 where ferroccl is faster.
    pub ratio: Option<f64>,
}

/// The cells of `dtype`, reductions of `redop` only (the movement kinds' "none" always), in the
/// order the records first name each operation, by size. Records of different rank counts are
/// refused: a best over them would compare unlike things.
pub fn compare(recs: &[Record], dtype: &str, redop: &str) -> Result<Vec<Compared>, String> {
    let mut ranks: Vec<u64> = recs
        .iter()
        .flat_map(|r| r.points.first().map(|p| p.nranks))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    if ranks.len() > 1 {
        return Err(format!(
            "the records hold different rank counts ({ranks:?}); give one count's records"
        ));
    }
    let mut ops: Vec<String> = Vec::new();
    for p in recs.iter().flat_map(|r| &r.points) {
        if !ops.contains(&p.op) {
            ops.push(p.op.clone());
        }
    }
    let lines = best_lines(recs, |p| {
        p.dtype == dtype && (p.redop == redop || p.redop == "none")
    });
    let mut by: BTreeMap<(usize, u64), Compared> = BTreeMap::new();
    for ((op, nccl, dt, _, _), cells) in lines {
        let at = ops.iter().position(|o| *o == op).unwrap_or(usize::MAX);
        for (size, cell) in cells {
            let c = by.entry((at, size)).or_insert_with(|| Compared {
                op: op.clone(),
                size,
                dtype: dt.clone(),
                ferroccl: None,
                nccl: None,
                ratio: None,
            });
            if nccl {
                c.nccl = Some(cell);
            } else {
                c.ferroccl = Some(cell);
            }
        }
    }
    Ok(by
        .into_values()
        .map(|mut c| {
            c.ratio = match (&c.ferroccl, &c.nccl) {
                (Some(f), Some(n)) => Some(n.time_us / f.time_us),
                _ => None,
            };
            c
        })
        .collect())
}

/// The README table's columns.
const MD_SIZES: [u64; 10] = [
    8,
    32 << 10,
    128 << 10,
    512 << 10,
    2 << 20,
    8 << 20,
    32 << 20,
    128 << 20,
    512 << 20,
    2 << 30,
];

/// Time in us up to 512 KiB, bus bandwidth in GB/s above.
fn figure(c: &Option<Cell>, size: u64) -> String {
    match c {
        None => "-".into(),
        Some(c) if size <= 512 << 10 => format!("{:.1}", c.time_us),
        Some(c) => format!("{:.0}", c.busbw),
    }
}

/// The markdown table: ferroccl / NCCL per operation and size, ferroccl in bold where ahead.
pub fn markdown(cells: &[Compared]) -> String {
    let mut out = String::from("| op |");
    for s in MD_SIZES {
        out += &format!(" {} |", human(s as usize));
    }
    out += &format!("\n|---|{}\n", "---|".repeat(MD_SIZES.len()));
    let mut ops: Vec<&str> = Vec::new();
    for c in cells {
        if !ops.contains(&c.op.as_str()) {
            ops.push(&c.op);
        }
    }
    for op in ops {
        out += &format!("| {op} |");
        for s in MD_SIZES {
            let Some(c) = cells.iter().find(|c| c.op == op && c.size == s) else {
                out += " - |";
                continue;
            };
            let ahead = match (&c.ferroccl, &c.nccl) {
                (Some(f), Some(n)) if s <= 512 << 10 => f.time_us <= n.time_us,
                (Some(f), Some(n)) => f.busbw >= n.busbw,
                _ => false,
            };
            let mine = figure(&c.ferroccl, s);
            let mine = if ahead { format!("**{mine}**") } else { mine };
            out += &format!(" {mine} / {} |", figure(&c.nccl, s));
        }
        out += "\n";
    }
    out
}

/// The plain table: every size both libraries have, with the ratio and where each best came
/// from.
pub fn table(recs: &[Record], dtype: &str, cells: &[Compared]) -> String {
    let names: Vec<&str> = recs.iter().map(|r| r.name.as_str()).collect();
    let mut out = format!(
        "# best of {} records ({}), {dtype}; ratio = NCCL time / ferroccl time\n",
        recs.len(),
        names.join(", ")
    );
    out += &format!(
        "{:15} {:>10} {:>12} {:>7} {:>10} {:>7} {:>6}  ferroccl's best from / NCCL's\n",
        "op", "size", "ferroccl us", "GB/s", "NCCL us", "GB/s", "ratio"
    );
    for c in cells {
        let (Some(f), Some(n), Some(r)) = (&c.ferroccl, &c.nccl, c.ratio) else {
            continue;
        };
        out += &format!(
            "{:15} {:>10} {:12.2} {:7.1} {:10.2} {:7.1} {r:6.2}  {} {} / {} {}\n",
            c.op,
            human(c.size as usize),
            f.time_us,
            f.busbw,
            n.time_us,
            n.busbw,
            f.record,
            f.half,
            n.record,
            n.half
        );
    }
    out
}

pub fn main(a: &BestArgs) -> Result<(), String> {
    let recs = read_all(&a.paths, a.group.as_deref())?;
    if recs.is_empty() {
        return Err("no records in the paths given (or none of the group asked)".into());
    }
    let cells = compare(&recs, &a.dtype, &a.redop)?;
    if let Some(path) = &a.json {
        let names: Vec<&str> = recs.iter().map(|r| r.name.as_str()).collect();
        let j = serde_json::json!({ "records": names, "cells": cells });
        let text = serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if a.md {
        print!("{}", markdown(&cells));
    } else {
        print!("{}", table(&recs, &a.dtype, &cells));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn half(t: f64, wrong: Option<u64>) -> serde_json::Value {
        serde_json::json!({"time_us": t, "algbw": 1000.0 / t, "busbw": 1000.0 / t, "wrong": wrong})
    }

    /// A row of a `--vs-nccl` record as the bench writes it (only the fields `read` needs).
    fn row(
        op: &str,
        redop: &str,
        size: u64,
        dtype: &str,
        f: (f64, Option<f64>, Option<u64>),
        n: (f64, Option<f64>),
    ) -> serde_json::Value {
        serde_json::json!({
            "op": op, "size": size, "count": size / 4, "dtype": dtype, "redop": redop, "root": -1,
            "ferroccl": {"out_of_place": half(f.0, f.2), "in_place": f.1.map(|t| half(t, None)), "blocks": 1},
            "nccl": {"out_of_place": half(n.0, None), "in_place": n.1.map(|t| half(t, None))},
        })
    }

    /// Writes a record of `rows` and `nranks` as the bench would, from `crate::bench::record`'s
    /// sample (so every other field is what the bench writes).
    fn write(dir: &Path, name: &str, rows: Vec<serde_json::Value>, nranks: usize) -> PathBuf {
        let mut rec = crate::bench::record::tests::sample();
        rec.nranks = nranks;
        rec.rows = serde_json::from_value(serde_json::Value::Array(rows)).unwrap();
        let p = dir.join(name);
        crate::bench::record::write(&p, &rec).unwrap();
        p
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferroccl-best-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Each library's least time over the records and both halves; a faster half a check found
    /// wrong never counts, nor another reduction or type; the movement kinds' "none" counts
    /// with any reduction asked for.
    #[test]
    fn cells_take_each_librarys_least_time_over_records_and_halves() {
        let d = scratch("cells");
        let a = vec![
            row(
                "all-reduce",
                "sum",
                8,
                "float",
                (3.0, Some(2.5), None),
                (4.0, None),
            ),
            row(
                "all-reduce",
                "sum",
                1024,
                "float",
                (1.0, None, Some(7)),
                (6.0, None),
            ),
            row(
                "all-reduce",
                "max",
                8,
                "float",
                (1.0, None, None),
                (1.0, None),
            ),
            row(
                "all-gather",
                "none",
                8,
                "float",
                (5.0, None, None),
                (3.0, None),
            ),
            row(
                "all-reduce",
                "sum",
                8,
                "bfloat16",
                (0.5, None, None),
                (0.5, None),
            ),
        ];
        let b = vec![
            row(
                "all-reduce",
                "sum",
                1024,
                "float",
                (5.0, None, None),
                (4.5, Some(4.0)),
            ),
            row(
                "all-gather",
                "none",
                8,
                "float",
                (2.0, None, None),
                (3.5, None),
            ),
        ];
        write(&d, "a.json", a, 2);
        write(&d, "b.json", b, 2);
        // Not a bench record: skipped in a folder, refused when named.
        let other = d.join("anchor.json");
        std::fs::write(&other, r#"{"rows": [{"kind": "one-shot"}]}"#).unwrap();
        assert!(read_all(std::slice::from_ref(&other), None).is_err());
        let recs = read_all(std::slice::from_ref(&d), None).unwrap();
        assert_eq!(
            recs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        let cells = compare(&recs, "float", "sum").unwrap();
        let got: Vec<(String, u64, f64, String, &str, f64)> = cells
            .iter()
            .map(|c| {
                let (f, n) = (c.ferroccl.as_ref().unwrap(), c.nccl.as_ref().unwrap());
                (
                    c.op.clone(),
                    c.size,
                    f.time_us,
                    f.record.clone(),
                    f.half,
                    n.time_us,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("all-reduce".into(), 8, 2.5, "a".into(), "in_place", 4.0),
                (
                    "all-reduce".into(),
                    1024,
                    5.0,
                    "b".into(),
                    "out_of_place",
                    4.0
                ),
                ("all-gather".into(), 8, 2.0, "b".into(), "out_of_place", 3.0),
            ]
        );
        assert_eq!(cells[0].ratio, Some(4.0 / 2.5));
        // Max instead of Sum: the Max row, and the movement kinds as before.
        let max = compare(&recs, "float", "max").unwrap();
        let t = |op: &str, size: u64| {
            max.iter()
                .find(|c| c.op == op && c.size == size)
                .map(|c| c.ferroccl.as_ref().unwrap().time_us)
        };
        assert_eq!(
            (t("all-reduce", 8), t("all-reduce", 1024)),
            (Some(1.0), None)
        );
        assert_eq!(t("all-gather", 8), Some(2.0));
        // The README's table: ferroccl bold where ahead, "-" where a size has no figure.
        let md = markdown(&cells);
        assert!(md.starts_with("| op | 8 B | 32 KiB |"), "{md}");
        assert!(md.contains("| all-reduce | **2.5** / 4.0 | - |"), "{md}");
        assert!(md.contains("| all-gather | **2.0** / 3.0 |"), "{md}");
        let text = table(&recs, "float", &cells);
        assert!(text.contains("a in_place / a out_of_place"), "{text}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A results bundle (`{"records": {"group/name": record}}`) reads as its records, named by
    /// their keys, alone or in a folder; `--group` keeps one group's; an entry that is not a
    /// record is skipped.
    #[test]
    fn bundles_read_as_their_records_and_groups_pick_one_run() {
        let d = scratch("bundle");
        let r = |t: f64| {
            vec![row(
                "all-reduce",
                "sum",
                8,
                "float",
                (t, None, None),
                (4.0, None),
            )]
        };
        let a = write(&d, "a.json", r(3.0), 2);
        let b = write(&d, "b.json", r(2.0), 2);
        let c = write(&d, "c.json", r(1.0), 2);
        let text = |p: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        };
        let j = serde_json::json!({"records": {
            "vs-x/a": text(&a), "vs-x/b": text(&b), "knobs-x/c": text(&c),
            "vs-x/anchor": {"rows": [{"kind": "one-shot"}]},
        }});
        for f in [&a, &b, &c] {
            std::fs::remove_file(f).unwrap();
        }
        let bundle = d.join("records.json");
        std::fs::write(&bundle, j.to_string()).unwrap();
        let names = |recs: &[Record]| recs.iter().map(|r| r.name.clone()).collect::<Vec<_>>();
        let all = read_all(std::slice::from_ref(&bundle), None).unwrap();
        assert_eq!(names(&all), ["knobs-x/c", "vs-x/a", "vs-x/b"]);
        let vs = read_all(std::slice::from_ref(&d), Some("vs-x")).unwrap();
        assert_eq!(names(&vs), ["vs-x/a", "vs-x/b"]);
        // The group's best: b's 2.0, not the other group's 1.0.
        let cells = compare(&vs, "float", "sum").unwrap();
        assert_eq!(cells[0].ferroccl.as_ref().unwrap().time_us, 2.0);
        assert_eq!(cells[0].ferroccl.as_ref().unwrap().record, "vs-x/b");
        assert!(read_all(std::slice::from_ref(&bundle), Some("vs"))
            .unwrap()
            .is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Records of different rank counts are refused, naming both counts; gzipped records read
    /// as plain ones.
    #[test]
    fn rank_counts_never_mix_and_gzipped_records_read() {
        let d = scratch("ranks");
        let rows = vec![row(
            "all-reduce",
            "sum",
            8,
            "float",
            (3.0, None, None),
            (4.0, None),
        )];
        write(&d, "a.json", rows.clone(), 2);
        let c = write(&d, "c.json", rows.clone(), 4);
        let recs = read_all(std::slice::from_ref(&d), None).unwrap();
        let e = compare(&recs, "float", "sum").unwrap_err();
        assert!(
            e.contains("rank counts") && e.contains('2') && e.contains('4'),
            "{e}"
        );
        std::fs::remove_file(&c).unwrap();
        let gz = write(&d, "z.json", rows, 2);
        let zipped = std::process::Command::new("gzip")
            .arg("-n")
            .arg(&gz)
            .status();
        if zipped.is_ok_and(|s| s.success()) {
            let recs = read_all(std::slice::from_ref(&d), None).unwrap();
            assert_eq!(
                recs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
                ["a", "z"]
            );
            assert_eq!(recs[1].points.len(), recs[0].points.len());
            assert!(compare(&recs, "float", "sum").is_ok());
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
