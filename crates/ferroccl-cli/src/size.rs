//! Byte sizes as nccl-tests takes them on the command line: a number with an optional K, M or
//! G suffix (powers of 1024).

pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    // Accept "64M", "64MB", "64MiB" alike: people type all three.
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .unwrap_or(t);
    let t = if t.len() > 1
        && t.ends_with(['B', 'b'])
        && t[..t.len() - 1].ends_with(|c: char| c.is_ascii_alphabetic())
    {
        &t[..t.len() - 1]
    } else {
        t
    };
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: usize = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 8, 512K, 64M, 1G)"))?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// The sweep nccl-tests walks: from `min` to `max`, multiplying by `factor` (or adding `step`
/// bytes when the factor is 1).
pub fn sweep(min: usize, max: usize, factor: usize, step: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = min;
    while s <= max {
        out.push(s);
        let next = if factor > 1 {
            s.saturating_mul(factor)
        } else {
            s.saturating_add(step.max(1))
        };
        // A zero minimum would never grow by multiplication.
        let next = if next == s { s + 1 } else { next };
        if next <= s {
            break;
        }
        s = next;
    }
    out
}

/// 1024-based human form for headers ("64 MiB").
pub fn human(n: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() && (n >> (10 * (u + 1))) << (10 * (u + 1)) == n {
        v /= 1024.0;
        u += 1;
    }
    format!("{v} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_kmg_suffixes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("512k").unwrap(), 512 << 10);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("64MB").unwrap(), 64 << 20);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("1T").is_err());
        assert!(parse_size("-1K").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn sweep_multiplies_or_steps() {
        assert_eq!(sweep(8, 64, 2, 0), vec![8, 16, 32, 64]);
        assert_eq!(sweep(8, 100, 4, 0), vec![8, 32]);
        assert_eq!(sweep(10, 30, 1, 10), vec![10, 20, 30]);
        assert_eq!(sweep(64, 8, 2, 0), Vec::<usize>::new());
        assert_eq!(sweep(0, 2, 2, 0), vec![0, 1, 2]);
        assert_eq!(human(64 << 20), "64 MiB");
        assert_eq!(human(1000), "1000 B");
    }
}
