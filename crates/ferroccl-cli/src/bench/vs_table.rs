//! The side-by-side table of `bench --vs-nccl`: per size, each library's time and bus bandwidth,
//! their ratio, out of place and in place, and the thread blocks each launched.

use super::record::VsRow;
use super::table::{time_str, Measure};

const W_SIZE: usize = 12;
const W_COUNT: usize = 11;
const W_TYPE: usize = 8;
const W_REDOP: usize = 5;
const W_ROOT: usize = 4;
const W_TIME: usize = 8;
const W_BW: usize = 7;
const W_RATIO: usize = 6;
const W_BLOCKS: usize = 7;
const W_WRONG: usize = 8;

fn time(m: Option<&Measure>) -> String {
    m.map_or(format!("{:>W_TIME$}", "n/a"), |m| {
        format!("{:>W_TIME$}", time_str(m.time_us).trim())
    })
}

fn bw(m: Option<&Measure>) -> String {
    m.map_or(format!("{:>W_BW$}", ""), |m| {
        format!("{:>W_BW$.2}", m.busbw)
    })
}

fn ratio(r: Option<f64>) -> String {
    r.map_or(format!("{:>W_RATIO$}", "-"), |r| format!("{r:>W_RATIO$.2}"))
}

fn half(f: Option<&Measure>, n: Option<&Measure>, r: Option<f64>) -> String {
    format!(
        "  {} {}  {} {}  {}",
        time(f),
        bw(f),
        time(n),
        bw(n),
        ratio(r)
    )
}

fn blocks(b: Option<u32>) -> String {
    b.map_or("?".to_string(), |b| b.to_string())
}

fn wrong(m: Option<&Measure>) -> String {
    m.and_then(|m| m.wrong)
        .map_or("-".into(), |w| w.to_string())
}

pub fn format_row(r: &VsRow, check: bool) -> String {
    let mut s = format!(
        "{:>W_SIZE$} {:>W_COUNT$} {:>W_TYPE$} {:>W_REDOP$} {:>W_ROOT$}{}{}  {:>W_BLOCKS$}",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        half(
            Some(&r.ferroccl.out_of_place),
            Some(&r.nccl.out_of_place),
            r.ratio_out_of_place
        ),
        half(
            r.ferroccl.in_place.as_ref(),
            r.nccl.in_place.as_ref(),
            r.ratio_in_place
        ),
        format!("{}/{}", blocks(r.ferroccl.blocks), blocks(r.nccl.blocks)),
    );
    if check {
        let w = |l: &super::record::LibResult| {
            let ip = l.in_place.as_ref().and_then(|m| m.wrong).unwrap_or(0);
            l.out_of_place.wrong.map(|o| o + ip)
        };
        s += &format!(
            "  {:>W_WRONG$} {:>W_WRONG$}",
            w(&r.ferroccl).map_or(wrong(None), |v| v.to_string()),
            w(&r.nccl).map_or(wrong(None), |v| v.to_string())
        );
    }
    s
}

/// The header lines; built from the same widths as the rows.
pub fn header(check: bool) -> String {
    let lead = 1 + W_SIZE + 1 + W_COUNT + 1 + W_TYPE + 1 + W_REDOP + 1 + W_ROOT - 1;
    let half_w = 2 + W_TIME + 1 + W_BW + 2 + W_TIME + 1 + W_BW + 2 + W_RATIO;
    let h = |t: &str, b: &str, t2: &str, b2: &str, r: &str| {
        format!("  {t:>W_TIME$} {b:>W_BW$}  {t2:>W_TIME$} {b2:>W_BW$}  {r:>W_RATIO$}")
    };
    let mut l0 = format!(
        "#{}{:>half_w$}{:>half_w$}",
        " ".repeat(lead - 1),
        "---- out-of-place ----",
        "------ in-place ------"
    );
    // The leading columns, both halves (the same heads) and the blocks column of one line.
    let line = |lead: [&str; 5], half: String, blocks: &str| {
        let [size, count, ty, redop, root] = lead;
        format!("#{size:>w$} {count:>W_COUNT$} {ty:>W_TYPE$} {redop:>W_REDOP$} {root:>W_ROOT$}{half}{half}  {blocks:>W_BLOCKS$}", w = W_SIZE - 1)
    };
    let mut l1 = line(
        ["size", "count", "type", "redop", "root"],
        h("ferroccl", "busbw", "NCCL", "busbw", "ratio"),
        "blocks",
    );
    let mut l2 = line(
        ["(B)", "(elements)", "", "", ""],
        h("(us)", "(GB/s)", "(us)", "(GB/s)", "f/N"),
        "f/N",
    );
    if check {
        l0 += &format!("  {:>w$}", "#wrong", w = 2 * W_WRONG + 1);
        l1 += &format!("  {:>W_WRONG$} {:>W_WRONG$}", "ferroccl", "NCCL");
        l2 += &format!("  {:>W_WRONG$} {:>W_WRONG$}", "", "");
    }
    format!("{}\n{}\n{}", l0.trim_end(), l1, l2.trim_end())
}

/// Per operation: mean busbw of each library over the rows and both halves, and their ratio.
pub fn footer(rows: &[VsRow]) -> String {
    let mean = |pick: &dyn Fn(&VsRow) -> Vec<f64>| {
        let v: Vec<f64> = rows.iter().flat_map(pick).collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let f = mean(&|r| {
        std::iter::once(r.ferroccl.out_of_place.busbw)
            .chain(r.ferroccl.in_place.map(|m| m.busbw))
            .collect()
    });
    let n = mean(&|r| {
        std::iter::once(r.nccl.out_of_place.busbw)
            .chain(r.nccl.in_place.map(|m| m.busbw))
            .collect()
    });
    let ratio = if n > 0.0 {
        format!("{:.3}", f / n)
    } else {
        "-".into()
    };
    format!("# Avg bus bandwidth    : ferroccl {f:.4}  NCCL {n:.4}  ratio {ratio}\n#")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::record::tests::sample;

    #[test]
    fn rows_line_up_with_the_header() {
        let rec = sample();
        for check in [false, true] {
            let h = header(check);
            let lines: Vec<&str> = h.lines().collect();
            assert_eq!(lines.len(), 3);
            let r = format_row(&rec.rows[1], check);
            assert_eq!(lines[1].len(), r.len(), "\n{h}\n{r}");
            // The ratio column ends where its numbers end.
            let end = lines[1].find("ratio").unwrap() + 5;
            assert_eq!(&r[end - 4..end], "0.67", "\n{h}\n{r}");
        }
        let r = format_row(&rec.rows[4], false);
        assert!(
            r.contains("n/a"),
            "alltoall in place has no NCCL figure: {r}"
        );
        assert!(r.ends_with("32/24"), "{r}");
        let f = footer(&rec.rows);
        assert!(f.starts_with("# Avg bus bandwidth    : ferroccl "), "{f}");
    }
}
