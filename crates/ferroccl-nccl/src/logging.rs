//! NCCL_DEBUG for the drop-in library: a program that loads libnccl.so.2 installs no Rust
//! logger, so the library installs one (to stderr) when NCCL_DEBUG asks for messages, and
//! says once, at the first communicator, that the NCCL API in this process is ferroccl's.

use std::sync::Once;

/// The tracing filter for an NCCL_DEBUG value: WARN, INFO, TRACE (NCCL's levels; VERSION
/// shows the one line at init, like INFO), or None for no messages.
pub fn filter_for(nccl_debug: &str) -> Option<&'static str> {
    match nccl_debug.trim().to_ascii_uppercase().as_str() {
        "WARN" => Some("warn"),
        "INFO" | "VERSION" => Some("info"),
        "TRACE" => Some("trace"),
        _ => None,
    }
}

/// ferroccl's modules for each of NCCL's subsystems (NCCL_DEBUG_SUBSYS); TUNING shows the
/// tuner's choices, which ferroccl logs at debug level.
const SUBSYSTEMS: &[(&str, &[&str])] = &[
    (
        "INIT",
        &["ferroccl::comm", "ferroccl::bootstrap", "ferroccl_nccl"],
    ),
    ("BOOTSTRAP", &["ferroccl::bootstrap"]),
    (
        "COLL",
        &["ferroccl::launch", "ferroccl::backend", "ferroccl::group"],
    ),
    ("P2P", &["ferroccl::launch", "ferroccl::backend"]),
    ("SHM", &["ferroccl::transport"]),
    ("NET", &["ferroccl::transport", "ferroccl::bootstrap"]),
    ("ALLOC", &["ferroccl::cuda", "ferroccl_nccl::memory"]),
    (
        "REG",
        &["ferroccl::backend::cuda::window", "ferroccl_nccl::memory"],
    ),
    ("ENV", &["ferroccl_core::config"]),
    ("TUNING", &["ferroccl::info"]),
];

/// The tracing filter for NCCL_DEBUG and NCCL_DEBUG_SUBSYS (a comma list of NCCL's subsystem
/// names, ALL, or `^` and a list to exclude): warnings always show, as NCCL's do; the level's
/// messages show for the chosen subsystems (all when NCCL_DEBUG_SUBSYS is unset).
pub fn directives(nccl_debug: &str, subsys: Option<&str>) -> Option<String> {
    let level = filter_for(nccl_debug)?;
    let Some(list) = subsys.map(str::trim).filter(|s| !s.is_empty()) else {
        return Some(level.to_string());
    };
    let (exclude, list) = match list.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, list),
    };
    let names: Vec<String> = list
        .split(',')
        .map(|n| n.trim().to_ascii_uppercase())
        .filter(|n| !n.is_empty())
        .collect();
    if names.iter().any(|n| n == "ALL") {
        return Some(if exclude {
            "warn".to_string()
        } else {
            level.to_string()
        });
    }
    let targets = |names: &[String]| -> Vec<&'static str> {
        let mut t: Vec<&str> = SUBSYSTEMS
            .iter()
            .filter(|(s, _)| names.iter().any(|n| n == s))
            .flat_map(|(_, t)| t.iter().copied())
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    };
    let mut d = vec![if exclude { level } else { "warn" }.to_string()];
    let chosen = if exclude { "warn" } else { level };
    // TUNING's messages are ferroccl's debug ones: shown at INFO, as NCCL shows its tuning.
    for t in targets(&names) {
        let lvl = if t == "ferroccl::info" && !exclude && level == "info" {
            "debug"
        } else {
            chosen
        };
        d.push(format!("{t}={lvl}"));
    }
    Some(d.join(","))
}

/// Installs the logger (once, and only if no other is installed) and logs the banner.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let subsys = std::env::var("NCCL_DEBUG_SUBSYS").ok();
        let Some(d) = std::env::var("NCCL_DEBUG").ok().as_deref().and_then(|l| directives(l, subsys.as_deref())) else { return };
        let filter = tracing_subscriber::EnvFilter::new(d);
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
        tracing::info!(
            target: "ferroccl_nccl",
            "NCCL INFO ferroccl {} (libnccl.so.2 drop-in, NCCL API {}): this process's NCCL calls run on ferroccl",
            env!("CARGO_PKG_VERSION"),
            ferroccl_core::nccl_abi::version_string(ferroccl_core::nccl_abi::API_VERSION)
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_debug_levels_map_to_filters() {
        assert_eq!(filter_for("WARN"), Some("warn"));
        assert_eq!(filter_for("info"), Some("info"));
        assert_eq!(filter_for(" TRACE "), Some("trace"));
        assert_eq!(filter_for(""), None);
        assert_eq!(filter_for("NONE"), None);
    }

    #[test]
    fn subsystems_choose_modules_and_warnings_always_show() {
        assert_eq!(directives("INFO", None).as_deref(), Some("info"));
        assert_eq!(directives("INFO", Some("ALL")).as_deref(), Some("info"));
        assert_eq!(directives("NONE", Some("INIT")), None);
        assert_eq!(directives("INFO", Some("init,env")).as_deref(), Some("warn,ferroccl::bootstrap=info,ferroccl::comm=info,ferroccl_core::config=info,ferroccl_nccl=info"));
        assert_eq!(
            directives("INFO", Some("TUNING")).as_deref(),
            Some("warn,ferroccl::info=debug")
        );
        assert_eq!(
            directives("TRACE", Some("^SHM")).as_deref(),
            Some("trace,ferroccl::transport=warn")
        );
        assert_eq!(directives("INFO", Some("^ALL")).as_deref(), Some("warn"));
        assert_eq!(directives("WARN", Some("UNKNOWN")).as_deref(), Some("warn"));
        // Every directive parses as a tracing filter.
        for sub in [
            None,
            Some("INIT,COLL,P2P,SHM,NET,ALLOC,REG,ENV,TUNING,BOOTSTRAP"),
            Some("^NET"),
        ] {
            let d = directives("TRACE", sub).unwrap();
            assert!(tracing_subscriber::EnvFilter::try_new(&d).is_ok(), "{d}");
        }
    }
}
