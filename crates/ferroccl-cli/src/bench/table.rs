//! The nccl-tests table, so that people (and their scripts) can read ferroccl's results the way
//! they read nccl-tests'.

use serde::{Deserialize, Serialize};

/// One half of a row: out-of-place or in-place.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measure {
    pub time_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    /// None without --check (printed "N/A" as nccl-tests does).
    pub wrong: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub op: &'static str,
    pub size: usize,
    pub count: usize,
    pub dtype: &'static str,
    pub redop: &'static str,
    /// -1 for operations without a root, as nccl-tests prints it.
    pub root: i64,
    pub out_of_place: Measure,
    /// None where the operation has no defined in-place form.
    pub in_place: Option<Measure>,
}

// Column widths; the header is built from the same numbers so the two never drift apart.
const W_SIZE: usize = 12;
const W_COUNT: usize = 12;
const W_TYPE: usize = 8;
const W_REDOP: usize = 6;
const W_ROOT: usize = 6;
const W_TIME: usize = 7;
const W_BW: usize = 6;
const W_WRONG: usize = 6;

/// Fewer decimals as times grow, keeping the column width fixed.
pub fn time_str(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:>W_TIME$.0}")
    } else if us >= 100.0 {
        format!("{us:>W_TIME$.1}")
    } else {
        format!("{us:>W_TIME$.2}")
    }
}

fn half(m: Option<&Measure>) -> String {
    match m {
        Some(m) => {
            let wrong = m.wrong.map_or("N/A".to_string(), |w| w.to_string());
            format!(
                "  {}  {:>W_BW$.2}  {:>W_BW$.2}  {wrong:>W_WRONG$}",
                time_str(m.time_us),
                m.algbw,
                m.busbw
            )
        }
        None => format!(
            "  {:>W_TIME$}  {:>W_BW$}  {:>W_BW$}  {:>W_WRONG$}",
            "n/a", "", "", ""
        ),
    }
}

pub fn format_row(r: &Row) -> String {
    let s = format!(
        "{:>W_SIZE$}  {:>W_COUNT$}  {:>W_TYPE$}  {:>W_REDOP$}  {:>W_ROOT$}{}{}",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        half(Some(&r.out_of_place)),
        half(r.in_place.as_ref())
    );
    s.trim_end().to_string()
}

/// The three column-header lines.
pub fn header() -> String {
    let left = |a: &str, b: &str, c: &str, d: &str, e: &str| {
        format!(
            "#{:>w1$}  {b:>W_COUNT$}  {c:>W_TYPE$}  {d:>W_REDOP$}  {e:>W_ROOT$}",
            a,
            w1 = W_SIZE - 1
        )
    };
    let half_w = 2 + W_TIME + 2 + W_BW + 2 + W_BW + 2 + W_WRONG;
    let cols = |t: &str, a: &str, b: &str, w: &str| {
        format!("  {t:>W_TIME$}  {a:>W_BW$}  {b:>W_BW$}  {w:>W_WRONG$}")
    };
    let l0 = format!(
        "#{}{:>half_w$}{:>half_w$}",
        " ".repeat(W_SIZE - 1 + 2 + W_COUNT + 2 + W_TYPE + 2 + W_REDOP + 2 + W_ROOT),
        "out-of-place",
        "in-place"
    );
    let l1 = left("size", "count", "type", "redop", "root")
        + &cols("time", "algbw", "busbw", "#wrong").repeat(2);
    let l2 =
        left("(B)", "(elements)", "", "", "") + &cols("(us)", "(GB/s)", "(GB/s)", "").repeat(2);
    format!("{l0}\n{l1}\n{l2}")
}

/// nccl-tests' closing lines; the average counts both halves of every row.
pub fn footer(rows: &[Row], check: bool) -> String {
    let avg = avg_busbw(rows);
    let wrong = total_wrong(rows);
    let oob = if !check {
        "# Out of bounds values : N/A (run with --check)".to_string()
    } else {
        format!(
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        )
    };
    format!("{oob}\n# Avg bus bandwidth    : {avg:.4} \n#")
}

/// The mean bus bandwidth over both halves of `rows`.
pub fn avg_busbw<'a>(rows: impl IntoIterator<Item = &'a Row>) -> f64 {
    let bws: Vec<f64> = rows
        .into_iter()
        .flat_map(|r| std::iter::once(r.out_of_place.busbw).chain(r.in_place.map(|m| m.busbw)))
        .collect();
    if bws.is_empty() {
        0.0
    } else {
        bws.iter().sum::<f64>() / bws.len() as f64
    }
}

pub fn total_wrong(rows: &[Row]) -> u64 {
    rows.iter()
        .flat_map(|r| std::iter::once(r.out_of_place.wrong).chain(r.in_place.map(|m| m.wrong)))
        .map(|w| w.unwrap_or(0))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row {
            op: "all-reduce",
            size: 1048576,
            count: 262144,
            dtype: "float",
            redop: "sum",
            root: -1,
            out_of_place: Measure {
                time_us: 123.456,
                algbw: 8.49,
                busbw: 12.74,
                wrong: Some(0),
            },
            in_place: Some(Measure {
                time_us: 12345.6,
                algbw: 0.085,
                busbw: 0.127,
                wrong: Some(3),
            }),
        }
    }

    #[test]
    fn one_row_is_formatted_like_nccl_tests() {
        let s = format_row(&row());
        assert_eq!(
            s,
            "     1048576        262144     float     sum      -1    123.5    8.49   12.74       0    12346    0.09    0.13       3"
        );
        let mut r = row();
        r.in_place = None;
        r.out_of_place.wrong = None;
        r.out_of_place.time_us = 5.0;
        let s = format_row(&r);
        assert!(
            s.ends_with("     5.00    8.49   12.74     N/A      n/a"),
            "{s}"
        );
    }

    #[test]
    fn header_columns_line_up_with_rows() {
        let h = header();
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(lines.len(), 3);
        let r = format_row(&row());
        assert_eq!(lines[1].len(), r.len());
        assert!(lines[2].trim_end().len() <= r.len());
        // "busbw" ends where the busbw numbers end.
        let end = lines[1].find("busbw").unwrap() + 5;
        assert_eq!(&r[end - 5..end], "12.74");
    }

    #[test]
    fn footer_reports_wrong_values_and_average() {
        let f = footer(&[row()], true);
        assert!(f.contains("# Out of bounds values : 3 FAILED"), "{f}");
        assert!(f.contains("# Avg bus bandwidth    : 6.4335"), "{f}");
        let mut r = row();
        r.in_place.as_mut().unwrap().wrong = Some(0);
        assert!(footer(&[r], true).contains(": 0 OK"));
    }
}
