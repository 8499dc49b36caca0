//! The environment parsers fed arbitrary strings: no panic, and every refusal says which
//! variable or knob was wrong. Bounded case counts keep this to about a second.

use ferroccl_core::config::{parse_bool, parse_secret, Config, LaunchEnv};
use ferroccl_core::{CollKind, DataType, ReduceOp, TransportChoice};
use proptest::prelude::*;
use std::collections::HashMap;

const KNOBS: [&str; 12] = [
    "FERROCCL_TIMEOUT",
    "FERROCCL_TRANSPORT",
    "FERROCCL_BOOTSTRAP_ADDR",
    "FERROCCL_MAX_BOOTSTRAP_MSG",
    "FERROCCL_CHANNELS",
    "FERROCCL_GPU_CHANNELS",
    "FERROCCL_CHUNK_BYTES",
    "FERROCCL_SLOT_BYTES",
    "FERROCCL_SLOTS",
    "FERROCCL_JOB_SECRET",
    "FERROCCL_CHECK_MISMATCH",
    "FERROCCL_TCP_CRC",
];

const LAUNCH: [&str; 11] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FERROCCL_MASTER_ADDR",
    "FERROCCL_MASTER_PORT",
    "LOCAL_WORLD_SIZE",
];

/// Values that look like what people type, wrongly: numbers at the edges, signs, units,
/// hex, whitespace, and random text.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[0-9]{0,25}",
        "-?[0-9]{1,20}(\\.[0-9]{0,5})?(e[+-]?[0-9]{1,3})?",
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just(" 4 ".to_string()),
        "[0-9a-fA-F]{30,34}",
        "(1|0|true|false|yes|no|on|off|TRUE|maybe)",
        "(auto|shm|tcp|net|socket|rdma|)",
    ]
}

fn vars_of(keys: &[&str], picks: Vec<(usize, String)>) -> HashMap<String, String> {
    picks
        .into_iter()
        .map(|(k, v)| (keys[k % keys.len()].to_string(), v))
        .collect()
}

/// Words that say what a knob is about, as the messages use them.
fn names_a_knob(m: &str) -> bool {
    m.contains("FERROCCL_")
        || [
            "channels",
            "slots",
            "slot_bytes",
            "chunk_bytes",
            "max_bootstrap_msg",
            "transport",
        ]
        .iter()
        .any(|k| m.contains(k))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn config_from_arbitrary_environments(picks in proptest::collection::vec((0usize..KNOBS.len(), value()), 0..6)) {
        match Config::from_vars(&vars_of(&KNOBS, picks)) {
            Ok(c) => prop_assert!(c.validate().is_ok()),
            Err(e) => prop_assert!(names_a_knob(e.message()), "{e}"),
        }
    }

    #[test]
    fn launcher_from_arbitrary_environments(picks in proptest::collection::vec((0usize..LAUNCH.len(), value()), 0..8)) {
        match LaunchEnv::from_vars(&vars_of(&LAUNCH, picks)) {
            Ok(Some(l)) => prop_assert!(l.rank < l.world_size),
            Ok(None) => {}
            Err(e) => prop_assert!(e.message().contains("environment") || e.message().contains('='), "{e}"),
        }
    }

    #[test]
    fn small_parsers(v in value()) {
        if let Ok(s) = parse_secret(&v) {
            prop_assert_eq!(ferroccl_core::config::format_secret(&s), v.trim().to_ascii_lowercase());
        }
        let _ = parse_bool("K", &v);
        let _ = v.parse::<TransportChoice>();
        let _ = v.parse::<DataType>();
        let _ = v.parse::<ReduceOp>();
        let _ = v.parse::<CollKind>();
    }
}
