use super::*;
use crate::types::DataType::{Bfloat16, Float32, Int8};

fn shape(kind: CollKind, count: usize, dtype: DataType, nranks: usize) -> OpShape {
    OpShape {
        kind,
        count,
        dtype,
        nranks,
        in_place: false,
        windows: false,
        symmetric: false,
        inputs_symmetric: false,
        redop: 0,
    }
}

/// (device, kind, count, dtype, ranks) -> (algorithm, engine, protocol, channels).
type Row = (
    Device,
    CollKind,
    usize,
    DataType,
    usize,
    Algo,
    Engine,
    Protocol,
    usize,
);

/// Point-to-point channels per peer: the knob with few ranks; a full exchange with every peer
/// within 32 blocks beyond that; never below 8 (unless the knob is); collectives unaffected.
#[test]
fn p2p_budget_shrinks_with_ranks_but_not_below_the_floor() {
    let cfg = Config::default();
    let rows = [
        (1, 32),
        (2, 32),
        (3, 16),
        (4, 10),
        (5, 8),
        (8, 8),
        (9, 8),
        (16, 8),
        (1024, 8),
    ];
    for (n, p2p) in rows {
        assert_eq!(channel_budget(Device::Gpu, &cfg, n), (32, p2p), "{n} ranks");
        if n > 3 && p2p > GPU_P2P_CHANNELS_MIN {
            assert!(
                (n - 1) * p2p <= GPU_P2P_LANES,
                "{n} ranks: sends to every peer stay within the lane budget"
            );
        }
    }
    let few = Config {
        gpu_p2p_channels: 4,
        ..Config::default()
    };
    assert_eq!(
        channel_budget(Device::Gpu, &few, 2),
        (32, 4),
        "the knob caps it, below the floor too"
    );
    assert_eq!(channel_budget(Device::Host, &cfg, 8), (1, 1));
}

