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

/// Installs the logger (once, and only if no other is installed) and logs the banner.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Some(level) = std::env::var("NCCL_DEBUG").ok().as_deref().and_then(filter_for) else { return };
        let filter = tracing_subscriber::EnvFilter::new(level);
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
        tracing::info!(
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
}