/// The choices for the default config.
#[test]
fn choices_follow_the_table() {
    use CollKind::*;
    use Device::{Gpu, Host};
    use Engine::{DirectKernel as D, HostExecutor as H, PeerKernel as K, PlanKernel as P};
    use Protocol::{Simple, LL, LL128};
    let cfg = Config::default();
    let rows: &[Row] = &[
        // Small collectives: one-shot on the direct engine, one block per 1 KiB of message.
        (Gpu, AllReduce, 2, Float32, 2, Algo::OneShot, D, LL, 1),
        (Gpu, AllReduce, 256, Float32, 2, Algo::OneShot, D, LL, 1),
        (Gpu, AllReduce, 257, Float32, 2, Algo::OneShot, D, LL, 2),
        (Gpu, AllReduce, 1024, Float32, 2, Algo::OneShot, D, LL, 4),
        (Gpu, AllReduce, 1025, Float32, 2, Algo::OneShot, D, LL, 5),
        (
            Gpu,
            AllReduce,
            16 << 10,
            Float32,
            2,
            Algo::OneShot,
            D,
            LL,
            16,
        ),
        (
            Gpu,
            AllReduce,
            32 << 10,
            Bfloat16,
            2,
            Algo::OneShot,
            D,
            LL,
            16,
        ),
        (Gpu, AllReduce, 64, Float32, 8, Algo::OneShot, D, LL, 1),
        // More ranks, smaller operations: each rank sends its block to n-1 peers.
        (Gpu, AllReduce, 4681, Float32, 8, Algo::OneShot, D, LL, 16),
        (
            Gpu,
            AllReduce,
            4682,
            Float32,
            8,
            Algo::TwoShot,
            K,
            Simple,
            3,
        ),
        (Gpu, AllGather, 1024, Float32, 4, Algo::OneShot, D, LL, 4),
        (Gpu, Reduce, 2, Float32, 2, Algo::OneShot, D, LL, 1),
        (Gpu, Gather, 100, Float32, 8, Algo::OneShot, D, LL, 1),
        (
            Gpu,
            AllReduce,
            64 << 10,
            Bfloat16,
            2,
            Algo::OneShot,
            D,
            LL,
            16,
        ),
        (
            Gpu,
            AllReduce,
            32 << 10,
            Float32,
            2,
            Algo::OneShot,
            D,
            LL,
            16,
        ),
        // Reduce and broadcast on 3+ ranks go on to the peer engine while the root's link
        // carries at most FERROCCL_GPU_PEER_ROOTED_MAX_BYTES (4 MiB: n-1 copies), then to the
        // plan kernel's chain.
        (Gpu, Reduce, 16 << 10, Float32, 3, Algo::OneShot, D, LL, 16),
        (
            Gpu,
            Reduce,
            (16 << 10) + 1,
            Float32,
            3,
            Algo::OneShot,
            K,
            Simple,
            9,
        ),
        (
            Gpu,
            Reduce,
            1 << 19,
            Float32,
            3,
            Algo::OneShot,
            K,
            Simple,
            32,
        ),
        (
            Gpu,
            Reduce,
            (1 << 19) + 1,
            Float32,
            3,
            Algo::Chain,
            P,
            Simple,
            32,
        ),
        (
            Gpu,
            Broadcast,
            (4 << 20) / 7,
            Int8,
            8,
            Algo::OneShot,
            K,
            Simple,
            32,
        ),
        (
            Gpu,
            Broadcast,
            (4 << 20) / 7 + 1,
            Int8,
            8,
            Algo::Chain,
            P,
            Simple,
            32,
        ),
        // Beyond FERROCCL_GPU_PEER_FROM_BYTES (128 KiB): the peer engine, a block per 8 KiB
        // of the largest buffer up to 64 on 2 ranks, 32 beyond; broadcast and reduce beyond 2 ranks on the plan
        // kernel (the chain), its grid following the bytes.
        // All-reduces on 2 ranks one-shot there up to FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES (by
        // default every size), in lines to FERROCCL_GPU_PEER_LINES_MAX_BYTES (1 MiB), two-shot
        // on more ranks.
        (
            Gpu,
            AllReduce,
            (32 << 10) + 1,
            Float32,
            2,
            Algo::OneShot,
            K,
            LL128,
            17,
        ),
        (
            Gpu,
            AllReduce,
            (64 << 10) + 1,
            Float32,
            2,
            Algo::OneShot,
            K,
            LL128,
            33,
        ),
        (
            Gpu,
            AllReduce,
            256 << 10,
            Float32,
            2,
            Algo::OneShot,
            K,
            LL128,
            64,
        ),
        (
            Gpu,
            AllReduce,
            (256 << 10) + 1,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (
            Gpu,
            AllReduce,
            1 << 20,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (
            Gpu,
            AllReduce,
            (1 << 20) + 1,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (
            Gpu,
            AllReduce,
            256 << 20,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (
            Gpu,
            AllReduce,
            1 << 20,
            Float32,
            3,
            Algo::TwoShot,
            K,
            Simple,
            32,
        ),
        (
            Gpu,
            AllGather,
            32 << 10,
            Float32,
            2,
            Algo::OneShot,
            D,
            LL,
            16,
        ),
        (
            Gpu,
            AllGather,
            (32 << 10) + 1,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            33,
        ),
        (
            Gpu,
            ReduceScatter,
            1 << 20,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (
            Gpu,
            ReduceScatter,
            4 << 10,
            Float32,
            8,
            Algo::OneShot,
            D,
            LL,
            16,
        ),
        (
            Gpu,
            Broadcast,
            (8 << 20) - 1,
            Int8,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (Gpu, Broadcast, 8 << 20, Int8, 3, Algo::Chain, P, Simple, 32),
        (Gpu, Reduce, 8 << 20, Int8, 4, Algo::Chain, P, Simple, 32),
        (
            Gpu,
            AllToAll,
            (1 << 20) - 1,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        (
            Gpu,
            Scatter,
            (1 << 18) - 1,
            Float32,
            8,
            Algo::OneShot,
            K,
            Simple,
            32,
        ),
        // The staging's slots (32 MiB) stay at 16 KiB or more to 16 ranks.
        (
            Gpu,
            Gather,
            1 << 20,
            Float32,
            16,
            Algo::OneShot,
            K,
            Simple,
            32,
        ),
        // The copy engine is off by default (not yet measured over NVLink).
        (
            Gpu,
            AllGather,
            1 << 20,
            Float32,
            2,
            Algo::OneShot,
            K,
            Simple,
            64,
        ),
        // More ranks than the direct and peer engines serve.
        (Gpu, AllReduce, 2, Float32, 17, Algo::Ring, P, LL, 1),
        (
            Gpu,
            AllReduce,
            1 << 20,
            Float32,
            17,
            Algo::Ring,
            P,
            Simple,
            32,
        ),
        // Sends and receives: the plan kernel, one block per 1 KiB up to the per-peer budget:
        // 32 with 2 ranks, 32 / (n - 1) with more, never below 8.
        (Gpu, Send, 2, Float32, 2, Algo::Direct, P, LL, 1),
        (Gpu, Send, 2 << 10, Float32, 2, Algo::Direct, P, LL, 8),
        (Gpu, Send, 8 << 10, Float32, 2, Algo::Direct, P, LL, 32),
        (Gpu, Recv, 64 << 20, Float32, 2, Algo::Direct, P, Simple, 32),
        (Gpu, Recv, 64 << 20, Float32, 3, Algo::Direct, P, Simple, 16),
        (Gpu, Send, 64 << 20, Float32, 5, Algo::Direct, P, Simple, 8),
        (Gpu, Send, 64 << 20, Float32, 8, Algo::Direct, P, Simple, 8),
        (Gpu, Send, 64 << 20, Float32, 16, Algo::Direct, P, Simple, 8),
        // The host: one round for small collectives where the reduction order cannot differ
        // between ranks, two-shot all-reduce on 3+ ranks, its channels, a lane per peer
        // direction for sends and receives.
        (Host, AllReduce, 2, Float32, 2, Algo::OneShot, H, Simple, 1),
        (Host, AllReduce, 2, Float32, 3, Algo::TwoShot, H, Simple, 1),
        (
            Host,
            AllReduce,
            32 << 10,
            Float32,
            8,
            Algo::TwoShot,
            H,
            Simple,
            1,
        ),
        (
            Host,
            AllReduce,
            (32 << 10) + 1,
            Float32,
            8,
            Algo::Ring,
            H,
            Simple,
            1,
        ),
        (
            Host,
            ReduceScatter,
            16,
            Float32,
            4,
            Algo::Ring,
            H,
            Simple,
            1,
        ),
        (Host, AllGather, 16, Float32, 4, Algo::OneShot, H, Simple, 1),
        (
            Host,
            AllGather,
            64 << 10,
            Float32,
            4,
            Algo::Ring,
            H,
            Simple,
            1,
        ),
        (Host, Broadcast, 16, Float32, 4, Algo::OneShot, H, Simple, 1),
        (Host, Send, 1 << 20, Float32, 4, Algo::Direct, H, Simple, 1),
    ];
    for &(dev, kind, count, dtype, n, algo, engine, protocol, channels) in rows {
        let c = choose(&shape(kind, count, dtype, n), dev, &cfg);
        assert_eq!(
            (c.algo, c.engine, c.protocol, c.channels),
            (algo, engine, protocol, channels),
            "{dev:?} {kind} {count} x {dtype} on {n}: {c}"
        );
        match engine {
            D => {}
            // A round: a two-shot all-reduce's a slot per share (n shares); a one-shot round
            // fills both phases' slots of its parity (in lines, 15/16 of them data).
            K => {
                let slot = peer_slot_bytes(&cfg, n) / dtype.size();
                assert_eq!(
                    c.chunk_elems,
                    if c.algo == Algo::TwoShot {
                        slot * n
                    } else if c.protocol == LL128 {
                        2 * slot / 16 * 15
                    } else {
                        2 * slot
                    },
                    "{c}"
                );
            }
            // The GPU's FIFOs have slots of their own, and so their chunk.
            _ if dev == Gpu => assert_eq!(c.chunk_elems, cfg.gpu_chunk_bytes() / dtype.size()),
            _ => assert_eq!(c.chunk_elems, cfg.chunk_bytes / dtype.size()),
        }
        // The plan kernel goes zero-copy only with windows; the peer engine's direct rounds
        // are found at run time, so its choice is the kind's.
        let big = shape(kind, count, dtype, n).largest_bytes() >= Some(PEER_DIRECT_MIN_BYTES);
        let direct = engine == K && moves_only(kind) && big;
        assert!(
            c.zero_copy == direct && c.post_output == direct,
            "no windows, no zero-copy but the peer engine's direct rounds: {c}"
        );
    }
}

/// The copy engine's slots: a quarter of a sender's region of the peer engine's staging, off
/// where there is no staging, where the knob says 0, or where slots would be under 256 KiB.
#[test]
fn copy_engine_slots_cut_the_peer_regions() {
    assert_eq!(ce_slot_bytes(&Config::default(), 2), 0, "off by default");
    let cfg = Config {
        gpu_copy_engine_bytes: 8 << 20,
        ..Config::default()
    };
    assert_eq!(ce_slot_bytes(&cfg, 2), 8 << 20);
    assert_eq!(ce_slot_bytes(&cfg, 3), 4 << 20);
    assert_eq!(ce_slot_bytes(&cfg, 8), 1152 << 10);
    assert_eq!(ce_slot_bytes(&cfg, 16), 512 << 10);
    assert_eq!(
        ce_slot_bytes(&cfg, 17),
        0,
        "no peer staging beyond 16 ranks"
    );
    assert_eq!(
        ce_slot_bytes(
            &Config {
                gpu_copy_engine_bytes: 0,
                ..cfg.clone()
            },
            2
        ),
        0
    );
    assert_eq!(
        ce_slot_bytes(
            &Config {
                gpu_peer_bytes: 0,
                ..cfg.clone()
            },
            2
        ),
        0
    );
    // 4 MiB of staging on 2 ranks (64 blocks): 16 KiB peer slots, 1 MiB copy-engine slots;
    // 2 MiB: 8 KiB peer slots, no peer engine to borrow from.
    assert_eq!(
        ce_slot_bytes(
            &Config {
                gpu_peer_bytes: 4 << 20,
                ..cfg.clone()
            },
            2
        ),
        1 << 20
    );
    assert_eq!(
        ce_slot_bytes(
            &Config {
                gpu_peer_bytes: 2 << 20,
                ..cfg.clone()
            },
            2
        ),
        0
    );
    // Fewer peer blocks, larger peer slots: the copy engine's slots stay a quarter of a region.
    assert_eq!(
        ce_slot_bytes(
            &Config {
                gpu_peer_bytes: 2 << 20,
                gpu_peer_blocks: 32,
                ..cfg.clone()
            },
            2
        ),
        512 << 10
    );
    assert_eq!(
        ce_slot_bytes(
            &Config {
                gpu_peer_bytes: 8 << 20,
                ..cfg.clone()
            },
            9
        ),
        0
    );
    // Every slot is a multiple of 4 KiB and CE_SLOTS of them fit a sender's region.
    for n in 2..=16 {
        let (ce, peer) = (ce_slot_bytes(&cfg, n), peer_slot_bytes(&cfg, n));
        assert_eq!(ce % 4096, 0);
        assert!(
            ce * CE_SLOTS <= peer_blocks(&cfg, n) * 4 * peer,
            "{n} ranks"
        );
        assert_eq!(peer_region_bytes(&cfg, n), peer_blocks(&cfg, n) * 4 * peer);
    }
    // Data movement whose largest buffer reaches FERROCCL_GPU_COPY_ENGINE_BYTES: the copy
    // engines, no block, a slot per piece; not reductions, not broadcast beyond 2 ranks, not
    // where there is no staging to borrow (17 ranks and more), not below the size.
    use CollKind::*;
    let rows = [
        (Broadcast, 8 << 20, Int8, 2, true),
        (Broadcast, (8 << 20) - 1, Int8, 2, false),
        (Broadcast, 8 << 20, Int8, 3, false),
        (AllToAll, 1 << 20, Float32, 2, true),
        (AllGather, 1 << 20, Float32, 2, true),
        (AllGather, (1 << 20) - 1, Float32, 2, false),
        (Scatter, 1 << 18, Float32, 8, true),
        (Gather, 1 << 20, Float32, 16, true),
        (Gather, 1 << 20, Float32, 17, false),
        (ReduceScatter, 256 << 20, Float32, 2, false),
        (AllReduce, 256 << 20, Float32, 2, false),
        (Reduce, 256 << 20, Float32, 2, false),
        (Send, 256 << 20, Float32, 2, false),
    ];
    for (kind, count, dtype, n, ce) in rows {
        let c = choose(&shape(kind, count, dtype, n), Device::Gpu, &cfg);
        assert_eq!(
            c.engine == Engine::CopyEngine,
            ce,
            "{kind} {count} x {dtype} on {n}: {c}"
        );
        if ce {
            assert_eq!(
                (c.algo, c.protocol, c.channels),
                (Algo::OneShot, Protocol::Simple, 0)
            );
            assert_eq!(c.chunk_elems, ce_slot_bytes(&cfg, n) / dtype.size());
        }
    }
    // Off: the peer engine takes what the copy engine would.
    let big = shape(CollKind::AllGather, 64 << 20, Float32, 2);
    assert_eq!(choose(&big, Device::Gpu, &cfg).engine, Engine::CopyEngine);
    assert_eq!(
        choose(
            &big,
            Device::Gpu,
            &Config {
                gpu_copy_engine_bytes: 0,
                ..cfg.clone()
            }
        )
        .engine,
        Engine::PeerKernel
    );
    // In a group: the plan kernel, like the one-kernel engines.
    assert!(choose_launch(&[big, big], Device::Gpu, &cfg)
        .iter()
        .all(|c| c.engine == Engine::PlanKernel));
}

/// The direct engine runs one operation per launch and one message per peer and block, which
/// fits its slots.
#[test]
fn the_direct_engine_takes_lone_operations_whose_slices_fit_its_slots() {
    let cfg = Config {
        gpu_oneshot_max_bytes: 4 << 20,
        gpu_peer_from_bytes: 4 << 20,
        ..Config::default()
    };
    let ar = |count| shape(CollKind::AllReduce, count, Float32, 2);
    // (4 MiB per rank in all on 2 ranks: the 256 KiB block bound decides.)
    for count in [1, 7, 1000, 4096, 4097, 50_000, 65_536] {
        let c = choose(&ar(count), Device::Gpu, &cfg);
        assert_eq!(c.engine, Engine::DirectKernel, "{count}");
        assert!(
            c.channels <= DIRECT_MAX_BLOCKS && c.chunk_elems >= count,
            "{c}"
        );
        for ch in 0..c.channels {
            let (a, b) = crate::algo::channel_slice(count, c.channels, ch);
            assert!(
                (b - a) * 4 <= DIRECT_SLOT_BYTES,
                "{count}: slice {ch} of {}",
                c.channels
            );
        }
    }
    // 256 KiB per peer is the most; beyond, the peer engine.
    assert_eq!(
        choose(&ar(65_537), Device::Gpu, &cfg).engine,
        Engine::PeerKernel
    );
    // In a group, every operation takes the plan kernel.
    let group = choose_launch(&[ar(2), ar(2)], Device::Gpu, &cfg);
    assert!(
        group
            .iter()
            .all(|c| c.engine == Engine::PlanKernel && c.algo == Algo::Ring),
        "{group:?}"
    );
    assert_eq!(
        choose_launch(&[ar(2)], Device::Gpu, &cfg)[0].engine,
        Engine::DirectKernel
    );
    // Off: the peer engine, or with it off too, the plan kernel.
    assert_eq!(
        choose(
            &ar(2),
            Device::Gpu,
            &Config {
                gpu_oneshot_max_bytes: 0,
                ..cfg.clone()
            }
        )
        .engine,
        Engine::PeerKernel
    );
    let neither = Config {
        gpu_oneshot_max_bytes: 0,
        gpu_peer_bytes: 0,
        ..cfg.clone()
    };
    assert_eq!(
        choose(&ar(2), Device::Gpu, &neither).engine,
        Engine::PlanKernel
    );
    // The peer engine takes over from FERROCCL_GPU_PEER_FROM_BYTES where it serves; where it
    // does not, the direct engine keeps its whole limit.
    let from = Config {
        gpu_peer_from_bytes: 64 << 10,
        ..Config::default()
    };
    assert_eq!(
        choose(&ar(16 << 10), Device::Gpu, &from).engine,
        Engine::DirectKernel
    );
    assert_eq!(
        choose(&ar((16 << 10) + 1), Device::Gpu, &from).engine,
        Engine::PeerKernel
    );
    let reduce3 = |count| shape(CollKind::Reduce, count, Float32, 3);
    // A reduce on 3 ranks is the peer engine's while the root's link carries at most
    // FERROCCL_GPU_PEER_ROOTED_MAX_BYTES; with that at 0, the chain is next.
    assert_eq!(
        choose(&reduce3(8 << 10), Device::Gpu, &from).engine,
        Engine::DirectKernel
    );
    assert_eq!(
        choose(&reduce3((16 << 10) + 1), Device::Gpu, &from).engine,
        Engine::PeerKernel
    );
    let chain = Config {
        gpu_peer_rooted_max_bytes: 0,
        ..from.clone()
    };
    assert_eq!(
        choose(&reduce3(32 << 10), Device::Gpu, &chain).engine,
        Engine::DirectKernel,
        "256 KiB sent, no peer engine next"
    );
    assert_eq!(
        choose(&reduce3((32 << 10) + 1), Device::Gpu, &chain).engine,
        Engine::PlanKernel
    );
    let no_peer = Config {
        gpu_peer_bytes: 0,
        ..from.clone()
    };
    assert_eq!(
        choose(&ar(64 << 10), Device::Gpu, &no_peer).engine,
        Engine::DirectKernel,
        "no staging: the direct engine's own limit"
    );
}

/// The peer engine: symmetric collectives alone in their launch, 2 to 16 ranks, staging of at
/// least 16 KiB a slot; rounds that fit a slot per share (two-shot) or both phases' slots of a
/// parity (one-shot); blocks by the bytes.
#[test]
fn the_peer_engine_takes_lone_symmetric_collectives_in_rounds_that_fit_its_slots() {
    let cfg = Config::default();
    assert_eq!(
        (
            peer_blocks(&cfg, 2),
            peer_blocks(&cfg, 3),
            peer_blocks(&cfg, 16)
        ),
        (64, 32, 32)
    );
    assert_eq!(peer_slot_bytes(&cfg, 2), 128 << 10, "64 blocks on 2 ranks");
    assert_eq!(
        peer_slot_bytes(&cfg, 3),
        128 << 10,
        "32 blocks, the staging shared by the peers"
    );
    assert_eq!(peer_slot_bytes(&cfg, 8), 36 << 10);
    assert_eq!(peer_slot_bytes(&cfg, 9), 32 << 10);
    assert_eq!(peer_slot_bytes(&cfg, 16), 16 << 10);
    let half = Config {
        gpu_peer_bytes: 16 << 20,
        ..cfg.clone()
    };
    assert_eq!(peer_slot_bytes(&half, 10), 0, "under 16 KiB a slot: off");
    assert_eq!(
        peer_slot_bytes(
            &Config {
                gpu_peer_bytes: 32 << 20,
                ..Config::default()
            },
            16
        ),
        16 << 10
    );
    assert_eq!(peer_slot_bytes(&cfg, 1), 0);
    assert_eq!(peer_slot_bytes(&cfg, 17), 0);
    let two = peer_blocks(&cfg, 2);
    let small = Config {
        gpu_peer_bytes: (PEER_MIN_SLOT_BYTES * two * 4) - 1,
        ..Config::default()
    };
    assert_eq!(
        peer_slot_bytes(
            &Config {
                gpu_peer_bytes: PEER_MIN_SLOT_BYTES * two * 4,
                ..Config::default()
            },
            2
        ),
        PEER_MIN_SLOT_BYTES
    );
    assert_eq!(peer_slot_bytes(&small, 2), 0, "below 16 KiB a slot: off");
    let odd = Config {
        gpu_peer_bytes: 5 << 20,
        ..Config::default()
    };
    assert_eq!(peer_slot_bytes(&odd, 2) % 4096, 0);
    // FERROCCL_GPU_PEER_BLOCKS is the most: fewer where slots would fall under 16 KiB, so that
    // many blocks on many ranks (bench --max-ctas 64 on 8) keep the engine rather than turn it off.
    for (n, knob, blocks) in [
        (2, 16, 16),
        (2, 64, 64),
        (3, 64, 64),
        (8, 64, 64),
        (9, 64, 64),
        (10, 64, 56),
        (16, 64, 34),
        (16, 7, 7),
    ] {
        let c = Config {
            gpu_peer_blocks: knob,
            ..Config::default()
        };
        assert_eq!(peer_blocks(&c, n), blocks, "{n} ranks, knob {knob}");
        let slot = peer_slot_bytes(&c, n);
        assert!(
            slot >= PEER_MIN_SLOT_BYTES
                && slot.is_multiple_of(4096)
                && blocks * (n - 1) * 4 * slot <= c.gpu_peer_bytes,
            "{n} ranks: {slot}"
        );
    }
    let tiny = Config {
        gpu_peer_blocks: 64,
        gpu_peer_bytes: 64 << 10,
        ..Config::default()
    };
    assert_eq!(
        (peer_blocks(&tiny, 2), peer_slot_bytes(&tiny, 2)),
        (1, 16 << 10),
        "one block of 16 KiB slots"
    );
    assert_eq!(
        peer_slot_bytes(
            &Config {
                gpu_peer_bytes: (64 << 10) - 1,
                ..tiny
            },
            2
        ),
        0,
        "under one block's slots: off"
    );
    for n in [2, 3, 5, 8] {
        for dtype in [Int8, Bfloat16, Float32, DataType::Float64] {
            let es = dtype.size();
            let slot = peer_slot_bytes(&cfg, n);
            assert_eq!((slot / es) % 64, 0, "a slot holds whole 64-element cuts");
            let mut kinds = vec![
                CollKind::AllReduce,
                CollKind::ReduceScatter,
                CollKind::AllGather,
                CollKind::AllToAll,
                CollKind::Gather,
                CollKind::Scatter,
            ];
            if n == 2 {
                kinds.extend([CollKind::Broadcast, CollKind::Reduce]);
            }
            for kind in kinds {
                for count in [(256 << 10) / es + 1, 1 << 20, 3 << 24, 123_456_789] {
                    let c = choose(&shape(kind, count, dtype, n), Device::Gpu, &cfg);
                    assert_eq!(
                        c.engine,
                        Engine::PeerKernel,
                        "{kind} {count} x {dtype} on {n}: {c}"
                    );
                    assert!((1..=peer_blocks(&cfg, n)).contains(&c.channels));
                    // Every share of every round of every block fits a slot.
                    for ch in [0, c.channels - 1] {
                        let (a, b) = crate::algo::channel_slice(count, c.channels, ch);
                        let len = (b - a).min(c.chunk_elems);
                        // A one-shot round (every kind but the two-shot all-reduce) fills both
                        // phases' slots of a parity, which are adjacent: two slots.
                        if c.algo == Algo::OneShot {
                            assert!(kind != CollKind::AllReduce || n == 2, "{c}");
                            assert!(
                                len * es <= 2 * slot,
                                "{kind} {count} x {dtype} on {n}: a one-shot round of {len}"
                            );
                        } else {
                            assert_eq!((kind, c.algo), (CollKind::AllReduce, Algo::TwoShot));
                            for q in 0..n {
                                let (x, y) = crate::algo::channel_slice(len, n, q);
                                assert!(
                                    (y - x) * es <= slot,
                                    "{kind} {count} x {dtype} on {n}: share {q} of {} elements",
                                    y - x
                                );
                            }
                        }
                    }
                }
            }
            // Sends keep the plan kernel, and so do broadcast and reduce beyond 2 ranks once the
            // root's n-1 copies pass FERROCCL_GPU_PEER_ROOTED_MAX_BYTES (the chain loads each
            // link once); within it, the peer engine.
            let mut plan = vec![CollKind::Send, CollKind::Recv];
            if n > 2 {
                plan.extend([CollKind::Broadcast, CollKind::Reduce]);
                for kind in [CollKind::Broadcast, CollKind::Reduce] {
                    let fits = cfg.gpu_peer_rooted_max_bytes / (n - 1) / es;
                    let c = choose(&shape(kind, fits, dtype, n), Device::Gpu, &cfg);
                    assert_eq!(
                        (c.engine, c.algo),
                        (Engine::PeerKernel, Algo::OneShot),
                        "{kind} {fits} x {dtype} on {n}: {c}"
                    );
                    assert!(c.chunk_elems * es <= 2 * slot);
                    let c = choose(&shape(kind, fits + 1, dtype, n), Device::Gpu, &cfg);
                    assert_eq!(
                        c.engine,
                        Engine::PlanKernel,
                        "{kind} {} x {dtype} on {n}: {c}",
                        fits + 1
                    );
                }
            }
            for kind in plan {
                assert_eq!(
                    choose(&shape(kind, 1 << 22, dtype, n), Device::Gpu, &cfg).engine,
                    Engine::PlanKernel,
                    "{kind}"
                );
            }
        }
    }
    // Groups, too many ranks, the knob off: the plan kernel.
    let ar = shape(CollKind::AllReduce, 1 << 22, Float32, 2);
    assert!(choose_launch(&[ar, ar], Device::Gpu, &cfg)
        .iter()
        .all(|c| c.engine == Engine::PlanKernel));
    assert_eq!(
        choose(&OpShape { nranks: 17, ..ar }, Device::Gpu, &cfg).engine,
        Engine::PlanKernel
    );
    assert_eq!(
        choose(
            &ar,
            Device::Gpu,
            &Config {
                gpu_peer_bytes: 0,
                ..cfg.clone()
            }
        )
        .engine,
        Engine::PlanKernel
    );
    // FERROCCL_GPU_PEER_BLOCKS caps its blocks, FERROCCL_GPU_CHANNELS the plan kernel's only.
    assert_eq!(
        choose(
            &ar,
            Device::Gpu,
            &Config {
                gpu_peer_blocks: 8,
                ..cfg.clone()
            }
        )
        .channels,
        8
    );
    assert_eq!(
        choose(
            &ar,
            Device::Gpu,
            &Config {
                gpu_channels: 8,
                ..cfg.clone()
            }
        )
        .channels,
        64
    );
    // Every rank plans the same: the plan the simulator proves for these cuts is tested in
    // algo::tests (the `peer` cuts).
}

/// The peer engine's all-reduce goes one-shot on 2 ranks up to
/// FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES per rank (a round of two slots), two-shot beyond it, on
/// more ranks, or with the knob at 0; the blocks do not depend on it.
#[test]
fn the_peer_engine_all_reduce_goes_one_shot_on_two_ranks_within_its_knob() {
    // By default at every size on 2 ranks (a round of two slots); the knob's bound at 4 MiB.
    let two_gib = choose(
        &shape(CollKind::AllReduce, 1 << 29, Float32, 2),
        Device::Gpu,
        &Config::default(),
    );
    assert_eq!(
        (two_gib.engine, two_gib.algo),
        (Engine::PeerKernel, Algo::OneShot),
        "{two_gib}"
    );
    // Staged rounds: lines keep within the one-shot's knob too (a two-shot never takes them).
    let cfg = Config {
        gpu_peer_oneshot_max_bytes: 4 << 20,
        gpu_peer_lines_max_bytes: 0,
        ..Config::default()
    };
    let slot = peer_slot_bytes(&cfg, 2);
    let lined = Config {
        gpu_peer_lines_max_bytes: 8 << 20,
        ..cfg.clone()
    };
    let beyond = shape(CollKind::AllReduce, (4 << 20) / 4 + 1, Float32, 2);
    assert_eq!(
        choose(&beyond, Device::Gpu, &lined).protocol,
        Protocol::Simple
    );
    for dtype in [Int8, Bfloat16, Float32, DataType::Float64] {
        let es = dtype.size();
        let at = cfg.gpu_peer_oneshot_max_bytes / es;
        let c = choose(&shape(CollKind::AllReduce, at, dtype, 2), Device::Gpu, &cfg);
        assert_eq!(
            (c.engine, c.algo, c.chunk_elems * es),
            (Engine::PeerKernel, Algo::OneShot, 2 * slot),
            "{c}"
        );
        assert!(
            c.to_string()
                .contains("FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES"),
            "{c}"
        );
        let beyond = choose(
            &shape(CollKind::AllReduce, at + 1, dtype, 2),
            Device::Gpu,
            &cfg,
        );
        assert_eq!(
            (beyond.algo, beyond.chunk_elems * es, beyond.channels),
            (Algo::TwoShot, 2 * slot, c.channels)
        );
        let off = Config {
            gpu_peer_oneshot_max_bytes: 0,
            ..cfg.clone()
        };
        assert_eq!(
            choose(&shape(CollKind::AllReduce, at, dtype, 2), Device::Gpu, &off).algo,
            Algo::TwoShot
        );
        let all = Config {
            gpu_peer_oneshot_max_bytes: usize::MAX,
            ..cfg.clone()
        };
        assert_eq!(
            choose(
                &shape(CollKind::AllReduce, 1 << 28, dtype, 2),
                Device::Gpu,
                &all
            )
            .algo,
            Algo::OneShot
        );
        for n in [3, 4, 8] {
            let c = choose(
                &shape(CollKind::AllReduce, (1 << 20) / es, dtype, n),
                Device::Gpu,
                &all,
            );
            assert_eq!(
                (c.engine, c.algo),
                (Engine::PeerKernel, Algo::TwoShot),
                "{n} ranks: {c}"
            );
        }
    }
    // The other kinds' one-shot rounds fill both phases' slots of a parity too.
    let rs = choose(
        &shape(CollKind::ReduceScatter, 1 << 20, Float32, 2),
        Device::Gpu,
        &cfg,
    );
    assert_eq!((rs.algo, rs.chunk_elems * 4), (Algo::OneShot, 2 * slot));
}

/// GPU all-reduces on 3+ ranks beyond the direct engine and within a chunk: the ring unless
/// FERROCCL_GPU_TWO_SHOT, then two-shot; never on 2 ranks, nor beyond a chunk.
#[test]
fn gpu_two_shot_only_when_asked() {
    // (With the peer engine off: it takes these operations otherwise.)
    // (A chunk of 1 MiB, as the test's sizes say, the GPU's FIFOs holding two.)
    let on = Config {
        gpu_two_shot: true,
        gpu_peer_bytes: 0,
        chunk_bytes: 1 << 20,
        gpu_slots: 16,
        ..Config::default()
    };
    let off = Config {
        gpu_peer_bytes: 0,
        chunk_bytes: 1 << 20,
        gpu_slots: 16,
        ..Config::default()
    };
    let ar = |count, n| shape(CollKind::AllReduce, count, Float32, n);
    // 3 ranks, 256K floats (1 MiB per rank): past the direct engine, one chunk.
    assert_eq!(
        choose(&ar(256 << 10, 3), Device::Gpu, &off).algo,
        Algo::Ring
    );
    let c = choose(&ar(256 << 10, 3), Device::Gpu, &on);
    assert_eq!(
        (c.algo, c.engine),
        (Algo::TwoShot, Engine::PlanKernel),
        "{c}"
    );
    assert!(c.to_string().contains("FERROCCL_GPU_TWO_SHOT"), "{c}");
    assert_eq!(
        choose(&ar(256 << 10, 2), Device::Gpu, &on).algo,
        Algo::Ring,
        "2 ranks: the ring"
    );
    assert_eq!(
        choose(&ar((256 << 10) + 1, 3), Device::Gpu, &on).algo,
        Algo::Ring,
        "beyond a chunk: the ring"
    );
    assert_eq!(
        choose(&ar(2, 3), Device::Gpu, &on).engine,
        Engine::DirectKernel,
        "small: the direct engine"
    );
    assert_eq!(
        choose(
            &shape(CollKind::ReduceScatter, 256 << 10, Float32, 3),
            Device::Gpu,
            &on
        )
        .algo,
        Algo::Ring
    );
}

#[test]
fn knobs_move_the_choices() {
    let small = shape(CollKind::AllReduce, 2, Float32, 4);
    let mut cfg = Config {
        channels: 3,
        gpu_channels: 16,
        ..Config::default()
    };
    assert_eq!(choose(&small, Device::Host, &cfg).channels, 3);
    // The peer engine's blocks follow their own knob (the blocks its staging is cut for), the
    // plan kernel's the channels'.
    let big = shape(CollKind::AllReduce, 1 << 20, Float32, 2);
    assert_eq!(choose(&big, Device::Gpu, &cfg).channels, 64);
    let peer16 = Config {
        gpu_peer_blocks: 16,
        ..cfg.clone()
    };
    let c = choose(&big, Device::Gpu, &peer16);
    assert_eq!((c.engine, c.channels), (Engine::PeerKernel, 16));
    assert_eq!(
        c.chunk_elems * 4,
        2 * peer_slot_bytes(&peer16, 2),
        "larger slots with fewer blocks"
    );
    assert_eq!(peer_slot_bytes(&peer16, 2), 512 << 10);
    assert_eq!(
        choose(
            &big,
            Device::Gpu,
            &Config {
                gpu_peer_bytes: 0,
                ..cfg.clone()
            }
        )
        .channels,
        16,
        "the plan kernel: FERROCCL_GPU_CHANNELS"
    );
    // Sends follow their own knob, not the collectives'.
    assert_eq!(
        choose(
            &shape(CollKind::Send, 1 << 20, Float32, 2),
            Device::Gpu,
            &cfg
        )
        .channels,
        32
    );
    cfg.gpu_p2p_channels = 4;
    assert_eq!(
        choose(
            &shape(CollKind::Send, 1 << 20, Float32, 2),
            Device::Gpu,
            &cfg
        )
        .channels,
        4
    );
    cfg.gpu_channels = 4;
    cfg.gpu_channel_bytes = 1;
    cfg.gpu_oneshot_max_bytes = 0;
    cfg.gpu_peer_bytes = 0;
    assert_eq!(
        choose(
            &shape(CollKind::AllReduce, 2, Float32, 2),
            Device::Gpu,
            &cfg
        )
        .channels,
        4
    );
    // FERROCCL_DIRECT_MAX_BYTES=0 turns the two-shot off; the chunk bounds it too.
    assert_eq!(
        choose(
            &small,
            Device::Host,
            &Config {
                direct_max_bytes: 0,
                ..Config::default()
            }
        )
        .algo,
        Algo::Ring
    );
    let chunked = Config {
        chunk_bytes: 64,
        direct_max_bytes: 1 << 20,
        ..Config::default()
    };
    assert_eq!(
        choose(
            &shape(CollKind::AllReduce, 16, Float32, 4),
            Device::Host,
            &chunked
        )
        .algo,
        Algo::TwoShot
    );
    assert_eq!(
        choose(
            &shape(CollKind::AllReduce, 17, Float32, 4),
            Device::Host,
            &chunked
        )
        .algo,
        Algo::Ring
    );
    // LL off, or smaller (on the plan kernel).
    let gpu_small = shape(CollKind::AllReduce, 2, Float32, 2);
    let plan_kernel = Config {
        gpu_oneshot_max_bytes: 0,
        gpu_peer_bytes: 0,
        ..Config::default()
    };
    assert_eq!(
        choose(
            &gpu_small,
            Device::Gpu,
            &Config {
                ll_max_bytes: 0,
                ..plan_kernel.clone()
            }
        )
        .protocol,
        Protocol::Simple
    );
    let ll16 = Config {
        ll_max_bytes: 16 << 10,
        ..plan_kernel
    };
    assert_eq!(
        choose(
            &shape(CollKind::AllReduce, 4096, Float32, 8),
            Device::Gpu,
            &ll16
        )
        .protocol,
        Protocol::LL
    );
    assert_eq!(
        choose(
            &shape(CollKind::AllReduce, 4097, Float32, 8),
            Device::Gpu,
            &ll16
        )
        .protocol,
        Protocol::Simple
    );
}

#[test]
fn ll_never_carries_more_than_a_connection_holds() {
    let ll = |ll_max_bytes, slots, slot_bytes| {
        ll_limit(&Config {
            ll_max_bytes,
            slots,
            slot_bytes,
            ..Config::default()
        })
    };
    assert_eq!(ll(128 << 10, 8, 256 << 10), 64 << 10);
    assert_eq!(ll(16 << 10, 8, 256 << 10), 16 << 10);
    assert_eq!(ll(128 << 10, 2, 4096), 8192);
    assert_eq!(ll(0, 8, 256 << 10), 0);
}

/// LL is decided from what every rank shares: a gather's root holds n times the others'
/// buffer, and every rank decides by the root's.
#[test]
fn ll_is_decided_by_the_largest_buffer_of_any_rank() {
    // (The plan kernel's protocol: both one-operation engines off.)
    let cfg = Config {
        ll_max_bytes: 16 << 10,
        gpu_oneshot_max_bytes: 0,
        gpu_peer_bytes: 0,
        ..Config::default()
    };
    let p = |kind, count| choose(&shape(kind, count, Float32, 4), Device::Gpu, &cfg).protocol;
    assert_eq!(p(CollKind::Gather, 1024), Protocol::LL);
    assert_eq!(p(CollKind::Gather, 1025), Protocol::Simple);
    assert_eq!(p(CollKind::Send, 4096), Protocol::LL);
    assert_eq!(p(CollKind::Recv, 4096), Protocol::LL);
    // An overflowing size is not small, and takes every channel.
    let huge = choose(
        &shape(CollKind::AllGather, usize::MAX / 2, Float32, 4),
        Device::Gpu,
        &cfg,
    );
    assert_eq!(
        (huge.protocol, huge.channels),
        (Protocol::Simple, cfg.gpu_channels)
    );
}

/// Sends and receives take LL up to FERROCCL_LL_MAX_BYTES, as long as each channel's share fits
/// one connection's LL slots (a collective's messages must fit whole: `ll_limit`); registered
/// ones are staged like the rest.
#[test]
fn sends_take_ll_while_each_channels_share_fits_a_connection() {
    use CollKind::{Recv, Send};
    let cfg = Config::default();
    let c = |kind, count, cfg: &Config| choose(&shape(kind, count, Float32, 2), Device::Gpu, cfg);
    // 128 KiB and 512 KiB: 32 channels of 4 and 16 KiB, LL on both ends alike.
    for kind in [Send, Recv] {
        for count in [32 << 10, 128 << 10] {
            let x = c(kind, count, &cfg);
            assert_eq!((x.protocol, x.channels), (Protocol::LL, 32), "{kind}: {x}");
        }
    }
    // One element more than the knob: simple.
    assert_eq!(c(Send, (128 << 10) + 1, &cfg).protocol, Protocol::Simple);
    // A collective of the same size on the plan kernel stays within one connection's 32 KiB.
    let plan_kernel = Config {
        gpu_oneshot_max_bytes: 0,
        gpu_peer_bytes: 0,
        ..Config::default()
    };
    assert_eq!(
        choose(
            &shape(CollKind::AllGather, 16 << 10, Float32, 2),
            Device::Gpu,
            &plan_kernel
        )
        .protocol,
        Protocol::Simple
    );
    // A larger knob: LL while a share fits 4 slots of 8 KiB (32 channels x 32 KiB = 1 MiB).
    let big = Config {
        ll_max_bytes: 4 << 20,
        ..Config::default()
    };
    assert_eq!(c(Send, 256 << 10, &big).protocol, Protocol::LL);
    assert_eq!(c(Send, 256 << 10, &big).channels, 32);
    assert_eq!(c(Recv, 256 << 10, &big).protocol, Protocol::LL);
    assert_eq!(
        c(Send, (256 << 10) + 1, &big).protocol,
        Protocol::Simple,
        "a share of 32 KiB + 4 B"
    );
    // Fewer channels: larger shares, so less goes LL.
    let few = Config {
        gpu_p2p_channels: 4,
        ..big.clone()
    };
    assert_eq!(c(Send, 32 << 10, &few).protocol, Protocol::LL);
    assert_eq!(c(Send, (32 << 10) + 1, &few).protocol, Protocol::Simple);
    // The share is the largest slice as the plan cuts it (cuts aligned to 64 elements), not
    // count / channels: with two 128-byte slots (256 bytes of LL a connection, 32 int64s) an
    // int64 send of 100 elements on 4 channels has a slice of 64 elements, where 100 / 4 is 25.
    let tiny = Config {
        gpu_p2p_channels: 4,
        gpu_channel_bytes: 64,
        slots: 2,
        slot_bytes: 128,
        chunk_bytes: 128,
        ..big.clone()
    };
    tiny.validate().unwrap();
    let x = choose(&shape(Send, 100, DataType::Int64, 2), Device::Gpu, &tiny);
    assert_eq!((x.channels, x.protocol), (4, Protocol::Simple), "{x}");
    let x = choose(&shape(Send, 32, DataType::Int64, 2), Device::Gpu, &tiny);
    assert_eq!(x.protocol, Protocol::LL, "{x}");
    // Registered sends and receives are staged (zero-copy lost at every size on 2 x H200).
    for count in [1 << 20, 1 << 28] {
        let x = choose(
            &OpShape {
                windows: true,
                ..shape(Send, count, Float32, 2)
            },
            Device::Gpu,
            &cfg,
        );
        assert!(
            x.protocol == Protocol::Simple && !x.zero_copy && !x.post_output,
            "{x}"
        );
    }
}

#[test]
fn zero_copy_needs_windows_the_simple_protocol_and_a_safe_output() {
    // The plan kernel's zero-copy (the peer engine stages everything).
    let cfg = Config {
        gpu_peer_bytes: 0,
        ..Config::default()
    };
    let big = OpShape {
        windows: true,
        ..shape(CollKind::AllToAll, 1 << 20, Float32, 2)
    };
    let c = choose(&big, Device::Gpu, &cfg);
    assert!(c.zero_copy && c.post_output, "{c}");
    // In place, an all-to-all still takes part in the handshake but offers nothing.
    let c = choose(
        &OpShape {
            in_place: true,
            ..big
        },
        Device::Gpu,
        &cfg,
    );
    assert!(c.zero_copy && !c.post_output, "{c}");
    assert!(
        !choose(&OpShape { count: 2, ..big }, Device::Gpu, &cfg).zero_copy,
        "LL carries flags in the data"
    );
    assert!(
        !choose(
            &OpShape {
                windows: false,
                ..big
            },
            Device::Gpu,
            &cfg
        )
        .zero_copy
    );
    assert!(
        !choose(&big, Device::Host, &cfg).zero_copy,
        "the host has no windows"
    );
}

/// Gather and scatter: the ranks exchange their outputs' places from
/// FERROCCL_GPU_CE_GATHER_BYTES (and FERROCCL_GPU_CE_RENDEZVOUS_BYTES and
/// FERROCCL_GPU_CE_WINDOW_BYTES) up on a communicator with windows or with outputs mapped on the
/// fly, and once they have (`symmetric`), the copy engines take them; below, on the host, with
/// neither windows nor mapping, or with any of the three knobs at 0, no exchange and no copy
/// engines. The all-gather's exchange starts lower, at FERROCCL_GPU_CE_RENDEZVOUS_BYTES.
#[test]
fn gathers_and_scatters_exchange_outputs_and_take_the_copy_engines_from_their_threshold() {
    let cfg = Config::default();
    let at = |kind, bytes: usize, symmetric| OpShape {
        windows: true,
        symmetric,
        ..shape(kind, bytes / 4 / 2, Float32, 2)
    };
    let min = cfg.gpu_ce_gather_bytes;
    let rv = cfg.gpu_ce_rendezvous_bytes;
    assert!(min > rv && rv >= cfg.gpu_ce_window_bytes && cfg.gpu_ce_window_bytes > 0);
    let bare_ag = OpShape {
        windows: false,
        ..at(CollKind::AllGather, rv, false)
    };
    assert!(rendezvous_wanted(&bare_ag, Device::Gpu, &cfg));
    for kind in [CollKind::Gather, CollKind::Scatter] {
        // At the all-gather's threshold a gather or scatter keeps its kernels, unless its own
        // threshold comes down to it.
        assert!(
            !rendezvous_wanted(&at(kind, rv, false), Device::Gpu, &cfg),
            "{kind}"
        );
        let lower = Config {
            gpu_ce_gather_bytes: rv,
            ..cfg.clone()
        };
        assert!(
            rendezvous_wanted(&at(kind, rv, false), Device::Gpu, &lower),
            "{kind}"
        );
        assert!(
            rendezvous_wanted(&at(kind, min, false), Device::Gpu, &cfg),
            "{kind}"
        );
        let c = choose(&at(kind, min, true), Device::Gpu, &cfg);
        assert!(
            c.engine == Engine::CopyEngine && c.zero_copy && c.channels == 0,
            "{kind}: {c}"
        );
        // Not exchanged (or refused by a posting): the kernels.
        assert_ne!(
            choose(&at(kind, min, false), Device::Gpu, &cfg).engine,
            Engine::CopyEngine
        );
        assert!(
            !rendezvous_wanted(&at(kind, min / 2, false), Device::Gpu, &cfg),
            "{kind}"
        );
        assert_ne!(
            choose(&at(kind, min / 2, true), Device::Gpu, &cfg).engine,
            Engine::CopyEngine,
            "{kind} below the threshold"
        );
        assert!(!rendezvous_wanted(
            &at(kind, min, false),
            Device::Host,
            &cfg
        ));
        let bare = OpShape {
            windows: false,
            ..at(kind, min, false)
        };
        assert!(
            rendezvous_wanted(&bare, Device::Gpu, &cfg),
            "{kind} without windows: outputs mapped on the fly"
        );
        let unmapped = Config {
            gpu_ce_map_unregistered: false,
            ..cfg.clone()
        };
        assert!(
            !rendezvous_wanted(&bare, Device::Gpu, &unmapped),
            "{kind} with neither windows nor mapping"
        );
        assert!(rendezvous_wanted(
            &at(kind, min, false),
            Device::Gpu,
            &unmapped
        ));
        for off in [
            Config {
                gpu_ce_rendezvous_bytes: 0,
                ..cfg.clone()
            },
            Config {
                gpu_ce_window_bytes: 0,
                ..cfg.clone()
            },
            Config {
                gpu_ce_gather_bytes: 0,
                ..cfg.clone()
            },
        ] {
            assert!(!rendezvous_wanted(
                &at(kind, 1 << 30, false),
                Device::Gpu,
                &off
            ));
        }
        // The window knob above the exchange's: the exchange waits for it.
        let later = Config {
            gpu_ce_window_bytes: 2 * min,
            ..cfg.clone()
        };
        assert!(!rendezvous_wanted(
            &at(kind, min, false),
            Device::Gpu,
            &later
        ));
        assert!(rendezvous_wanted(
            &at(kind, 2 * min, false),
            Device::Gpu,
            &later
        ));
    }
    // All-gather, all-to-all and broadcast exchange only where their buffers lie in no
    // symmetric window (in one, each rank names its peers' outputs itself); the reductions never
    // for the copies.
    for kind in CollKind::COLLECTIVES
        .into_iter()
        .filter(|k| !matches!(k, CollKind::Gather | CollKind::Scatter))
    {
        let moves = matches!(
            kind,
            CollKind::AllGather | CollKind::AllToAll | CollKind::Broadcast
        );
        // Twice the threshold: a broadcast's largest buffer is half a gather's here. A reduce
        // from its pull's floor exchanges for the pull.
        let pulls = kind == CollKind::Reduce && 2 * min >= cfg.gpu_peer_pull_reduce_min_bytes;
        assert_eq!(
            rendezvous_wanted(&at(kind, 2 * min, false), Device::Gpu, &cfg),
            moves || pulls,
            "{kind}"
        );
        // Between symmetric windows, inputs too (a reduce's root names its peer's input then).
        let windowed = OpShape {
            inputs_symmetric: true,
            ..at(kind, 2 * min, true)
        };
        assert!(
            !rendezvous_wanted(&windowed, Device::Gpu, &cfg),
            "{kind} between symmetric windows"
        );
        if moves {
            let c = choose(&at(kind, 2 * min, true), Device::Gpu, &cfg);
            assert!(c.engine == Engine::CopyEngine && c.zero_copy, "{kind}: {c}");
        }
    }
    assert!(!rendezvous_wanted(
        &OpShape {
            windows: true,
            ..shape(CollKind::Broadcast, min, Float32, 3)
        },
        Device::Gpu,
        &cfg
    ));
}

/// All-reduces, reduce-scatters and reduces of 2 ranks exchange their outputs where the tuner
/// would give them the copy-and-fold into posted outputs (from FERROCCL_GPU_FOLD_MIN_BYTES, a
/// reduction the fold pays for) and their buffers lie in no symmetric window (the reduce even
/// there: only its root's posting tells whether it is in place); the exchange does not depend on
/// whether this rank is in place (a rank in place refuses by its posting). (Below the fold, or
/// where it does not pay, a reduce may exchange for its pull instead: tested on its own.)
#[test]
fn copy_and_fold_reductions_exchange_outputs_where_the_fold_would_take_them() {
    let cfg = Config::default();
    // The reduce has a threshold of its own (FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES).
    assert_eq!(
        fold_min_bytes(&cfg, CollKind::Reduce),
        cfg.gpu_fold_reduce_min_bytes
    );
    assert_eq!(
        fold_min_bytes(&cfg, CollKind::AllReduce),
        cfg.gpu_fold_min_bytes
    );
    let at = |kind, bytes: usize, dtype: DataType, redop: i32| OpShape {
        redop,
        ..shape(kind, bytes / dtype.size(), dtype, 2)
    };
    for kind in [
        CollKind::AllReduce,
        CollKind::ReduceScatter,
        CollKind::Reduce,
    ] {
        let min = fold_min_bytes(&cfg, kind);
        // A reduce-scatter's largest buffer is its input: count x 2 elements.
        let bytes = if kind == CollKind::ReduceScatter {
            min / 2
        } else {
            min
        };
        let op = at(kind, bytes, Float32, 0);
        assert!(rendezvous_wanted(&op, Device::Gpu, &cfg), "{kind}");
        assert!(rendezvous_wanted(
            &OpShape {
                in_place: true,
                ..op
            },
            Device::Gpu,
            &cfg
        ));
        let named = choose(
            &OpShape {
                symmetric: true,
                ..op
            },
            Device::Gpu,
            &cfg,
        );
        assert!(
            named.engine == Engine::CopyEngine && named.zero_copy,
            "{kind}: {named}"
        );
        // A reduce's non-root "in place" after its root posted: the same choice as its root's.
        let named_in_place = choose(
            &OpShape {
                symmetric: true,
                in_place: true,
                ..op
            },
            Device::Gpu,
            &cfg,
        );
        assert_eq!(
            named_in_place.engine == Engine::CopyEngine,
            kind == CollKind::Reduce,
            "{kind}: {named_in_place}"
        );
        let windowed = OpShape {
            symmetric: true,
            ..op
        };
        assert_eq!(
            rendezvous_wanted(&windowed, Device::Gpu, &cfg),
            kind == CollKind::Reduce,
            "{kind} between symmetric windows: the reduce exchanges, the others need not"
        );
        for (no, why) in [
            (
                at(kind, bytes / 2, Float32, 0),
                "below FERROCCL_GPU_FOLD_MIN_BYTES (a reduce's own)",
            ),
            (at(kind, bytes, Float32, 5), "a PreMulSum"),
            (at(kind, bytes, DataType::Int8, 0), "bytes"),
            (OpShape { nranks: 3, ..op }, "3 ranks"),
        ] {
            assert!(
                !fold_rendezvous_wanted(&no, Device::Gpu, &cfg),
                "{kind}: {why}"
            );
        }
        assert!(!fold_rendezvous_wanted(&op, Device::Host, &cfg));
        let unmapped = Config {
            gpu_ce_map_unregistered: false,
            ..cfg.clone()
        };
        assert!(!fold_rendezvous_wanted(&op, Device::Gpu, &unmapped));
        assert!(rendezvous_wanted(
            &OpShape {
                windows: true,
                ..op
            },
            Device::Gpu,
            &unmapped
        ));
        let no_fold = Config {
            gpu_fold_min_bytes: 0,
            gpu_fold_reduce_min_bytes: 0,
            ..cfg.clone()
        };
        assert!(!fold_rendezvous_wanted(&op, Device::Gpu, &no_fold));
        // Each threshold is its own kinds': zero for the others' changes nothing here.
        let others_off = if kind == CollKind::Reduce {
            Config {
                gpu_fold_min_bytes: 0,
                ..cfg.clone()
            }
        } else {
            Config {
                gpu_fold_reduce_min_bytes: 0,
                ..cfg.clone()
            }
        };
        assert!(rendezvous_wanted(&op, Device::Gpu, &others_off), "{kind}");
    }
    let min = fold_min_bytes(&cfg, CollKind::Reduce);
    // Not a reduce of 3 ranks, nor a broadcast, whatever its size.
    assert!(!fold_rendezvous_wanted(
        &OpShape {
            nranks: 3,
            ..at(CollKind::Reduce, min, Float32, 0)
        },
        Device::Gpu,
        &cfg
    ));
}

/// The backend asks the tuner first as if the communicator had windows and no buffer lay in a
/// symmetric one, and skips the windows' lock where that says no: so that answer must be yes
/// wherever any windows and symmetry would give yes.
#[test]
fn the_rendezvous_is_never_wanted_where_its_most_willing_shape_is_not() {
    let cfg = Config::default();
    for kind in CollKind::ALL {
        for n in [2usize, 3] {
            for shift in [0u32, 10, 20, 25, 26, 27, 28, 30, 31] {
                for (windows, symmetric, in_place) in
                    (0..8).map(|b| (b & 1 != 0, b & 2 != 0, b & 4 != 0))
                {
                    let op = OpShape {
                        windows,
                        symmetric,
                        in_place,
                        ..shape(kind, (1usize << shift) / 4, Float32, n)
                    };
                    let willing = OpShape {
                        windows: true,
                        symmetric: false,
                        ..op
                    };
                    for (f, name) in [
                        (
                            rendezvous_wanted as fn(&OpShape, Device, &Config) -> bool,
                            "collectives",
                        ),
                        (p2p_rendezvous_wanted, "sends and receives"),
                    ] {
                        assert!(
                            !f(&op, Device::Gpu, &cfg) || f(&willing, Device::Gpu, &cfg),
                            "{name}: {op:?}"
                        );
                    }
                }
            }
        }
    }
}

/// Sends and receives take the posted-receive rendezvous from FERROCCL_GPU_CE_P2P_BYTES, on GPUs
/// with windows or outputs mapped on the fly; nothing else does.
#[test]
fn sends_and_receives_post_from_their_threshold() {
    let cfg = Config::default();
    let at = |kind, bytes: usize| OpShape {
        windows: true,
        ..shape(kind, bytes / 4, Float32, 2)
    };
    let min = cfg.gpu_ce_p2p_bytes;
    for kind in [CollKind::Send, CollKind::Recv] {
        assert!(
            p2p_rendezvous_wanted(&at(kind, min), Device::Gpu, &cfg),
            "{kind}"
        );
        assert!(
            !p2p_rendezvous_wanted(&at(kind, min - 4), Device::Gpu, &cfg),
            "{kind}"
        );
        assert!(
            !p2p_rendezvous_wanted(&at(kind, min), Device::Host, &cfg),
            "{kind}"
        );
        let bare = OpShape {
            windows: false,
            ..at(kind, min)
        };
        assert!(p2p_rendezvous_wanted(&bare, Device::Gpu, &cfg), "{kind}");
        let unmapped = Config {
            gpu_ce_map_unregistered: false,
            ..cfg.clone()
        };
        assert!(
            !p2p_rendezvous_wanted(&bare, Device::Gpu, &unmapped),
            "{kind}"
        );
        assert!(p2p_rendezvous_wanted(
            &at(kind, min),
            Device::Gpu,
            &unmapped
        ));
        let off = Config {
            gpu_ce_p2p_bytes: 0,
            ..cfg.clone()
        };
        assert!(!p2p_rendezvous_wanted(
            &at(kind, 1 << 30),
            Device::Gpu,
            &off
        ));
        // The gather's knobs are not the sends'.
        let others = Config {
            gpu_ce_window_bytes: 0,
            gpu_ce_rendezvous_bytes: 0,
            ..cfg.clone()
        };
        assert!(p2p_rendezvous_wanted(&at(kind, min), Device::Gpu, &others));
        assert!(
            !rendezvous_wanted(&at(kind, min), Device::Gpu, &cfg),
            "{kind}: not a collective's"
        );
    }
    for kind in CollKind::COLLECTIVES {
        assert!(
            !p2p_rendezvous_wanted(&at(kind, min), Device::Gpu, &cfg),
            "{kind}"
        );
    }
}

#[test]
fn symmetric_windows_take_the_copy_engine_for_large_data_movement() {
    let cfg = Config::default();
    let at = |kind, bytes: usize, n: usize| {
        let count = bytes
            / 4
            / if matches!(
                kind,
                CollKind::AllGather
                    | CollKind::AllToAll
                    | CollKind::Gather
                    | CollKind::Scatter
                    | CollKind::ReduceScatter
            ) {
                n
            } else {
                1
            };
        OpShape {
            windows: true,
            symmetric: true,
            ..shape(kind, count, Float32, n)
        }
    };
    let window = cfg.gpu_ce_window_bytes;
    for kind in [CollKind::AllGather, CollKind::AllToAll, CollKind::Broadcast] {
        // The broadcast from its own threshold (above the window's), the others from the window's.
        let min = if kind == CollKind::Broadcast {
            cfg.gpu_ce_broadcast_bytes
        } else {
            window
        };
        assert!(min >= window);
        let c = choose(&at(kind, min, 2), Device::Gpu, &cfg);
        assert!(
            c.engine == Engine::CopyEngine && c.zero_copy && c.channels == 0,
            "{kind}: {c}"
        );
        // Below the threshold, without the symmetric contract, on the host, in a group, with the
        // knob at 0: not this.
        assert_ne!(
            choose(&at(kind, min / 2, 2), Device::Gpu, &cfg).engine,
            Engine::CopyEngine,
            "{kind}"
        );
        assert_ne!(
            choose(
                &OpShape {
                    symmetric: false,
                    ..at(kind, min, 2)
                },
                Device::Gpu,
                &cfg
            )
            .engine,
            Engine::CopyEngine,
            "{kind}"
        );
        assert_ne!(
            choose(&at(kind, min, 2), Device::Host, &cfg).engine,
            Engine::CopyEngine,
            "{kind}"
        );
        assert_ne!(
            choose_launch(&[at(kind, min, 2), at(kind, min, 2)], Device::Gpu, &cfg)[0].engine,
            Engine::CopyEngine,
            "{kind}"
        );
        let off = Config {
            gpu_ce_window_bytes: 0,
            ..cfg.clone()
        };
        assert_ne!(
            choose(&at(kind, 1 << 30, 2), Device::Gpu, &off).engine,
            Engine::CopyEngine,
            "{kind}"
        );
    }
    // The broadcast's own knob: at the window's threshold the kernels, unless it comes down to
    // it; 0 keeps the copies off at any size; the two-way kinds do not read it.
    assert!(cfg.gpu_ce_broadcast_bytes > window);
    let bc = at(CollKind::Broadcast, window, 2);
    assert_ne!(choose(&bc, Device::Gpu, &cfg).engine, Engine::CopyEngine);
    let lower = Config {
        gpu_ce_broadcast_bytes: window,
        ..cfg.clone()
    };
    assert_eq!(choose(&bc, Device::Gpu, &lower).engine, Engine::CopyEngine);
    let never = Config {
        gpu_ce_broadcast_bytes: 0,
        ..cfg.clone()
    };
    assert_ne!(
        choose(&at(CollKind::Broadcast, 1 << 30, 2), Device::Gpu, &never).engine,
        Engine::CopyEngine
    );
    assert_eq!(
        choose(&at(CollKind::AllGather, window, 2), Device::Gpu, &never).engine,
        Engine::CopyEngine
    );
    // All-reduce and reduce-scatter on 2 ranks out of place: copies into the peer's output and a
    // fold kernel of FOLD_BLOCKS blocks (fewer where the channels are capped); in place, on 3
    // ranks, below the threshold or without the contract: not.
    let fmin = cfg.gpu_fold_min_bytes;
    for kind in [CollKind::AllReduce, CollKind::ReduceScatter] {
        let c = choose(&at(kind, fmin, 2), Device::Gpu, &cfg);
        assert!(
            c.engine == Engine::CopyEngine && c.zero_copy && c.channels == FOLD_BLOCKS,
            "{kind}: {c}"
        );
        assert_eq!(
            c.chunk_elems * 4,
            crate::plan::copies::FOLD_PIECE_BYTES,
            "{kind}"
        );
        let capped = Config {
            gpu_channels: 4,
            ..cfg.clone()
        };
        assert_eq!(choose(&at(kind, fmin, 2), Device::Gpu, &capped).channels, 4);
        // Sum, Prod, Max and Min of 2-8-byte elements, Avg of 4- and 8-byte ones (fold_pays).
        for redop in 1..=4 {
            let c = choose(
                &OpShape {
                    redop,
                    ..at(kind, fmin, 2)
                },
                Device::Gpu,
                &cfg,
            );
            assert_eq!(c.engine, Engine::CopyEngine, "{kind} redop {redop}");
        }
        for other in [
            // Avg of 2-byte elements (the same bytes: twice the count).
            OpShape {
                redop: 4,
                dtype: Bfloat16,
                count: at(kind, fmin, 2).count * 2,
                ..at(kind, fmin, 2)
            },
            OpShape {
                redop: 5,
                ..at(kind, fmin, 2)
            },
            OpShape {
                dtype: Int8,
                count: at(kind, fmin, 2).count * 4,
                ..at(kind, fmin, 2)
            },
            OpShape {
                in_place: true,
                ..at(kind, 1 << 30, 2)
            },
            at(kind, 1 << 30, 3),
            at(kind, fmin / 2, 2),
            OpShape {
                symmetric: false,
                ..at(kind, 1 << 30, 2)
            },
        ] {
            assert_ne!(
                choose(&other, Device::Gpu, &cfg).engine,
                Engine::CopyEngine,
                "{other:?}"
            );
        }
        let off = Config {
            gpu_fold_min_bytes: 0,
            ..cfg.clone()
        };
        assert_ne!(
            choose(&at(kind, 1 << 31, 2), Device::Gpu, &off).engine,
            Engine::CopyEngine
        );
    }
    // Reduce folds only after a rendezvous (the test of the copy-and-folds, below), and not on 3
    // ranks; broadcast beyond 2 ranks would send n-1 copies from the root; an all-to-all in
    // place has no order that works without staging.
    assert_ne!(
        choose(&at(CollKind::Reduce, 1 << 30, 3), Device::Gpu, &cfg).engine,
        Engine::CopyEngine
    );
    assert_ne!(
        choose(&at(CollKind::Broadcast, 1 << 30, 3), Device::Gpu, &cfg).engine,
        Engine::CopyEngine
    );
    assert_eq!(
        choose(&at(CollKind::AllGather, 1 << 30, 3), Device::Gpu, &cfg).engine,
        Engine::CopyEngine
    );
    assert_ne!(
        choose(
            &OpShape {
                in_place: true,
                ..at(CollKind::AllToAll, 1 << 30, 2)
            },
            Device::Gpu,
            &cfg
        )
        .engine,
        Engine::CopyEngine
    );
    assert_eq!(
        choose(
            &OpShape {
                in_place: true,
                ..at(CollKind::AllGather, 1 << 30, 2)
            },
            Device::Gpu,
            &cfg
        )
        .engine,
        Engine::CopyEngine
    );
}

/// Every choice names an algorithm that can build the operation, and nothing but
/// `post_output` depends on this rank's own buffers.
#[test]
fn every_choice_is_buildable_and_shared() {
    let cfgs = [
        Config::default(),
        Config {
            channels: 4,
            gpu_channels: 3,
            ll_max_bytes: 0,
            direct_max_bytes: 0,
            ..Config::default()
        },
        Config {
            gpu_copy_engine_bytes: 1,
            ..Config::default()
        },
    ];
    for cfg in &cfgs {
        for dev in [Device::Host, Device::Gpu] {
            for &kind in &CollKind::ALL {
                for n in [1, 2, 3, 8] {
                    for count in [0, 1, 100, 4096, 1 << 20, usize::MAX / 64] {
                        for dtype in [Int8, Float32] {
                            let base = shape(kind, count, dtype, n);
                            let c = choose(&base, dev, cfg);
                            assert!(c.algo.supports(kind), "{dev:?} {kind}: {c}");
                            assert!(
                                (c.channels >= 1 || c.engine == Engine::CopyEngine)
                                    && c.chunk_elems >= 1,
                                "{c}"
                            );
                            let (coll, p2p) = channel_budget(dev, cfg, n);
                            // The peer engine's blocks are its own (its staging is cut for them), not FIFO channels.
                            let most = match (kind, c.engine) {
                                (CollKind::Send | CollKind::Recv, _) => p2p,
                                (_, Engine::PeerKernel) => peer_blocks(cfg, n),
                                _ => coll,
                            };
                            assert!(c.channels <= most, "{c}");
                            for (in_place, windows) in [(true, false), (false, true), (true, true)]
                            {
                                let o = choose(
                                    &OpShape {
                                        in_place,
                                        windows,
                                        ..base
                                    },
                                    dev,
                                    cfg,
                                );
                                assert_eq!(
                                    (o.algo, o.protocol, o.channels, o.chunk_elems),
                                    (c.algo, c.protocol, c.channels, c.chunk_elems)
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_reason_is_readable() {
    let c = choose(
        &shape(CollKind::AllReduce, 2, Float32, 2),
        Device::Gpu,
        &Config::default(),
    );
    let s = c.to_string();
    for want in [
        "one-shot",
        "LL",
        "1 channels",
        "FERROCCL_GPU_CHANNEL_BYTES",
        "DirectKernel",
    ] {
        assert!(s.contains(want), "{want} missing from: {s}");
    }
}

/// Elements of an operation's largest buffer per element of its NCCL count on `nranks` ranks
/// (`CollKind::buffer_counts`, a root's): n for the kinds whose buffer holds a block per rank.
fn per_count(kind: CollKind, nranks: usize) -> usize {
    let (send, recv) = kind.buffer_counts(1, nranks, true).expect("no overflow");
    send.max(recv)
}

fn f32_shape(kind: CollKind, count: usize, nranks: usize) -> OpShape {
    shape(kind, count, Float32, nranks)
}

#[test]
fn estimates_grow_with_size_and_ranks_and_match_the_measured_ends() {
    let cfg = Config::default();
    let t = |kind, count, n, d| estimate_launch_us(&[f32_shape(kind, count, n)], d, &cfg);
    // The measured ends on 2 x H200: an 8 B all-reduce in about 4 us, 2 GiB at about 260 GB/s
    // of bus bandwidth (2 ranks: the bus bytes equal the buffer).
    let small = t(CollKind::AllReduce, 2, 2, Device::Gpu);
    assert!((3.0..8.0).contains(&small), "{small}");
    let big = t(CollKind::AllReduce, 512 << 20, 2, Device::Gpu);
    let busbw = (2u64 << 30) as f64 / big / 1e3;
    assert!((200.0..350.0).contains(&busbw), "{busbw} GB/s");
    for kind in [
        CollKind::AllReduce,
        CollKind::AllGather,
        CollKind::ReduceScatter,
        CollKind::AllToAll,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::Gather,
        CollKind::Scatter,
        CollKind::Send,
    ] {
        for d in [Device::Gpu, Device::Host] {
            let mut last = 0.0;
            for count in [1usize, 1 << 10, 1 << 16, 1 << 22, 1 << 26] {
                let e = t(kind, count, 4, d);
                assert!(
                    e.is_finite() && e > last,
                    "{kind:?} {d:?} {count}: {e} after {last}"
                );
                last = e;
            }
            assert!(
                t(kind, 1 << 20, 8, d) >= t(kind, 1 << 20, 2, d),
                "{kind:?} {d:?}: more ranks, more time"
            );
        }
    }
    // A group costs its operations' sum; one rank costs only the launch.
    let one = f32_shape(CollKind::AllReduce, 1 << 20, 4);
    let two = estimate_launch_us(&[one, one], Device::Host, &cfg);
    assert!((two - 2.0 * estimate_launch_us(&[one], Device::Host, &cfg)).abs() < 1e-6);
    assert_eq!(
        t(CollKind::AllReduce, 1 << 20, 1, Device::Host),
        cost(Engine::HostExecutor, Protocol::Simple).launch_us
    );
    // Sizes that overflow are infinitely slow, not a panic.
    assert!(estimate_launch_us(
        &[f32_shape(CollKind::AllGather, usize::MAX / 2, 4)],
        Device::Gpu,
        &cfg
    )
    .is_infinite());
}

/// FERROCCL_GPU_PEER_SPLIT: the peer engine's one-phase rounds on a send block and a receive
/// block a slice (an even grid), never a two-shot all-reduce nor a single block; in and out of
/// place alike (a rank's in-place-ness is its own, and its peers must split as it does: the
/// kernel keeps an in-place receive block behind its send block); by default for the kinds and
/// sizes where it measured faster, never with 0.
#[test]
fn the_peer_engine_splits_one_phase_rounds_only_where_asked_and_safe() {
    use CollKind::*;
    let on = Config {
        gpu_peer_split: Some(true),
        ..Config::default()
    };
    for (kind, n, in_place, split) in [
        (AllGather, 2, false, true),
        (AllGather, 2, true, true),
        (AllToAll, 2, false, true),
        (AllToAll, 2, true, true),
        (AllReduce, 2, false, true),
        (AllReduce, 2, true, true),
        (AllReduce, 3, false, false),
        (ReduceScatter, 3, true, true),
        (Gather, 3, false, true),
        (Broadcast, 2, true, true),
        (Reduce, 2, false, true),
    ] {
        let shape = OpShape {
            in_place,
            ..shape(kind, 1 << 22, Float32, n)
        };
        let c = choose(&shape, Device::Gpu, &on);
        assert_eq!(c.engine, Engine::PeerKernel, "{kind} on {n}: {c}");
        assert_eq!(c.split, split, "{kind} on {n}, in place {in_place}: {c}");
        if split {
            assert!(
                c.channels >= 2
                    && c.channels.is_multiple_of(2)
                    && c.channels <= peer_blocks(&on, n),
                "{c}"
            );
            assert!(c.to_string().contains("FERROCCL_GPU_PEER_SPLIT"), "{c}");
        }
        let off = choose(
            &shape,
            Device::Gpu,
            &Config {
                gpu_peer_split: Some(false),
                ..on.clone()
            },
        );
        assert!(!off.split, "{kind}: {off}");
    }
    // Auto: the kinds it pays for, from PEER_SPLIT_MIN_BYTES.
    let auto = Config::default();
    // Every rank alike: in place or not, the same choice, for every kind and size, by default
    // and asked for (an all-to-all that splits by default: an in-place rank once kept its
    // rounds whole while its out-of-place peer split them).
    for cfg in [&auto, &on] {
        for n in [2, 3] {
            for kind in CollKind::ALL.into_iter().filter(|k| k.is_collective()) {
                for shift in 10..=30 {
                    let at = |in_place| {
                        let b = 4usize << shift;
                        let s = OpShape {
                            in_place,
                            ..shape(kind, b / 4 / per_count(kind, n), Float32, n)
                        };
                        choose(&s, Device::Gpu, cfg)
                    };
                    let (oop, ip) = (at(false), at(true));
                    if oop.engine == Engine::PeerKernel && ip.engine == Engine::PeerKernel {
                        assert_eq!(
                            oop.split, ip.split,
                            "{kind} on {n} at 4 << {shift}: {oop} / {ip}"
                        );
                        assert_eq!(oop.channels, ip.channels, "{kind} on {n} at 4 << {shift}");
                    }
                }
            }
        }
    }
    for (kind, split, from) in [
        (AllGather, true, PEER_SPLIT_MIN_BYTES),
        (AllToAll, true, PEER_SPLIT_A2A_MIN_BYTES),
        (ReduceScatter, true, PEER_SPLIT_MIN_BYTES),
        (Scatter, true, PEER_SPLIT_MIN_BYTES),
        (Gather, false, PEER_SPLIT_MIN_BYTES),
        (Broadcast, false, PEER_SPLIT_MIN_BYTES),
        (Reduce, false, PEER_SPLIT_MIN_BYTES),
        (AllReduce, false, PEER_SPLIT_MIN_BYTES),
    ] {
        let per_rank = per_count(kind, 2);
        let big = shape(kind, from / 4 / per_rank, Float32, 2);
        assert_eq!(big.largest_bytes(), Some(from), "{kind}");
        assert_eq!(choose(&big, Device::Gpu, &auto).split, split, "{kind}");
        assert!(
            !choose(
                &OpShape {
                    count: big.count / 2,
                    ..big
                },
                Device::Gpu,
                &auto
            )
            .split,
            "{kind}: below the size"
        );
    }
    // The rooted kinds from 256 KiB to 2 MiB: split at both ends, not just outside; the others
    // not there.
    for kind in [
        AllGather,
        AllToAll,
        ReduceScatter,
        Scatter,
        Gather,
        Broadcast,
        Reduce,
        AllReduce,
    ] {
        let per_rank = per_count(kind, 2);
        let rooted = matches!(kind, Gather | Scatter | Broadcast | Reduce);
        let at = |b: usize| {
            choose(
                &shape(kind, b / 4 / per_rank, Float32, 2),
                Device::Gpu,
                &auto,
            )
        };
        for b in [
            *PEER_SPLIT_ROOTED_BYTES.start(),
            *PEER_SPLIT_ROOTED_BYTES.end(),
        ] {
            // (Gather and scatter of 256 KiB send 128 KiB: the direct engine's; the reductions
            // within FERROCCL_GPU_PEER_LINES_MAX_BYTES take line rounds, never split.)
            let c = at(b);
            let lines = matches!(kind, AllReduce | ReduceScatter)
                && c.engine == Engine::PeerKernel
                && b <= PEER_LINES_MAX_BYTES
                || kind == Reduce
                    && (PEER_LINES_REDUCE_MIN_BYTES..=PEER_LINES_MAX_BYTES).contains(&b);
            assert_eq!(c.protocol == Protocol::LL128, lines, "{kind} at {b}: {c}");
            assert_eq!(
                c.split,
                rooted && c.engine == Engine::PeerKernel && !lines,
                "{kind} at {b}"
            );
        }
        assert_eq!(at(*PEER_SPLIT_ROOTED_BYTES.end()).split, rooted, "{kind}");
        // Measured on 2 ranks only: not split on 3.
        let three = choose(&shape(kind, (1 << 20) / 4, Float32, 3), Device::Gpu, &auto);
        assert!(!three.split, "{kind} on 3 ranks: {three}");
        assert!(!at(*PEER_SPLIT_ROOTED_BYTES.end() * 2).split, "{kind}");
        assert!(!at(*PEER_SPLIT_ROOTED_BYTES.start() / 2).split, "{kind}");
    }
    // In place like out of place (64 MiB of all-to-all: 16 MiB a block).
    assert!(
        choose(
            &OpShape {
                in_place: true,
                ..shape(AllToAll, 1 << 24, Float32, 2)
            },
            Device::Gpu,
            &auto
        )
        .split
    );
    // Odd grids round down; one block stays whole.
    let odd = Config {
        gpu_peer_blocks: 7,
        ..on.clone()
    };
    assert_eq!(
        choose(&shape(AllGather, 1 << 22, Float32, 2), Device::Gpu, &odd).channels,
        6
    );
    let one = Config {
        gpu_peer_blocks: 1,
        ..on
    };
    let c = choose(&shape(AllGather, 1 << 22, Float32, 2), Device::Gpu, &one);
    assert_eq!((c.channels, c.split), (1, false));
}

/// FERROCCL_GPU_PEER_DIRECT: the peer engine's direct rounds for the kinds that only move data
/// (senders store straight into posted outputs), never for a reduction; receivers post except
/// in an in-place all-to-all (a peer's block could land on input not yet sent); off with 0.
#[test]
fn the_peer_engine_goes_direct_only_where_data_only_moves() {
    use CollKind::*;
    let cfg = Config::default();
    for (kind, in_place, direct, post) in [
        (AllGather, false, true, true),
        (AllGather, true, true, true),
        (AllToAll, false, true, true),
        (AllToAll, true, true, false),
        (Broadcast, true, true, true),
        (Gather, false, true, true),
        (Scatter, true, true, true),
        (ReduceScatter, false, false, false),
        (Reduce, false, false, false),
        (AllReduce, false, false, false),
    ] {
        let s = OpShape {
            in_place,
            ..shape(kind, 1 << 24, Float32, 2)
        };
        let c = choose(&s, Device::Gpu, &cfg);
        assert_eq!(c.engine, Engine::PeerKernel, "{kind}: {c}");
        assert_eq!(
            (c.zero_copy, c.post_output),
            (direct, post),
            "{kind}, in place {in_place}: {c}"
        );
        assert_eq!(moves_only(kind), direct, "{kind}");
        let off = choose(
            &s,
            Device::Gpu,
            &Config {
                gpu_peer_direct: false,
                ..cfg.clone()
            },
        );
        assert!(!off.zero_copy && !off.post_output, "{kind}: {off}");
        assert_eq!(
            (off.engine, off.channels, off.chunk_elems, off.split),
            (c.engine, c.channels, c.chunk_elems, c.split),
            "only the direct rounds change"
        );
        // Below PEER_DIRECT_MIN_BYTES (largest buffer): staged.
        let per_rank = per_count(kind, 2);
        let small = OpShape {
            in_place,
            ..shape(kind, PEER_DIRECT_MIN_BYTES / 4 / per_rank - 1, Float32, 2)
        };
        let c = choose(&small, Device::Gpu, &cfg);
        assert_eq!(c.engine, Engine::PeerKernel, "{kind}: {c}");
        assert!(!c.zero_copy && !c.post_output, "{kind} below the size: {c}");
        let at = OpShape {
            in_place,
            ..shape(kind, PEER_DIRECT_MIN_BYTES / 4 / per_rank, Float32, 2)
        };
        // Read rounds, where they are the default (a broadcast of 32 MiB), have no direct ones.
        let c = choose(&at, Device::Gpu, &cfg);
        assert_eq!(c.zero_copy, direct && !c.read, "{kind} at the size: {c}");
        let unread = Config {
            gpu_peer_read: Some(false),
            ..cfg.clone()
        };
        assert_eq!(
            choose(&at, Device::Gpu, &unread).zero_copy,
            direct,
            "{kind} at the size"
        );
    }
}

/// FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES: between symmetric windows (every receiver posts) the
/// senders of the kinds that only move data wait for the posts at the start and go direct from
/// the first round, from the size asked, below PEER_DIRECT_MIN_BYTES too; never for a
/// reduction, read rounds, an in-place all-to-all (which posts nothing), buffers outside
/// symmetric windows, or with 0 or direct rounds off.
#[test]
fn senders_wait_for_posts_only_between_symmetric_windows_from_the_size_asked() {
    use CollKind::*;
    let from = 4 << 20;
    let cfg = Config {
        gpu_peer_wait_posts_min_bytes: from,
        gpu_peer_read: Some(false),
        ..Config::default()
    };
    // 8 MiB largest buffer: below PEER_DIRECT_MIN_BYTES and the copy engines' window sizes.
    let sized = |kind: CollKind, b: usize, in_place: bool, symmetric: bool| {
        let s = OpShape {
            in_place,
            symmetric,
            windows: symmetric,
            ..shape(kind, b / 4 / per_count(kind, 2), Float32, 2)
        };
        assert_eq!(s.largest_bytes(), Some(b), "{kind}");
        s
    };
    const _: () = assert!(8 << 20 < PEER_DIRECT_MIN_BYTES);
    let mut waited = 0;
    for kind in CollKind::ALL.into_iter().filter(|k| k.is_collective()) {
        for in_place in [false, true] {
            let c = choose(&sized(kind, 8 << 20, in_place, true), Device::Gpu, &cfg);
            if c.engine != Engine::PeerKernel {
                continue;
            }
            waited += c.wait_posts as usize;
            let want = moves_only(kind) && !(kind == AllToAll && in_place);
            assert_eq!(c.wait_posts, want, "{kind}, in place {in_place}: {c}");
            // Waiting means direct rounds, and this rank posts.
            assert!(!c.wait_posts || (c.zero_copy && c.post_output), "{c}");
            // Outside symmetric windows (a receiver may post nothing), below the size, with 0 or
            // with direct rounds off: no wait, and staged below PEER_DIRECT_MIN_BYTES.
            for (s, cfg) in [
                (sized(kind, 8 << 20, in_place, false), cfg.clone()),
                (sized(kind, 2 << 20, in_place, true), cfg.clone()),
                (
                    sized(kind, 8 << 20, in_place, true),
                    Config {
                        gpu_peer_wait_posts_min_bytes: 0,
                        ..cfg.clone()
                    },
                ),
                (
                    sized(kind, 8 << 20, in_place, true),
                    Config {
                        gpu_peer_direct: false,
                        ..cfg.clone()
                    },
                ),
            ] {
                let c = choose(&s, Device::Gpu, &cfg);
                assert!(!c.wait_posts && !c.zero_copy, "{kind}: {c}");
            }
        }
    }
    // All-gather, broadcast, gather and scatter in and out of place, the all-to-all out of it.
    assert_eq!(waited, 9);
    // By default from PEER_WAIT_POSTS_MIN_BYTES (the all-gather, with read rounds as they are).
    let auto = Config::default();
    assert_eq!(
        auto.gpu_peer_wait_posts_min_bytes,
        PEER_WAIT_POSTS_MIN_BYTES
    );
    let ag = |b| choose(&sized(AllGather, b, false, true), Device::Gpu, &auto);
    assert!(
        ag(PEER_WAIT_POSTS_MIN_BYTES).wait_posts,
        "{}",
        ag(PEER_WAIT_POSTS_MIN_BYTES)
    );
    assert!(!ag(PEER_WAIT_POSTS_MIN_BYTES / 2).wait_posts);
    // Read rounds win where they are the default (a broadcast of 16 MiB).
    let bcast = sized(Broadcast, 16 << 20, false, true);
    let auto_read = Config {
        gpu_peer_read: None,
        ..cfg.clone()
    };
    let c = choose(&bcast, Device::Gpu, &auto_read);
    if c.engine == Engine::PeerKernel {
        assert!(c.read && !c.wait_posts, "{c}");
    }
}

/// FERROCCL_GPU_PEER_ROUND_BYTES: smaller rounds for the peer engine's one-phase operations (not
/// the two-shot all-reduce), never more than two slots nor fewer than 64 elements.
#[test]
fn peer_round_bytes_cut_one_phase_rounds() {
    // Staged rounds (line rounds fill their parity whatever the knob: below).
    let cfg = Config {
        gpu_peer_lines_max_bytes: 0,
        ..Config::default()
    };
    let slot = peer_slot_bytes(&cfg, 2);
    let lines = choose(
        &shape(CollKind::AllReduce, (1 << 20) / 4, Float32, 2),
        Device::Gpu,
        &Config {
            gpu_peer_round_bytes: 16 << 10,
            gpu_peer_lines_max_bytes: 1 << 20,
            ..Config::default()
        },
    );
    assert_eq!(
        (lines.protocol, lines.chunk_elems),
        (Protocol::LL128, peer_line_round_elems(slot, 4))
    );
    let small = Config {
        gpu_peer_round_bytes: 16 << 10,
        ..cfg.clone()
    };
    for kind in [CollKind::AllReduce, CollKind::Reduce, CollKind::AllGather] {
        let op = shape(kind, (4 << 20) / 4, Float32, 2);
        let d = choose(&op, Device::Gpu, &cfg);
        let c = choose(&op, Device::Gpu, &small);
        assert_eq!(
            (d.engine, c.engine),
            (Engine::PeerKernel, Engine::PeerKernel),
            "{kind}"
        );
        assert_eq!(d.chunk_elems * 4, 2 * slot, "{kind}");
        assert_eq!(c.chunk_elems * 4, 16 << 10, "{kind}");
    }
    let tiny = Config {
        gpu_peer_round_bytes: 8,
        ..cfg.clone()
    };
    let huge = Config {
        gpu_peer_round_bytes: 1 << 40,
        ..cfg.clone()
    };
    let op = shape(CollKind::Reduce, (4 << 20) / 4, Float32, 2);
    assert_eq!(choose(&op, Device::Gpu, &tiny).chunk_elems, 64);
    assert_eq!(choose(&op, Device::Gpu, &huge).chunk_elems * 4, 2 * slot);
    // The two-shot all-reduce (3 ranks) keeps its round of a slot per peer.
    let three = shape(CollKind::AllReduce, (4 << 20) / 4, Float32, 3);
    assert_eq!(
        choose(&three, Device::Gpu, &small).chunk_elems,
        choose(&three, Device::Gpu, &cfg).chunk_elems
    );
}

/// The copy-and-fold's reductions: Sum, Prod, Max, Min of the 2-, 4- and 8-byte types, Avg of the
/// 4- and 8-byte ones; with `FERROCCL_GPU_FOLD_EVERY_TYPE` every type and reduction; never
/// PreMulSum (5), whose scalar may differ by rank.
#[test]
fn fold_pays_for_plain_reductions_of_wide_elements() {
    use crate::types::DataType;
    let every = Config {
        gpu_fold_every_type: true,
        ..Config::default()
    };
    for t in DataType::ALL {
        let wide = !matches!(
            t,
            DataType::Int8 | DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2
        );
        for redop in 0..=5 {
            let avg_wide = redop == 4 && t.size() >= 4;
            assert_eq!(
                fold_pays(t, redop, &Config::default()),
                wide && redop <= 3 || avg_wide,
                "{t:?} {redop}"
            );
            assert_eq!(fold_pays(t, redop, &every), redop <= 4, "{t:?} {redop}");
        }
    }
    // And the tuner follows it: an int8 all-reduce of 1 GiB between symmetric windows folds
    // only with the knob.
    let op = OpShape {
        windows: true,
        symmetric: true,
        ..shape(CollKind::AllReduce, 1 << 30, DataType::Int8, 2)
    };
    assert_ne!(
        choose(&op, Device::Gpu, &Config::default()).engine,
        Engine::CopyEngine
    );
    assert_eq!(choose(&op, Device::Gpu, &every).engine, Engine::CopyEngine);
}

/// A float32 all-reduce of `bytes` on 2 ranks between symmetric windows, out of place.
fn symmetric_all_reduce(bytes: usize) -> OpShape {
    OpShape {
        windows: true,
        symmetric: true,
        ..shape(CollKind::AllReduce, bytes / 4, Float32, 2)
    }
}

/// Asserts that `op` pulls under `cfg` as every pull runs: the tuner says so, and its choice is the
/// peer engine in one round a block (no slots to fill) on at most `gpu_peer_pull_blocks` blocks,
/// never split, read, waiting for posts or posting, on the simple protocol, its reason naming it.
fn assert_pulls(op: &OpShape, cfg: &Config) {
    assert!(peer_pulls(op, op.largest_bytes(), cfg), "{op:?}");
    let bytes = op.largest_bytes().unwrap();
    let c = choose(op, Device::Gpu, cfg);
    assert!(
        c.engine == Engine::PeerKernel
            && c.algo == Algo::OneShot
            && c.zero_copy
            && !c.post_output
            && !c.split
            && !c.read
            && !c.wait_posts
            && c.protocol == Protocol::Simple
            && c.chunk_elems == op.count
            && c.channels == cfg.gpu_peer_pull_blocks.min(bytes / PEER_BLOCK_BYTES),
        "{op:?}: {c}"
    );
    assert!(c.why.algo.contains("pulls"), "{c}");
}

/// Asserts that `op` does not pull under `cfg`: not by the tuner's word, and its choice is no
/// reduction's zero-copy on the peer engine.
fn assert_no_pull(op: &OpShape, cfg: &Config) {
    assert!(!peer_pulls(op, op.largest_bytes(), cfg), "{op:?}");
    let c = choose(op, Device::Gpu, cfg);
    assert!(
        !(c.engine == Engine::PeerKernel && c.zero_copy && op.kind.reduces()),
        "{op:?}: {c}"
    );
}

/// What no pull takes, around `at` (a pulling shape by its bytes, 4 MiB within the range the
/// tests' configurations give, 1 MiB - 64 MiB): a PreMulSum, 128 MiB and 512 KiB (out of range), a
/// reduce-scatter of the same bytes, 3 ranks.
fn pull_refusals(at: impl Fn(usize) -> OpShape) -> Vec<OpShape> {
    let base = at(4 << 20);
    vec![
        OpShape { redop: 5, ..base },
        at(128 << 20),
        at(512 << 10),
        OpShape {
            kind: CollKind::ReduceScatter,
            count: (4 << 20) / 8,
            ..base
        },
        OpShape { nranks: 3, ..base },
    ]
}

/// The pulling all-reduce (FERROCCL_GPU_PEER_PULL_MAX_BYTES): 2 ranks, symmetric windows, out of
/// place, Sum to Avg, within the limit, on the peer engine in one round a block (no slots to
/// fill) on at most PEER_PULL_BLOCKS blocks, never split and posting nothing; everything else as
/// without it.
#[test]
fn pulls_take_symmetric_out_of_place_all_reduces_of_two_ranks_within_the_limit() {
    let cfg = Config {
        gpu_peer_pull_min_bytes: 1 << 20,
        gpu_peer_pull_max_bytes: 64 << 20,
        gpu_peer_split: Some(true),
        ..Config::default()
    };
    let at = symmetric_all_reduce;
    for bytes in [1 << 20, 4 << 20, 64 << 20] {
        for redop in 0..=4 {
            assert_pulls(&OpShape { redop, ..at(bytes) }, &cfg);
        }
    }
    let off = Config {
        gpu_peer_pull_max_bytes: 0,
        ..cfg.clone()
    };
    let own = [
        OpShape {
            in_place: true,
            ..at(4 << 20)
        },
        OpShape {
            symmetric: false,
            ..at(4 << 20)
        },
    ];
    for op in pull_refusals(at).into_iter().chain(own) {
        assert_no_pull(&op, &cfg);
    }
    assert_no_pull(&at(4 << 20), &off);
    // The host backend never pulls.
    assert!(!choose(&at(4 << 20), Device::Host, &cfg).zero_copy);
}

/// The pulls' default range: from 16 MiB (measured) to the copy-and-fold's threshold (512 MiB),
/// the copy-and-fold from there.
#[test]
fn pulls_by_default_from_16_mib_to_the_fold() {
    let cfg = Config::default();
    let at = symmetric_all_reduce;
    let pulls = |bytes: usize| {
        let c = choose(&at(bytes), Device::Gpu, &cfg);
        c.engine == Engine::PeerKernel && c.zero_copy
    };
    assert!(!pulls(8 << 20));
    assert!(pulls(16 << 20) && pulls(64 << 20) && pulls(256 << 20));
    for b in [cfg.gpu_fold_min_bytes, 1 << 30] {
        assert!(!pulls(b), "{b} takes the copy-and-fold");
        assert_eq!(choose(&at(b), Device::Gpu, &cfg).engine, Engine::CopyEngine);
    }
}

/// A float32 reduce of `bytes` on 2 ranks whose inputs lie in symmetric windows (the root's
/// output posted by nobody: no rendezvous).
fn pullable_reduce(bytes: usize) -> OpShape {
    OpShape {
        windows: true,
        inputs_symmetric: true,
        ..shape(CollKind::Reduce, bytes / 4, Float32, 2)
    }
}

/// The pulling reduce (FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES to _PULL_MAX_BYTES): 2 ranks whose
/// inputs lie in symmetric windows, Sum to Avg, in place or not (each rank's own, which its peer
/// cannot see, must not decide), on the peer engine as the all-reduce's pull: one round a block,
/// at most PEER_PULL_BLOCKS blocks, never split, read or direct, posting nothing. By default from
/// 64 MiB (measured) with no upper bound; its own floor's 0 turns it off, and the all-reduce's
/// floor and maximum do not bind it.
#[test]
fn pulls_take_reduces_of_two_ranks_whose_inputs_lie_in_symmetric_windows() {
    let cfg = Config {
        gpu_peer_pull_reduce_min_bytes: 1 << 20,
        gpu_peer_pull_min_bytes: 256 << 20,
        gpu_peer_pull_max_bytes: 64 << 20,
        gpu_peer_split: Some(true),
        gpu_peer_read: Some(true),
        ..Config::default()
    };
    let at = pullable_reduce;
    for bytes in [1 << 20, 4 << 20, 64 << 20] {
        for redop in 0..=4 {
            for in_place in [false, true] {
                let op = OpShape {
                    redop,
                    in_place,
                    ..at(bytes)
                };
                assert_pulls(&op, &cfg);
                assert!(choose(&op, Device::Gpu, &cfg).why.algo.contains("reduce"));
            }
        }
    }
    let off = Config {
        gpu_peer_pull_reduce_min_bytes: 0,
        ..cfg.clone()
    };
    let own = [
        OpShape {
            inputs_symmetric: false,
            symmetric: true,
            ..at(4 << 20)
        },
        OpShape {
            kind: CollKind::Gather,
            count: (4 << 20) / 8,
            ..at(4 << 20)
        },
    ];
    // The all-reduce's refusals but its maximum, which the reduce does not read.
    let beyond = at(128 << 20);
    for op in pull_refusals(at)
        .into_iter()
        .filter(|op| *op != beyond)
        .chain(own)
    {
        assert_no_pull(&op, &cfg);
    }
    assert_no_pull(&at(4 << 20), &off);
    assert!(beyond.largest_bytes().unwrap() > cfg.gpu_peer_pull_max_bytes);
    assert_pulls(&beyond, &cfg);
    assert_pulls(&at(1 << 30), &Config::default());
    // FERROCCL_GPU_PEER_PULL_BLOCKS: more blocks, up to the staging's cut; fewer.
    for (want, cap) in [(64, 64), (64, 128), (8, 8)] {
        let c = choose(
            &at(64 << 20),
            Device::Gpu,
            &Config {
                gpu_peer_pull_blocks: cap,
                ..cfg.clone()
            },
        );
        assert!(c.zero_copy && c.channels == want, "{cap}: {c}");
    }
    // Inputs in windows say nothing to the all-reduce's pull: its own `symmetric` does.
    let all_reduce = OpShape {
        kind: CollKind::AllReduce,
        ..at(4 << 20)
    };
    let pulled_all_reduces = Config {
        gpu_peer_pull_min_bytes: 1 << 20,
        ..cfg.clone()
    };
    assert!(!peer_pulls(
        &all_reduce,
        all_reduce.largest_bytes(),
        &pulled_all_reduces
    ));
    // By default from 64 MiB, up to the copy-and-fold after a rendezvous.
    let def = Config::default();
    let pulls = |bytes: usize| {
        let c = choose(&at(bytes), Device::Gpu, &def);
        c.engine == Engine::PeerKernel && c.zero_copy
    };
    assert!(!pulls(32 << 20));
    assert!(pulls(64 << 20) && pulls(128 << 20) && pulls(256 << 20));
    let posted = OpShape {
        symmetric: true,
        ..at(def.gpu_fold_reduce_min_bytes)
    };
    assert_eq!(
        choose(&posted, Device::Gpu, &def).engine,
        Engine::CopyEngine
    );
    // The host backend never pulls.
    assert!(!choose(&at(64 << 20), Device::Host, &def).zero_copy);
}

/// The reduce's pull on inputs in no symmetric window (`pull_rendezvous_wanted`): a reduce of 2
/// ranks on GPUs from the pull's floor exchanges, with windows or with inputs lent on the fly,
/// alone below the copy-and-fold's floor and beside the fold's outputs from it; in place or not
/// alike (a rank's own), never for a PreMulSum, 3 ranks, the host, inputs already in symmetric
/// windows (no exchange needed), nor without a way to post. After the exchange the launch is
/// planned with `inputs_symmetric` and pulls.
#[test]
fn reduces_whose_inputs_lie_in_no_symmetric_window_exchange_for_the_pull() {
    let cfg = Config::default();
    let at = |bytes: usize| shape(CollKind::Reduce, bytes / 4, Float32, 2);
    let wanted = |op: &OpShape, cfg: &Config| {
        let pull = pull_rendezvous_wanted(op, Device::Gpu, cfg);
        // Every pull's rendezvous is a rendezvous.
        assert!(!pull || rendezvous_wanted(op, Device::Gpu, cfg), "{op:?}");
        pull
    };
    let floor = cfg.gpu_peer_pull_reduce_min_bytes;
    let fold = cfg.gpu_fold_reduce_min_bytes;
    assert!(floor > 0 && fold > floor);
    for bytes in [floor, 2 * floor, fold - 4] {
        for redop in 0..=4 {
            for in_place in [false, true] {
                for windows in [false, true] {
                    let op = OpShape {
                        redop,
                        in_place,
                        windows,
                        ..at(bytes)
                    };
                    assert!(wanted(&op, &cfg), "{op:?}");
                    let named = OpShape {
                        inputs_symmetric: true,
                        ..op
                    };
                    assert_pulls(&named, &cfg);
                }
            }
        }
    }
    // Below the pull: no rendezvous. Below the fold the pull's alone; from the fold on, the
    // outputs' too (an out-of-place root's output for the fold, the non-root's input for the
    // pull of a root in place), to any size: the all-reduce's maximum does not bind the reduce.
    assert!(!wanted(&at(floor / 2), &cfg));
    assert!(!rendezvous_wanted(&at(floor / 2), Device::Gpu, &cfg));
    assert!(!outputs_rendezvous_wanted(&at(fold - 4), Device::Gpu, &cfg));
    for bytes in [fold, 2 * cfg.gpu_peer_pull_max_bytes, 2 << 30] {
        assert!(wanted(&at(bytes), &cfg), "{bytes}");
        assert!(
            outputs_rendezvous_wanted(&at(bytes), Device::Gpu, &cfg),
            "{bytes}"
        );
    }
    // A reduction the fold does not pay for (bytes): the pull's alone.
    let bytes8 = OpShape {
        dtype: Int8,
        count: fold,
        ..at(fold)
    };
    assert!(wanted(&bytes8, &cfg) && !outputs_rendezvous_wanted(&bytes8, Device::Gpu, &cfg));
    let refused = [
        OpShape {
            redop: 5,
            ..at(floor)
        },
        OpShape {
            nranks: 3,
            count: floor / 12,
            ..at(floor)
        },
        OpShape {
            inputs_symmetric: true,
            windows: true,
            ..at(floor)
        },
        OpShape {
            kind: CollKind::AllReduce,
            ..at(floor)
        },
    ];
    for op in &refused {
        assert!(!wanted(op, &cfg), "{op:?}");
    }
    assert!(!pull_rendezvous_wanted(&at(floor), Device::Host, &cfg));
    // Nowhere to post: no windows, and nothing lent on the fly.
    let unmapped = Config {
        gpu_ce_map_unregistered: false,
        ..cfg.clone()
    };
    assert!(!wanted(&at(floor), &unmapped));
    assert!(wanted(
        &OpShape {
            windows: true,
            ..at(floor)
        },
        &unmapped
    ));
    // The pull's floor at 0: never.
    let off = Config {
        gpu_peer_pull_reduce_min_bytes: 0,
        ..cfg.clone()
    };
    assert!(!wanted(&at(floor), &off));
}

/// Line rounds (FERROCCL_GPU_PEER_LINES_MAX_BYTES): the peer engine's one-shot all-reduce, its
/// reduce-scatter and its reduce on 2 ranks up to the limit, whatever the buffers (plain or
/// windows, in place or not) and the reduction, in rounds of a parity's two slots filled with
/// lines, never split (a forced split included); pulls keep their range, and the limit's 0, 3
/// ranks or a kind that folds nothing give the staged rounds.
#[test]
fn lines_take_the_peer_engines_reductions_of_two_ranks_within_the_limit() {
    let cfg = Config {
        gpu_peer_lines_max_bytes: 8 << 20,
        gpu_peer_split: Some(true),
        ..Config::default()
    };
    let slot = peer_slot_bytes(&cfg, 2);
    for bytes in [512 << 10, 1 << 20, (8 << 20) - 4] {
        for (dtype, es) in [
            (Float32, 4),
            (Bfloat16, 2),
            (Int8, 1),
            (DataType::Float64, 8),
        ] {
            for redop in 0..=5 {
                for (in_place, windows, kind) in [
                    (false, false, CollKind::AllReduce),
                    (true, false, CollKind::AllReduce),
                    (true, true, CollKind::AllReduce),
                    (false, false, CollKind::ReduceScatter),
                    (true, true, CollKind::ReduceScatter),
                    (false, true, CollKind::Reduce),
                    (true, false, CollKind::Reduce),
                ] {
                    // The largest buffer `bytes` (a reduce-scatter's input: two shares).
                    let count = if kind == CollKind::ReduceScatter {
                        bytes / es / 2
                    } else {
                        bytes / es
                    };
                    let op = OpShape {
                        redop,
                        in_place,
                        windows,
                        symmetric: windows,
                        ..shape(kind, count, dtype, 2)
                    };
                    assert!(peer_lines(&op, op.largest_bytes(), &cfg), "{op:?}");
                    let c = choose(&op, Device::Gpu, &cfg);
                    assert!(
                        c.engine == Engine::PeerKernel
                            && c.algo == Algo::OneShot
                            && c.protocol == Protocol::LL128
                            && !c.split
                            && !c.zero_copy
                            && c.chunk_elems == peer_line_round_elems(slot, es),
                        "{op:?}: {c}"
                    );
                    assert!(c.why.protocol.contains("lines"), "{c}");
                }
            }
        }
    }
    // A round's lines fill the parity's two slots: 15/16 of them data, whole 16-byte words.
    assert_eq!(peer_line_round_elems(64 << 10, 4), 30720);
    assert_eq!(peer_line_round_elems(64 << 10, 1) * 16 / 15, 2 * (64 << 10));
    for es in [1, 2, 4, 8] {
        assert_eq!(peer_line_round_elems(slot, es) * es % 16, 0);
    }
    let off = Config {
        gpu_peer_lines_max_bytes: 0,
        ..cfg.clone()
    };
    let at = |bytes: usize| shape(CollKind::AllReduce, bytes / 4, Float32, 2);
    for (op, cfg) in [
        (at(1 << 20), &off),
        (at(16 << 20), &cfg),
        (
            OpShape {
                nranks: 3,
                ..at(1 << 20)
            },
            &cfg,
        ),
        (
            OpShape {
                kind: CollKind::ReduceScatter,
                count: (1 << 20) / 8,
                ..at(1 << 20)
            },
            &off,
        ),
        (
            OpShape {
                kind: CollKind::ReduceScatter,
                count: (16 << 20) / 8,
                ..at(1 << 20)
            },
            &cfg,
        ),
        (
            OpShape {
                kind: CollKind::AllGather,
                ..at(1 << 20)
            },
            &cfg,
        ),
        (
            OpShape {
                kind: CollKind::Reduce,
                ..at(PEER_LINES_REDUCE_MIN_BYTES / 2)
            },
            &cfg,
        ),
        (
            OpShape {
                kind: CollKind::Broadcast,
                ..at(1 << 20)
            },
            &cfg,
        ),
    ] {
        let c = choose(&op, Device::Gpu, cfg);
        assert!(c.protocol != Protocol::LL128, "{op:?}: {c}");
    }
    // A pull keeps its range (within the lines' limit here, so the pull comes first).
    let pulled = Config {
        gpu_peer_pull_min_bytes: 1 << 20,
        ..cfg.clone()
    };
    let c = choose(&symmetric_all_reduce(4 << 20), Device::Gpu, &pulled);
    assert!(c.zero_copy && c.protocol == Protocol::Simple, "{c}");
    // Below the peer engine the direct engine keeps its LL; the host never takes lines.
    assert_eq!(
        choose(&at(64 << 10), Device::Gpu, &cfg).engine,
        Engine::DirectKernel
    );
    assert_ne!(
        choose(&at(1 << 20), Device::Host, &cfg).protocol,
        Protocol::LL128
    );
}

/// Lines take the peer engine's 2-rank all-reduces to 1 MiB by default (where they measured
/// faster), from where the peer engine takes over; 0 turns them off.
#[test]
fn lines_take_the_peer_engines_sizes_to_1_mib_by_default_and_0_turns_them_off() {
    let lines = |bytes: usize, cfg: &Config| {
        choose(
            &shape(CollKind::AllReduce, bytes / 4, Float32, 2),
            Device::Gpu,
            cfg,
        )
        .protocol
            == Protocol::LL128
    };
    let default = Config::default();
    assert_eq!(default.gpu_peer_lines_max_bytes, 1 << 20);
    assert!(lines(256 << 10, &default) && lines(1 << 20, &default));
    assert!(!lines(2 << 20, &default) && !lines(8 << 20, &default) && !lines(64 << 10, &default));
    let off = Config {
        gpu_peer_lines_max_bytes: 0,
        ..Config::default()
    };
    assert!([64 << 10, 256 << 10, 1 << 20, 8 << 20]
        .iter()
        .all(|&b| !lines(b, &off)));
}

/// A broadcast on buffers nobody registered exchanges its outputs' places from its own
/// threshold (FERROCCL_GPU_CE_BROADCAST_BYTES), not from the all-gather's: one direction, whose
/// kernels hold out longer.
#[test]
fn a_broadcast_exchanges_outputs_from_its_own_threshold() {
    let cfg = Config::default();
    let bare = |kind, bytes: usize| OpShape {
        windows: false,
        symmetric: false,
        ..shape(
            kind,
            bytes / 4 / if kind == CollKind::AllGather { 2 } else { 1 },
            Float32,
            2,
        )
    };
    let (rv, own) = (cfg.gpu_ce_rendezvous_bytes, cfg.gpu_ce_broadcast_bytes);
    assert!(own > rv);
    assert!(rendezvous_wanted(
        &bare(CollKind::AllGather, rv),
        Device::Gpu,
        &cfg
    ));
    assert!(!rendezvous_wanted(
        &bare(CollKind::Broadcast, rv),
        Device::Gpu,
        &cfg
    ));
    assert!(!rendezvous_wanted(
        &bare(CollKind::Broadcast, own / 2),
        Device::Gpu,
        &cfg
    ));
    assert!(rendezvous_wanted(
        &bare(CollKind::Broadcast, own),
        Device::Gpu,
        &cfg
    ));
    let never = Config {
        gpu_ce_broadcast_bytes: 0,
        ..cfg.clone()
    };
    assert!(!rendezvous_wanted(
        &bare(CollKind::Broadcast, 1 << 30),
        Device::Gpu,
        &never
    ));
    // Once exchanged (`symmetric`), the copies take it at its threshold.
    let posted = OpShape {
        symmetric: true,
        ..bare(CollKind::Broadcast, own)
    };
    assert_eq!(
        choose(&posted, Device::Gpu, &cfg).engine,
        Engine::CopyEngine
    );
}

/// FERROCCL_GPU_PEER_READ: read rounds only on the peer engine's one-phase rounds (never a pull,
/// lines or the two-shot all-reduce), never with direct rounds (the receiver reads; nobody
/// stores into its output); by default on 2 ranks for the kinds and sizes of PEER_READ_BYTES
/// alone, unsplit, in and out of place alike (sender and receiver must agree, and a rank's
/// in-place-ness is its own); never with 0.
#[test]
fn the_peer_engine_reads_its_rounds_only_where_asked_and_measured() {
    use CollKind::*;
    // A shape of `kind` on `n` ranks whose largest buffer is `b` bytes of float32.
    let sized = |kind: CollKind, b: usize, n: usize, in_place: bool| {
        let per_rank = per_count(kind, n);
        let s = OpShape {
            in_place,
            ..shape(kind, b / 4 / per_rank, Float32, n)
        };
        assert_eq!(s.largest_bytes(), Some(b), "{kind}");
        s
    };
    let auto = Config::default();
    for &(kind, from, to) in PEER_READ_BYTES.iter() {
        for b in [from, to] {
            let c = choose(&sized(kind, b, 2, true), Device::Gpu, &auto);
            assert_eq!(c.engine, Engine::PeerKernel, "{kind} at {b}: {c}");
            assert!(c.read && !c.split && !c.zero_copy, "{kind} at {b}: {c}");
            assert!(c.to_string().contains("FERROCCL_GPU_PEER_READ"), "{c}");
            // Out of place alike: every rank must choose as its peers do.
            let oop = choose(&sized(kind, b, 2, false), Device::Gpu, &auto);
            assert!(oop.read, "{kind} at {b} out of place: {oop}");
            // Measured on 2 ranks only.
            let three = choose(&sized(kind, b / 2 * 3 / 4 * 4, 3, true), Device::Gpu, &auto);
            assert!(!three.read, "{kind} on 3 ranks: {three}");
            let off = Config {
                gpu_peer_read: Some(false),
                ..auto.clone()
            };
            assert!(!choose(&sized(kind, b, 2, true), Device::Gpu, &off).read);
        }
        for b in [from / 2, to * 2] {
            let c = choose(&sized(kind, b, 2, true), Device::Gpu, &auto);
            assert!(!c.read, "{kind} at {b}, outside: {c}");
        }
    }
    // The kinds that exchange both ways never read by default, nor the gather, in place or not.
    for kind in [AllGather, AllToAll, ReduceScatter, AllReduce, Gather] {
        for b in [4 << 20, 16 << 20, 64 << 20] {
            for in_place in [false, true] {
                let c = choose(&sized(kind, b, 2, in_place), Device::Gpu, &auto);
                assert!(!c.read, "{kind} at {b}: {c}");
            }
        }
    }
    // Every rank alike: in place or not (each rank's own), the same choice, at every size.
    for kind in CollKind::ALL.into_iter().filter(|k| k.is_collective()) {
        for shift in 10..=30 {
            let at = |in_place| {
                choose(
                    &sized(kind, 4usize << shift, 2, in_place),
                    Device::Gpu,
                    &auto,
                )
            };
            assert_eq!(
                at(false).read,
                at(true).read,
                "{kind} at {} bytes",
                4usize << shift
            );
        }
    }
    // Asked for: every one-phase round, with no direct rounds; never lines, pulls or two shots.
    let on = Config {
        gpu_peer_read: Some(true),
        ..auto.clone()
    };
    for kind in [
        AllGather,
        AllToAll,
        ReduceScatter,
        Gather,
        Scatter,
        Broadcast,
        Reduce,
    ] {
        let c = choose(&sized(kind, 64 << 20, 2, false), Device::Gpu, &on);
        assert_eq!(c.engine, Engine::PeerKernel, "{kind}: {c}");
        assert!(c.read && !c.zero_copy, "{kind}: {c}");
        let windows = OpShape {
            windows: true,
            ..sized(kind, 64 << 20, 2, false)
        };
        let w = choose(&windows, Device::Gpu, &on);
        assert!(
            w.engine != Engine::PeerKernel || (w.read && !w.zero_copy),
            "{kind}: {w}"
        );
    }
    let lines = choose(&sized(AllReduce, 512 << 10, 2, false), Device::Gpu, &on);
    assert_eq!(lines.protocol, Protocol::LL128, "{lines}");
    assert!(!lines.read, "{lines}");
    let pull = OpShape {
        windows: true,
        symmetric: true,
        ..sized(AllReduce, 64 << 20, 2, false)
    };
    let c = choose(&pull, Device::Gpu, &on);
    assert!(c.zero_copy && !c.read, "{c}");
    let two_shot = choose(&sized(AllReduce, 64 << 20, 3, false), Device::Gpu, &on);
    assert_eq!(two_shot.algo, Algo::TwoShot, "{two_shot}");
    assert!(!two_shot.read, "{two_shot}");
}

/// The reduce of 2 ranks folds with settings of its own (FERROCCL_GPU_FOLD_REDUCE_*): more
/// blocks, a steeper taper and a lower threshold than the all-reduce's and reduce-scatter's,
/// within the collective's block budget; the others keep theirs.
#[test]
fn the_reduce_folds_on_its_own_blocks_ramp_and_threshold() {
    let cfg = Config::default();
    let named = |kind: CollKind, bytes: usize, cfg: &Config| {
        choose(
            &OpShape {
                symmetric: true,
                ..shape(kind, bytes / 4, Float32, 2)
            },
            Device::Gpu,
            cfg,
        )
    };
    let r = named(CollKind::Reduce, FOLD_REDUCE_MIN_BYTES, &cfg);
    assert_eq!(
        (r.engine, r.channels),
        (Engine::CopyEngine, FOLD_REDUCE_BLOCKS),
        "{r}"
    );
    assert!(
        r.to_string().contains("FERROCCL_GPU_FOLD_REDUCE_BLOCKS"),
        "{r}"
    );
    let below = named(CollKind::Reduce, FOLD_REDUCE_MIN_BYTES / 2, &cfg);
    assert_eq!(below.engine, Engine::PeerKernel, "{below}");
    // The all-reduce at a reduce's threshold below its own stays on the kernels; at its own it
    // folds on 16.
    let low = Config {
        gpu_fold_reduce_min_bytes: FOLD_MIN_BYTES / 2,
        ..cfg.clone()
    };
    let r = named(CollKind::Reduce, FOLD_MIN_BYTES / 2, &low);
    assert_eq!(r.engine, Engine::CopyEngine, "{r}");
    let ar = named(CollKind::AllReduce, FOLD_MIN_BYTES / 2, &low);
    assert_ne!(ar.engine, Engine::CopyEngine, "{ar}");
    let ar = named(CollKind::AllReduce, FOLD_MIN_BYTES, &cfg);
    assert_eq!(
        (ar.engine, ar.channels),
        (Engine::CopyEngine, FOLD_BLOCKS),
        "{ar}"
    );
    assert_eq!(
        fold_taper(&cfg, CollKind::Reduce).ramp,
        copies::FOLD_REDUCE_RAMP
    );
    for kind in [CollKind::AllReduce, CollKind::ReduceScatter] {
        assert_eq!(fold_taper(&cfg, kind).ramp, copies::FOLD_RAMP, "{kind}");
    }
    assert_eq!(
        fold_taper(&cfg, CollKind::Reduce).max,
        fold_taper(&cfg, CollKind::AllReduce).max
    );
    // Within the block budget (`FERROCCL_GPU_CHANNELS`, `bench --max-ctas`).
    let narrow = Config {
        gpu_channels: 8,
        ..cfg.clone()
    };
    assert_eq!(
        named(CollKind::Reduce, FOLD_REDUCE_MIN_BYTES, &narrow).channels,
        8
    );
    let off = Config {
        gpu_fold_reduce_min_bytes: 0,
        ..cfg.clone()
    };
    assert_ne!(
        named(CollKind::Reduce, 1 << 30, &off).engine,
        Engine::CopyEngine
    );
}
