//! Every knob of ferroccl, in one place, documented in `docs/ENV.md`.
//!
//! This is the only module that reads the process environment. Everything else receives a
//! `Config` (or a `LaunchEnv`) by value, which keeps tests free of global state: a test builds
//! the `Config` it wants instead of setting variables.

use crate::types::Error;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

/// Messages a connection must hold for plans to be deadlock-free: a ring step receives one
/// chunk while its successor still holds the previous one (the plan simulator checks plans
/// against exactly this capacity).
pub const PLAN_FIFO_MESSAGES: usize = 2;

/// Slots per FIFO on GPUs (`FERROCCL_GPU_SLOTS`): two of 128 KiB, so chunks of 128 KiB there.
/// On 2 x H200 (a process per GPU and a thread per GPU, graphs, float32; docs/PERFORMANCE.md
/// section 39) sendrecv 512 KiB - 256 MiB ran as with 4 slots and 256 KiB chunks, and the 18
/// MiB this frees on 2 ranks pay for the peer engine's staging of [`GPU_PEER_BYTES`]; 3 slots
/// with chunks of 192 KiB lost 10 % from 8 MiB. On 3 or more GPUs (chains, groups) not measured.
pub const GPU_SLOTS: usize = 2;

/// The most `FERROCCL_GPU_SLOTS`.
pub const MAX_GPU_SLOTS: usize = 64;

/// The peer engine's staging per rank (`FERROCCL_GPU_PEER_BYTES`): 32 MiB, 128 KiB slots on 2
/// ranks. On 2 x H200 against 16 MiB (a process per GPU, plain buffers, graphs, float32; docs/
/// PERFORMANCE.md section 39) the rooted kinds' larger rounds ran 3-6 % faster from 16 MiB
/// (reduce 32 MiB 326-332 against 315-319 GB/s, gather 64 MiB 326-337 against 317-323,
/// broadcast 32 MiB 331-336 against 323-325) and the all-reduce 3-4 % at 64-128 MiB.
pub const GPU_PEER_BYTES: usize = 32 << 20;

/// Largest FERROCCL_SLOTS and FERROCCL_SLOT_BYTES: 64 Ki slots of 1 GiB is far beyond any
/// useful FIFO, and keeps sizes computed from them from overflowing.
pub const MAX_SLOTS: usize = 1 << 16;
/// Largest FERROCCL_SLOT_BYTES.
pub const MAX_SLOT_BYTES: usize = 1 << 30;
/// The most staging memory `FERROCCL_GPU_PEER_BYTES` may ask for (1 GiB).
pub const MAX_GPU_PEER_BYTES: usize = 1 << 30;

/// `FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES` by default: 1 TiB, every size. Over NVLink (2 x H200,
/// session 12) the one-shot was as fast as the two-shot to 16 MiB and 3-5 % faster from 128 MiB
/// (one flag, wait and copy less a round for the same bytes on the link); on one GPU, where HBM
/// is the link, it lost from 8 MiB (docs/PERFORMANCE.md, sections 13 and 16).
pub const PEER_ONESHOT_MAX_BYTES: usize = 1 << 40;

/// `FERROCCL_GPU_PEER_ROOTED_MAX_BYTES` by default (docs/PERFORMANCE.md, section 15).
pub const PEER_ROOTED_MAX_BYTES: usize = 4 << 20;

/// Which transport connects a pair of ranks on the host backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// By topology: shared memory on one host, sockets across hosts.
    #[default]
    Auto,
    /// Shared memory for every pair (all ranks must be on one host).
    Shm,
    /// TCP sockets for every pair, even on one host.
    Tcp,
}

impl std::str::FromStr for TransportChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportChoice::Auto),
            "shm" => Ok(TransportChoice::Shm),
            "tcp" | "net" | "socket" => Ok(TransportChoice::Tcp),
            _ => Err(Error::InvalidArgument(format!(
                "transport '{s}' is not one of auto, shm, tcp"
            ))),
        }
    }
}

/// Every tunable of a communicator.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// FERROCCL_TIMEOUT (seconds): deadline of every wait (bootstrap, transports, collectives).
    pub timeout: Duration,
    /// FERROCCL_TRANSPORT: force a transport for every peer pair (tests, debugging).
    pub transport: TransportChoice,
    /// FERROCCL_BOOTSTRAP_ADDR: IP address this process listens on and advertises to peers.
    /// Unset: the first non-loopback IPv4 interface, or 127.0.0.1 when there is none.
    pub bootstrap_addr: Option<String>,
    /// FERROCCL_MAX_BOOTSTRAP_MSG: the largest bootstrap message accepted, in bytes.
    pub max_bootstrap_msg: usize,
    /// FERROCCL_CHANNELS: channels (independent rings over slices of the buffer) per collective.
    pub channels: usize,
    /// FERROCCL_GPU_CHANNELS: the most channels an operation takes on GPUs, where each is a
    /// thread block: NVLink needs many blocks in flight (measured on 2 x H200: 1 channel
    /// 12 GB/s, 8: 82, 32: 235). The communicator's FIFOs are sized for this many.
    pub gpu_channels: usize,
    /// FERROCCL_GPU_P2P_CHANNELS: the most channels (thread blocks) one direction of a send or
    /// receive with one peer takes on GPUs (fewer with many ranks: `tune::channel_budget`).
    /// The communicator's point-to-point FIFOs are sized for as many.
    pub gpu_p2p_channels: usize,
    /// FERROCCL_GPU_CHANNEL_BYTES: on GPUs an operation takes one channel per this many bytes
    /// of its largest buffer (up to `gpu_channels`; the direct engine per this many bytes of
    /// its message), so that small operations do not launch blocks that have nothing to move.
    /// 1 KiB: on 2 x H200 in CUDA graphs 8-32 KiB operations took 0.3-0.6 us less than with 4
    /// KiB, 2-4 KiB ones up to 0.1 us more (docs/PERFORMANCE.md, section 20). Every rank must
    /// agree.
    pub gpu_channel_bytes: usize,
    /// FERROCCL_CHUNK_BYTES: bytes one algorithm step moves at most (the pipeline unit).
    pub chunk_bytes: usize,
    /// FERROCCL_SLOT_BYTES: size of one FIFO slot in a connection; a chunk travels as
    /// several slots so that the next rank can start on it before it is complete.
    pub slot_bytes: usize,
    /// FERROCCL_SLOTS: slots per FIFO on the host backend. `slots * slot_bytes` must hold
    /// `PLAN_FIFO_MESSAGES` chunks.
    pub slots: usize,
    /// FERROCCL_GPU_SLOTS: slots per FIFO on GPUs (the plan kernel's connections), 1 to 64; the
    /// default [`GPU_SLOTS`]. Its chunk is `chunk_bytes` at most, and at most what keeps
    /// `PLAN_FIFO_MESSAGES` of them in a FIFO ([`Config::gpu_chunk_bytes`]). Every rank must
    /// agree.
    pub gpu_slots: usize,
    /// FERROCCL_LL_MAX_BYTES: GPU operations up to this size (their largest buffer) use the LL
    /// protocol, where every 8-byte store carries its own flag, so no fence or separate flag
    /// store sits between a send and its receipt; 0 turns LL off. Every rank must agree. A
    /// collective is capped at what one connection's LL slots hold (`slots` x 8 KiB: 32 KiB by
    /// default); a send or receive only needs each channel's share to fit there. 512 KiB: sendrecv
    /// on 2 x H200 in CUDA graphs took LL over the simple protocol to 512 KiB (7.1 against 9.0
    /// us there) and not at 1 MiB (docs/PERFORMANCE.md, section 20).
    pub ll_max_bytes: usize,
    /// FERROCCL_DIRECT_MAX_BYTES: on the host, collectives whose per-rank block is at most this
    /// size take one round of messages (one-shot: all-gather, broadcast, and the reductions on
    /// 2 ranks), and all-reduces on 3 ranks or more the two-shot algorithm (two dependent
    /// messages instead of the ring's 2(n-1)); 0 turns both off. Every rank must agree.
    pub direct_max_bytes: usize,
    /// FERROCCL_GPU_ONESHOT_MAX_BYTES: on GPUs, collectives alone in their launch where each
    /// rank sends at most this many bytes in all (its per-rank block to each of n-1 peers; the
    /// block at most 256 KiB) run one-shot on the direct engine; 0 turns it off. Every rank must
    /// agree.
    pub gpu_oneshot_max_bytes: usize,
    /// FERROCCL_GPU_PEER_FROM_BYTES: on GPUs, where the peer engine serves an operation, it
    /// takes it once each rank sends more than this, short of FERROCCL_GPU_ONESHOT_MAX_BYTES
    /// (the direct engine's limit, which holds where the next engine would be the plan kernel).
    /// Every rank must agree.
    pub gpu_peer_from_bytes: usize,
    /// FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES: on GPUs, all-reduces on 2 ranks that the peer
    /// engine takes, up to this many bytes per rank, run one-shot there (each rank stores its
    /// whole buffer into the peer's staging and both fold the two: one crossing a round instead
    /// of the two-shot's two, the same bytes over the link); beyond, two-shot. 0 turns it off;
    /// by default every size. Every rank must agree.
    pub gpu_peer_oneshot_max_bytes: usize,
    /// FERROCCL_GPU_PEER_ROOTED_MAX_BYTES: on GPUs of 3 or more ranks, broadcasts and reduces
    /// alone in their launch beyond the direct engine run one-shot on the peer engine while the
    /// root's link carries at most this many bytes (n-1 copies of the per-rank buffer), else on
    /// the plan kernel's chain (one copy per link, n-1 hops). 0 keeps them on the chain. Every
    /// rank must agree.
    pub gpu_peer_rooted_max_bytes: usize,
    /// FERROCCL_GPU_TWO_SHOT: GPU all-reduces on 3+ ranks beyond the direct engine, up to one
    /// chunk, take the two-shot algorithm instead of the ring (as on the host). Off until it has
    /// been checked element by element on 3 or more GPUs and measured beside NCCL there. Every
    /// rank must agree.
    pub gpu_two_shot: bool,
    /// FERROCCL_GPU_PEER_BYTES: each rank's staging memory for the GPU peer engine (collectives
    /// beyond the direct engine by stores into the peers' staging and a flag per block and
    /// round): `tune::peer_slot_bytes` cuts it into slots for every peer; where they would be
    /// under 16 KiB (0, or many ranks) the engine is off. Every rank must agree.
    pub gpu_peer_bytes: usize,
    /// FERROCCL_GPU_PEER_BLOCKS: the thread blocks the peer engine's staging is cut for, and so
    /// the most an operation on it runs (`tune::peer_blocks`); 0 (the default): 64 on 2 ranks,
    /// 32 beyond. Fewer blocks leave more SMs to the user's kernels and make each slot larger.
    /// At most `tune::PEER_MAX_BLOCKS` (128). Every rank must agree.
    pub gpu_peer_blocks: usize,
    /// FERROCCL_GPU_PEER_BLOCK_BYTES: a peer-engine operation runs one block per this many
    /// bytes of its largest buffer, up to the blocks its staging is cut for (so from 8 KiB x 64
    /// = 512 KiB on 2 ranks by default, all of them). Fewer bytes per block: more blocks for medium
    /// sizes, each storing less before its flag. At least 1. Every rank must agree.
    pub gpu_peer_block_bytes: usize,
    /// FERROCCL_GPU_PEER_ROUND_BYTES: the most bytes a peer-engine block moves per peer in one
    /// round of a one-phase operation (every kind but the two-shot all-reduce); 0 (the default):
    /// two slots, all the staging holds. Smaller rounds make more rounds of a medium operation,
    /// so that a split launch's receive blocks fold one round while its send blocks store the
    /// next. Every rank must agree.
    pub gpu_peer_round_bytes: usize,
    /// FERROCCL_GPU_PEER_PULL_MIN_BYTES and FERROCCL_GPU_PEER_PULL_MAX_BYTES: on 2 ranks, an
    /// all-reduce on the peer engine whose input and output lie in symmetric windows, out of
    /// place, of this many bytes (both bounds included), pulls: each rank reads its peer's input
    /// straight from the peer's window and folds it with its own (`tune::peer_pulls`); a maximum
    /// of 0 turns it off; the defaults `tune::PEER_PULL_MIN_BYTES` and `tune::PEER_PULL_MAX_BYTES`.
    /// Every rank must agree.
    pub gpu_peer_pull_min_bytes: usize,
    /// See `gpu_peer_pull_min_bytes`.
    pub gpu_peer_pull_max_bytes: usize,
    /// FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES: on 2 ranks, a reduce on the peer engine whose
    /// inputs lie in symmetric windows (or, with a process per rank, whose non-root posts its
    /// input to its root at a rendezvous: `tune::pull_rendezvous_wanted`; lent on the fly where
    /// `gpu_ce_map_unregistered`), of at least this many bytes (no upper bound:
    /// `gpu_peer_pull_max_bytes` is the all-reduce's) where the copy-and-fold does not take it
    /// (below `gpu_fold_reduce_min_bytes`, or a root in place), pulls: its root reads the peer's
    /// input straight from where the peer lent it and folds it with its own (`tune::peer_pulls`);
    /// 0 turns it off; the default `tune::PEER_PULL_REDUCE_MIN_BYTES`. Every rank must agree.
    pub gpu_peer_pull_reduce_min_bytes: usize,
    /// FERROCCL_GPU_PEER_PULL_BLOCKS: the most thread blocks a pull runs on (at most the
    /// blocks the staging is cut for, `FERROCCL_GPU_PEER_BLOCKS`); the default
    /// `tune::PEER_PULL_BLOCKS`. Every rank must agree (block b waits for its peer's block b).
    pub gpu_peer_pull_blocks: usize,
    /// FERROCCL_GPU_PEER_LINES_MAX_BYTES: on 2 ranks whose GPUs NVLink joins, an all-reduce on
    /// the peer engine of at most this many bytes travels in 128-byte lines that carry their own
    /// flag (`tune::peer_lines`): each warp stores its part of the round into the peer's staging
    /// with the round's flag in every line and folds the peer's lines as they land, with no
    /// flag word, fence or wait between storing and folding. 0 turns it off; the default
    /// `tune::PEER_LINES_MAX_BYTES`. Every rank must agree.
    pub gpu_peer_lines_max_bytes: usize,
    /// FERROCCL_GPU_FOLD_BLOCKS: thread blocks of the fold kernel of a copy-and-fold reduction
    /// (`plan::copies::fold_list`), 1 to 132; the default `tune::FOLD_BLOCKS`. Each rank sets its own
    /// (the fold is local).
    pub gpu_fold_blocks: usize,
    /// FERROCCL_GPU_FOLD_PIECE_BYTES: bytes of the largest piece of a copy-and-fold reduction
    /// (the copy engines land, and the fold kernel folds, piece by piece; `plan::copies::Taper`);
    /// a multiple of 4 KiB, at least 64 KiB; the default `plan::copies::FOLD_PIECE_BYTES`. Every
    /// rank must agree.
    pub gpu_fold_piece_bytes: usize,
    /// FERROCCL_GPU_FOLD_TAIL_BYTES: bytes of a copy-and-fold's last piece, towards which its
    /// pieces taper; a multiple of 4 KiB, at least 64 KiB; the default
    /// `plan::copies::FOLD_TAIL_BYTES`; at or over the largest piece, the pieces are all alike
    /// but the first. Every rank must agree.
    pub gpu_fold_tail_bytes: usize,
    /// FERROCCL_GPU_FOLD_RAMP: how much each piece of a copy-and-fold may grow over the one
    /// after it, in per cent, 110 to 400; the default `plan::copies::FOLD_RAMP`. Every rank must
    /// agree.
    pub gpu_fold_ramp: usize,
    /// FERROCCL_GPU_FOLD_MIN_BYTES: the smallest largest-buffer for which all-reduce,
    /// reduce-scatter and reduce on 2 ranks into posted outputs take the copy-and-fold
    /// (`plan::copies::fold_list`); 0: never. Default `tune::FOLD_MIN_BYTES`. Every rank must
    /// agree.
    pub gpu_fold_min_bytes: usize,
    /// FERROCCL_GPU_FOLD_REDUCE_BLOCKS: `gpu_fold_blocks` for the reduce of 2 ranks, whose root
    /// alone folds, 1 to 132; the default `tune::FOLD_REDUCE_BLOCKS`. Each rank sets its own.
    pub gpu_fold_reduce_blocks: usize,
    /// FERROCCL_GPU_FOLD_REDUCE_RAMP: `gpu_fold_ramp` for the reduce of 2 ranks, 110 to 400; the
    /// default `plan::copies::FOLD_REDUCE_RAMP`. Every rank must agree.
    pub gpu_fold_reduce_ramp: usize,
    /// FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES: `gpu_fold_min_bytes` for the reduce of 2 ranks; 0:
    /// never. Default `tune::FOLD_REDUCE_MIN_BYTES`. Every rank must agree.
    pub gpu_fold_reduce_min_bytes: usize,
    /// FERROCCL_GPU_PEER_SPLIT: the peer engine's one-phase rounds on two blocks a slice, one
    /// sending and one receiving, each at its own pace (`tune::Choice::split`). `auto` (None,
    /// the default): for the kinds and sizes where it measured faster (`tune::peer_split_pays`);
    /// 1: wherever it is safe; 0: never. Every rank must agree.
    pub gpu_peer_split: Option<bool>,
    /// FERROCCL_GPU_PEER_READ: the peer engine's one-phase rounds as read rounds, each message
    /// left in its sender's own staging for its receiver to read over the link
    /// (`tune::Choice::read`). `auto` (None, the default): for the kinds and sizes where it
    /// measured faster (`tune::peer_read_pays`); 1: every one-phase round; 0: never. Every rank
    /// must agree.
    pub gpu_peer_read: Option<bool>,
    /// FERROCCL_GPU_PEER_DIRECT (default on): the peer engine's direct rounds: a receiver whose
    /// output lies in a window posts it, and its senders store straight into it instead of its
    /// staging (`tune::Choice::zero_copy`). A run-time choice that each receiver learns round
    /// by round, so ranks may differ.
    pub gpu_peer_direct: bool,
    /// FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES: the smallest largest-buffer of a data-movement
    /// collective between symmetric windows (every receiver posts its output) whose senders on
    /// the peer engine wait, a few microseconds at most, for their receivers' posts at a launch's
    /// start and store straight into the outputs from the first round (`tune::Choice::wait_posts`;
    /// the looks alone go direct from the third round, and from 32 MiB). A bounded wait, so ranks
    /// may differ. 0: never; the default `tune::PEER_WAIT_POSTS_MIN_BYTES`.
    pub gpu_peer_wait_posts_min_bytes: usize,
    /// FERROCCL_GPU_COPY_ENGINE_BYTES: on GPUs, data-movement collectives alone in their launch
    /// (all-gather, all-to-all, gather, scatter; broadcast on 2 ranks) whose largest buffer is
    /// at least this many bytes move by the GPUs' copy engines, through the peer engine's
    /// staging, with no thread block; 0 (the default until it is measured over NVLink) turns
    /// this off. Every rank must agree.
    pub gpu_copy_engine_bytes: usize,
    /// FERROCCL_GPU_CE_WINDOW_BYTES (default 32 MiB): on GPUs, a data-movement collective alone
    /// in its launch (all-gather, all-to-all not in place, gather, scatter; broadcast on 2 ranks)
    /// whose buffers lie in symmetric windows and whose largest buffer is at least this many
    /// bytes moves by the GPUs' copy engines straight from input to the peers' outputs: one copy
    /// per pair over the link, no staging, no thread block (gather, scatter and broadcast from
    /// their own thresholds too). 0 turns this off. Every rank must agree. Measured on 2 x H200
    /// (docs/PERFORMANCE.md sections 18, 37 and 38): with the handshakes' memory operations in
    /// batches (about 16 us of them a launch), at 64 MiB the copies gained 8 % on the kernels for
    /// an all-gather in place and 4-6 % for a broadcast; with an out-of-place rank's own copy
    /// after the handshakes, at 32 MiB all-gather and all-to-all out of place 282 and 276 GB/s
    /// against the kernels' 259 and 258, in place level (four alternated runs).
    pub gpu_ce_window_bytes: usize,
    /// FERROCCL_GPU_CE_RENDEZVOUS_BYTES (default 32 MiB): on GPUs with a process per rank, a
    /// data-movement collective alone in its launch (gather, scatter; all-gather, all-to-all and
    /// broadcast whose buffers lie in no symmetric window) whose largest buffer is at least this
    /// many bytes (and at least `gpu_ce_window_bytes`): the ranks first post to each other where
    /// their outputs lie (a bootstrap all-gather; the call waits for every rank's), and where
    /// every receiver's output lies in a symmetric window, or is mapped for its writers
    /// (`gpu_ce_map_unregistered`), the copy engines copy straight into it. A gather's or
    /// scatter's root in place has its output at another offset than its peers', so the
    /// symmetric contract cannot name it; the exchange does. Gather and scatter wait for
    /// `gpu_ce_gather_bytes` too, broadcast for `gpu_ce_broadcast_bytes`. 0 turns this off.
    /// Every rank must agree.
    pub gpu_ce_rendezvous_bytes: usize,
    /// FERROCCL_GPU_CE_GATHER_BYTES (default 128 MiB): gather and scatter take the rendezvous
    /// above only from this many bytes too: their kernels carry one direction in rooted rounds
    /// faster than the all-gather's, and on 2 x H200 the copies beat them from 128 MiB (gather
    /// 346-350 GB/s against 331 in graphs, docs/PERFORMANCE.md section 33) but lost at 64 MiB
    /// (306-315 against 318-325 with the handshakes in batches, section 37). 0 turns the copies
    /// off for them. Every rank must agree.
    pub gpu_ce_gather_bytes: usize,
    /// FERROCCL_GPU_CE_BROADCAST_BYTES (default 64 MiB): a broadcast takes the copy engines
    /// (between symmetric windows, or after the rendezvous above) only from this many bytes too:
    /// one direction, whose kernels hold out longer than the all-gather's. On 2 x H200 (a process
    /// per GPU, plain buffers, graphs, float32, four alternated runs; docs/PERFORMANCE.md section
    /// 38) the copies at 32 MiB ran a broadcast in place 312 GB/s against the kernels' 318 (out
    /// of place 309 against 303), where they took the all-gather and the all-to-all out of place
    /// from 259 to 282 and 258 to 276; at 64 MiB they beat the kernels (section 37). 0 turns the
    /// copies off for it. Every rank must agree.
    pub gpu_ce_broadcast_bytes: usize,
    /// FERROCCL_GPU_CE_P2P_BYTES (default 16 MiB): on GPUs with a process per rank, a send or
    /// receive of at least this many bytes goes through the posted-receive rendezvous: the
    /// receiver tells its sender where its output lies (the receiver never waits, the sender
    /// waits for its receiver's call), and where it lies in a symmetric window, or is mapped for
    /// the sender (`gpu_ce_map_unregistered`), the sender's copy engines copy straight into it.
    /// On 2 x H200 (docs/PERFORMANCE.md sections 34 and 37) sendrecv by the copies: 64 MiB 335-344
    /// GB/s against the kernels' 309-318; with the handshakes' memory operations in batches, 32
    /// MiB 306-308 against 291-305, 16 MiB 259 against 271; with a sendrecv's two directions on
    /// one lane on the caller's stream (section 38), 16 MiB 284 against 270 (four alternated
    /// runs). 0 turns this off. Every rank must agree.
    pub gpu_ce_p2p_bytes: usize,
    /// FERROCCL_GPU_CE_MAP_UNREGISTERED (default on): the two rendezvous above (and the same
    /// exchange before an all-gather, all-to-all or broadcast whose buffers lie in no symmetric
    /// window, from `gpu_ce_rendezvous_bytes`, and before a pulled reduce, whose non-root lends
    /// its input to its root alike) also take outputs nobody registered: each rank
    /// lends the allocation holding its output to the peers whose copy engines write it,
    /// through their mappers, at the first operation on it, and keeps the loan for the next ones
    /// while the allocation lives (NCCL's lazy registration; `backend/cuda/lazy.rs`): a cuMem
    /// allocation with POSIX file-descriptor handles by its descriptor, `cuMemAlloc` memory
    /// (`cudaMalloc`'s) by its CUDA IPC handle to peers in other processes. Other memory runs on
    /// the kernels as before.
    /// 0: only registered windows take the copy engines, and a communicator without windows
    /// exchanges nothing. Every rank must agree.
    pub gpu_ce_map_unregistered: bool,
    /// FERROCCL_GPU_CE_IN_PROCESS (default on): ranks that share a process (a thread per GPU,
    /// or one thread driving several), none sharing a GPU, take the paths that learn their
    /// peers' buffers at a rendezvous before each launch (the copies into posted outputs, the
    /// reduce's pull of a lent input, posted sends and receives) as ranks of processes of their
    /// own do. Copies and pulls between symmetric windows stay with processes of their own
    /// unless `gpu_windows_in_process` (`Fabric::ranks_window`). 0: ranks of one process take
    /// the kernels. Every rank must agree.
    pub gpu_ce_in_process: bool,
    /// FERROCCL_GPU_WINDOWS_IN_PROCESS (default off): ranks that share a process, none sharing
    /// a GPU, take the copies and pulls between symmetric windows too (`Fabric::ranks_window`),
    /// which name the peers' buffers from the registration and exchange nothing at a launch.
    /// Off until nccl-tests `-R 2` runs exact with it in one process. Every rank must agree.
    pub gpu_windows_in_process: bool,
    /// FERROCCL_GPU_FOLD_EVERY_TYPE (default off): the copy-and-fold takes every type and
    /// reduction but PreMulSum, not only those `tune::fold_pays` measured paying (its 1- and
    /// 2-byte folds run a word at a time since session 37, fast enough on one GPU for most; over
    /// NVLink not measured yet): for measuring them against the kernels. Every rank must agree.
    pub gpu_fold_every_type: bool,
    /// FERROCCL_GPU_EARLY_LAUNCH (default on): on GPUs of compute capability 9.0 and up, the
    /// engines' kernels are launched allowed to start while the kernel ahead of them in the
    /// stream finishes (programmatic dependent launch), which hides a launch's latency behind
    /// the work before it; every block still waits for that work before touching memory. 0
    /// launches them the classic way. Ranks may differ.
    pub gpu_early_launch: bool,
    /// FERROCCL_LAUNCH_SPIN_US (default 200): a call that launches on several GPUs from one
    /// thread (a group over their communicators) hands every GPU's launch but the first to a
    /// helper thread, so the driver's launches run at once rather than in turn; a helper spins
    /// this many microseconds after its last launch, then sleeps until a call wakes it (that
    /// call launches in turn). 0: the calling thread makes every launch. Ranks may differ.
    pub launch_spin_us: u64,
    /// FERROCCL_GPU_P2P_KERNEL (default on): a GPU launch whose plan holds only sends and
    /// receives (and copies for sends to oneself) runs on the plan kernel's point-to-point form,
    /// which speaks the same protocols on the same connections with less work per message; 0
    /// keeps every plan on the plan kernel. Ranks may differ.
    pub gpu_p2p_kernel: bool,
    /// FERROCCL_JOB_SECRET (32 hex digits): the job secret when ranks rendezvous from the
    /// launcher's environment instead of a `UniqueId`.
    pub job_secret: Option<[u8; 16]>,
    /// FERROCCL_HEARTBEAT_INTERVAL (seconds): how often a rank tells its ring neighbours it is
    /// alive. A peer whose process dies is noticed at once (its connection closes); this only
    /// bounds how long a hung process or an unreachable host goes unnoticed.
    pub heartbeat_interval: Duration,
    /// FERROCCL_HEARTBEAT_MISSES: heartbeat intervals of silence after which a neighbour is
    /// declared dead.
    pub heartbeat_misses: u32,
    /// FERROCCL_CHECK_MISMATCH: before each launch, compare every rank's operations (kind,
    /// type, count, reduction, root or peer, sequence number) and fail on every rank, before
    /// anything moves, when they differ. Costs one bootstrap all-gather per launch.
    pub check_mismatch: bool,
    /// FERROCCL_TCP_CRC: a CRC32C after every frame of the socket transport, checked by the
    /// receiver, so that corruption in transit is an error instead of wrong results.
    pub tcp_crc: bool,
    /// FERROCCL_CUDA_INCLUDE (':'-separated), then `/usr/local/cuda/include`: where NVRTC finds
    /// CUDA's headers (`cuda_fp16.h`, ...) when it compiles the kernels.
    pub cuda_include: Vec<PathBuf>,
    /// FERROCCL_KERNEL_DEFINES: extra `NAME=VALUE` macro definitions (spaces or commas) for the
    /// GPU kernels' NVRTC compile, for tuning experiments (`FC_COPY_UNROLL=8`). They change
    /// speed, never what moves where, so ranks may differ.
    pub kernel_defines: Vec<String>,
    /// Where compiled kernels are cached on disk: `$XDG_CACHE_HOME/ferroccl/kernels`, else
    /// `$HOME/.cache/ferroccl/kernels`; None (neither set): no disk cache.
    pub kernel_cache: Option<PathBuf>,
}

/// Where CUDA's headers are on a standard install.
pub const SYSTEM_CUDA_INCLUDE: &str = "/usr/local/cuda/include";

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(120),
            transport: TransportChoice::Auto,
            bootstrap_addr: None,
            max_bootstrap_msg: 64 << 20,
            channels: 1,
            gpu_channels: 32,
            gpu_p2p_channels: 32,
            gpu_channel_bytes: 1 << 10,
            chunk_bytes: 256 << 10,
            slot_bytes: 128 << 10,
            slots: 4,
            gpu_slots: GPU_SLOTS,
            ll_max_bytes: 512 << 10,
            direct_max_bytes: 128 << 10,
            gpu_oneshot_max_bytes: 256 << 10,
            gpu_peer_from_bytes: 128 << 10,
            gpu_peer_oneshot_max_bytes: PEER_ONESHOT_MAX_BYTES,
            gpu_peer_blocks: 0,
            gpu_peer_block_bytes: crate::tune::PEER_BLOCK_BYTES,
            gpu_peer_round_bytes: 0,
            gpu_peer_pull_min_bytes: crate::tune::PEER_PULL_MIN_BYTES,
            gpu_peer_pull_max_bytes: crate::tune::PEER_PULL_MAX_BYTES,
            gpu_peer_pull_reduce_min_bytes: crate::tune::PEER_PULL_REDUCE_MIN_BYTES,
            gpu_peer_pull_blocks: crate::tune::PEER_PULL_BLOCKS,
            gpu_peer_lines_max_bytes: crate::tune::PEER_LINES_MAX_BYTES,
            gpu_fold_blocks: crate::tune::FOLD_BLOCKS,
            gpu_fold_piece_bytes: crate::plan::copies::FOLD_PIECE_BYTES,
            gpu_fold_tail_bytes: crate::plan::copies::FOLD_TAIL_BYTES,
            gpu_fold_ramp: crate::plan::copies::FOLD_RAMP,
            gpu_fold_min_bytes: crate::tune::FOLD_MIN_BYTES,
            gpu_fold_reduce_blocks: crate::tune::FOLD_REDUCE_BLOCKS,
            gpu_fold_reduce_ramp: crate::plan::copies::FOLD_REDUCE_RAMP,
            gpu_fold_reduce_min_bytes: crate::tune::FOLD_REDUCE_MIN_BYTES,
            gpu_peer_split: None,
            gpu_peer_read: None,
            gpu_peer_direct: true,
            gpu_peer_wait_posts_min_bytes: crate::tune::PEER_WAIT_POSTS_MIN_BYTES,
            gpu_peer_rooted_max_bytes: PEER_ROOTED_MAX_BYTES,
            gpu_two_shot: false,
            gpu_peer_bytes: GPU_PEER_BYTES,
            gpu_copy_engine_bytes: 0,
            gpu_ce_window_bytes: 32 << 20,
            gpu_ce_rendezvous_bytes: 32 << 20,
            gpu_ce_gather_bytes: 128 << 20,
            gpu_ce_broadcast_bytes: 64 << 20,
            gpu_ce_p2p_bytes: 16 << 20,
            gpu_ce_map_unregistered: true,
            gpu_ce_in_process: true,
            gpu_windows_in_process: false,
            gpu_fold_every_type: false,
            gpu_early_launch: true,
            gpu_p2p_kernel: true,
            launch_spin_us: 200,
            job_secret: None,
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_misses: 6,
            check_mismatch: false,
            tcp_crc: false,
            cuda_include: vec![PathBuf::from(SYSTEM_CUDA_INCLUDE)],
            kernel_defines: Vec::new(),
            kernel_cache: None,
        }
    }
}

fn parse<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, Error> {
    v.trim()
        .parse::<T>()
        .map_err(|_| Error::InvalidArgument(format!("{key}='{v}' is not a valid value")))
}

/// Parses a 32-hex-digit job secret.
pub fn parse_secret(s: &str) -> Result<[u8; 16], Error> {
    let s = s.trim();
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::InvalidArgument(
            "FERROCCL_JOB_SECRET must be 32 hexadecimal digits".into(),
        ));
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex");
    }
    Ok(out)
}

/// A switch: 1/0, true/false, yes/no, on/off, in any case.
pub fn parse_bool(key: &str, v: &str) -> Result<bool, Error> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::InvalidArgument(format!(
            "{key}='{v}' is not a switch (use 1 or 0)"
        ))),
    }
}

/// A switch that may also be left to the tuner (`auto`, or empty: None), as the peer engine's
/// split and read rounds are.
fn parse_auto_bool(key: &str, v: &str) -> Result<Option<bool>, Error> {
    match v.trim() {
        "" | "auto" => Ok(None),
        v => parse_bool(key, v).map(Some),
    }
}

/// How `shared_settings` writes a switch that may be left to the tuner.
fn auto_bool_setting(v: Option<bool>) -> String {
    v.map_or("auto".into(), |b| (b as u8).to_string())
}

/// FERROCCL_KERNEL_DEFINES: `NAME=VALUE` words (separated by spaces or commas), each name a C
/// identifier and each value letters, digits, '.', '_' or '-' (nothing that could smuggle
/// another compiler option in).
pub fn parse_defines(v: &str) -> Result<Vec<String>, Error> {
    v.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let (name, value) = w.split_once('=').unwrap_or((w, ""));
            let ident = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            let plain = value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if ident && plain {
                Ok(format!("-D{w}"))
            } else {
                Err(Error::InvalidArgument(format!(
                    "FERROCCL_KERNEL_DEFINES: '{w}' is not NAME or NAME=VALUE"
                )))
            }
        })
        .collect()
}

/// A job secret as 32 hex digits (what FERROCCL_JOB_SECRET takes).
pub fn format_secret(s: &[u8; 16]) -> String {
    s.iter().map(|b| format!("{b:02x}")).collect()
}

impl Config {
    /// The chunk (bytes one algorithm step moves at most) on GPUs: `chunk_bytes`, within what
    /// keeps `PLAN_FIFO_MESSAGES` of them in a GPU FIFO of `gpu_slots` slots.
    pub fn gpu_chunk_bytes(&self) -> usize {
        self.chunk_bytes
            .min(self.gpu_slots.saturating_mul(self.slot_bytes) / PLAN_FIFO_MESSAGES)
            .max(1)
    }

    /// Defaults overridden by the process environment.
    pub fn from_env() -> Result<Config, Error> {
        Config::from_vars(&std::env::vars().collect())
    }

    /// Defaults overridden by `vars` (a snapshot of an environment).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Config, Error> {
        let mut c = Config::default();
        let get = |k: &str| vars.get(k).map(|s| s.as_str()).filter(|s| !s.is_empty());
        if let Some(v) = get("FERROCCL_TIMEOUT") {
            let secs: f64 = parse("FERROCCL_TIMEOUT", v)?;
            if !(secs > 0.0 && secs < 1e9) {
                return Err(Error::InvalidArgument(format!(
                    "FERROCCL_TIMEOUT='{v}' must be a positive number of seconds"
                )));
            }
            c.timeout = Duration::from_secs_f64(secs);
        }
        if let Some(v) = get("FERROCCL_TRANSPORT") {
            c.transport = v
                .parse()
                .map_err(|e: Error| e.context("FERROCCL_TRANSPORT"))?;
        }
        if let Some(v) = get("FERROCCL_BOOTSTRAP_ADDR") {
            c.bootstrap_addr = Some(v.to_string());
        }
        if let Some(v) = get("FERROCCL_MAX_BOOTSTRAP_MSG") {
            c.max_bootstrap_msg = parse("FERROCCL_MAX_BOOTSTRAP_MSG", v)?;
        }
        if let Some(v) = get("FERROCCL_CHANNELS") {
            c.channels = parse("FERROCCL_CHANNELS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CHANNELS") {
            c.gpu_channels = parse("FERROCCL_GPU_CHANNELS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_P2P_CHANNELS") {
            c.gpu_p2p_channels = parse("FERROCCL_GPU_P2P_CHANNELS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CHANNEL_BYTES") {
            c.gpu_channel_bytes = parse("FERROCCL_GPU_CHANNEL_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_CHUNK_BYTES") {
            c.chunk_bytes = parse("FERROCCL_CHUNK_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_SLOT_BYTES") {
            c.slot_bytes = parse("FERROCCL_SLOT_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_SLOTS") {
            c.slots = parse("FERROCCL_SLOTS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_SLOTS") {
            c.gpu_slots = parse("FERROCCL_GPU_SLOTS", v)?;
        }
        if let Some(v) = get("FERROCCL_LL_MAX_BYTES") {
            c.ll_max_bytes = parse("FERROCCL_LL_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_DIRECT_MAX_BYTES") {
            c.direct_max_bytes = parse("FERROCCL_DIRECT_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_ONESHOT_MAX_BYTES") {
            c.gpu_oneshot_max_bytes = parse("FERROCCL_GPU_ONESHOT_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_FROM_BYTES") {
            c.gpu_peer_from_bytes = parse("FERROCCL_GPU_PEER_FROM_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES") {
            c.gpu_peer_oneshot_max_bytes = parse("FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_ROOTED_MAX_BYTES") {
            c.gpu_peer_rooted_max_bytes = parse("FERROCCL_GPU_PEER_ROOTED_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_TWO_SHOT") {
            c.gpu_two_shot = parse_bool("FERROCCL_GPU_TWO_SHOT", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_BYTES") {
            c.gpu_peer_bytes = parse("FERROCCL_GPU_PEER_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_BLOCKS") {
            c.gpu_peer_blocks = parse("FERROCCL_GPU_PEER_BLOCKS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_BLOCK_BYTES") {
            c.gpu_peer_block_bytes = parse("FERROCCL_GPU_PEER_BLOCK_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_BLOCKS") {
            c.gpu_fold_blocks = parse("FERROCCL_GPU_FOLD_BLOCKS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_MIN_BYTES") {
            c.gpu_fold_min_bytes = parse("FERROCCL_GPU_FOLD_MIN_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_REDUCE_BLOCKS") {
            c.gpu_fold_reduce_blocks = parse("FERROCCL_GPU_FOLD_REDUCE_BLOCKS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_REDUCE_RAMP") {
            c.gpu_fold_reduce_ramp = parse("FERROCCL_GPU_FOLD_REDUCE_RAMP", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES") {
            c.gpu_fold_reduce_min_bytes = parse("FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_PIECE_BYTES") {
            c.gpu_fold_piece_bytes = parse("FERROCCL_GPU_FOLD_PIECE_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_TAIL_BYTES") {
            c.gpu_fold_tail_bytes = parse("FERROCCL_GPU_FOLD_TAIL_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_RAMP") {
            c.gpu_fold_ramp = parse("FERROCCL_GPU_FOLD_RAMP", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_ROUND_BYTES") {
            c.gpu_peer_round_bytes = parse("FERROCCL_GPU_PEER_ROUND_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_PULL_MIN_BYTES") {
            c.gpu_peer_pull_min_bytes = parse("FERROCCL_GPU_PEER_PULL_MIN_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_PULL_MAX_BYTES") {
            c.gpu_peer_pull_max_bytes = parse("FERROCCL_GPU_PEER_PULL_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_PULL_BLOCKS") {
            c.gpu_peer_pull_blocks = parse("FERROCCL_GPU_PEER_PULL_BLOCKS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES") {
            c.gpu_peer_pull_reduce_min_bytes = parse("FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_LINES_MAX_BYTES") {
            c.gpu_peer_lines_max_bytes = parse("FERROCCL_GPU_PEER_LINES_MAX_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_SPLIT") {
            c.gpu_peer_split = parse_auto_bool("FERROCCL_GPU_PEER_SPLIT", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_READ") {
            c.gpu_peer_read = parse_auto_bool("FERROCCL_GPU_PEER_READ", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_DIRECT") {
            c.gpu_peer_direct = parse_bool("FERROCCL_GPU_PEER_DIRECT", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES") {
            c.gpu_peer_wait_posts_min_bytes = parse("FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_COPY_ENGINE_BYTES") {
            c.gpu_copy_engine_bytes = parse("FERROCCL_GPU_COPY_ENGINE_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_WINDOW_BYTES") {
            c.gpu_ce_window_bytes = parse("FERROCCL_GPU_CE_WINDOW_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_RENDEZVOUS_BYTES") {
            c.gpu_ce_rendezvous_bytes = parse("FERROCCL_GPU_CE_RENDEZVOUS_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_GATHER_BYTES") {
            c.gpu_ce_gather_bytes = parse("FERROCCL_GPU_CE_GATHER_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_BROADCAST_BYTES") {
            c.gpu_ce_broadcast_bytes = parse("FERROCCL_GPU_CE_BROADCAST_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_P2P_BYTES") {
            c.gpu_ce_p2p_bytes = parse("FERROCCL_GPU_CE_P2P_BYTES", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_MAP_UNREGISTERED") {
            c.gpu_ce_map_unregistered = parse_bool("FERROCCL_GPU_CE_MAP_UNREGISTERED", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_CE_IN_PROCESS") {
            c.gpu_ce_in_process = parse_bool("FERROCCL_GPU_CE_IN_PROCESS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_WINDOWS_IN_PROCESS") {
            c.gpu_windows_in_process = parse_bool("FERROCCL_GPU_WINDOWS_IN_PROCESS", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_FOLD_EVERY_TYPE") {
            c.gpu_fold_every_type = parse_bool("FERROCCL_GPU_FOLD_EVERY_TYPE", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_EARLY_LAUNCH") {
            c.gpu_early_launch = parse_bool("FERROCCL_GPU_EARLY_LAUNCH", v)?;
        }
        if let Some(v) = get("FERROCCL_LAUNCH_SPIN_US") {
            c.launch_spin_us = parse("FERROCCL_LAUNCH_SPIN_US", v)?;
        }
        if let Some(v) = get("FERROCCL_GPU_P2P_KERNEL") {
            c.gpu_p2p_kernel = parse_bool("FERROCCL_GPU_P2P_KERNEL", v)?;
        }
        if let Some(v) = get("FERROCCL_HEARTBEAT_INTERVAL") {
            let secs: f64 = parse("FERROCCL_HEARTBEAT_INTERVAL", v)?;
            if !(secs > 0.0 && secs < 1e6) {
                return Err(Error::InvalidArgument(format!(
                    "FERROCCL_HEARTBEAT_INTERVAL='{v}' must be a positive number of seconds"
                )));
            }
            c.heartbeat_interval = Duration::from_secs_f64(secs);
        }
        if let Some(v) = get("FERROCCL_HEARTBEAT_MISSES") {
            c.heartbeat_misses = parse("FERROCCL_HEARTBEAT_MISSES", v)?;
        }
        if let Some(v) = get("FERROCCL_JOB_SECRET") {
            c.job_secret = Some(parse_secret(v)?);
        }
        if let Some(v) = get("FERROCCL_CHECK_MISMATCH") {
            c.check_mismatch = parse_bool("FERROCCL_CHECK_MISMATCH", v)?;
        }
        if let Some(v) = get("FERROCCL_TCP_CRC") {
            c.tcp_crc = parse_bool("FERROCCL_TCP_CRC", v)?;
        }
        if let Some(v) = get("FERROCCL_CUDA_INCLUDE") {
            let mut dirs: Vec<PathBuf> = std::env::split_paths(v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect();
            for d in std::mem::take(&mut c.cuda_include) {
                if !dirs.contains(&d) {
                    dirs.push(d);
                }
            }
            c.cuda_include = dirs;
        }
        if let Some(v) = get("FERROCCL_KERNEL_DEFINES") {
            c.kernel_defines = parse_defines(v)?;
        }
        let cache_base = get("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| get("HOME").map(|h| PathBuf::from(h).join(".cache")));
        c.kernel_cache = cache_base.map(|b| b.join("ferroccl").join("kernels"));
        c.validate()?;
        Ok(c)
    }

    /// The knobs every rank of a communicator must set alike, by their variable names: they
    /// decide the plans (which messages go where, cut how), the wire format, or how long silence
    /// means death. The timeout and the addresses may differ.
    pub fn shared_settings(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "FERROCCL_TRANSPORT",
                format!("{:?}", self.transport).to_lowercase(),
            ),
            ("FERROCCL_CHANNELS", self.channels.to_string()),
            ("FERROCCL_GPU_CHANNELS", self.gpu_channels.to_string()),
            (
                "FERROCCL_GPU_P2P_CHANNELS",
                self.gpu_p2p_channels.to_string(),
            ),
            (
                "FERROCCL_GPU_CHANNEL_BYTES",
                self.gpu_channel_bytes.to_string(),
            ),
            ("FERROCCL_CHUNK_BYTES", self.chunk_bytes.to_string()),
            ("FERROCCL_SLOT_BYTES", self.slot_bytes.to_string()),
            ("FERROCCL_SLOTS", self.slots.to_string()),
            ("FERROCCL_GPU_SLOTS", self.gpu_slots.to_string()),
            ("FERROCCL_LL_MAX_BYTES", self.ll_max_bytes.to_string()),
            (
                "FERROCCL_DIRECT_MAX_BYTES",
                self.direct_max_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_ONESHOT_MAX_BYTES",
                self.gpu_oneshot_max_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_FROM_BYTES",
                self.gpu_peer_from_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES",
                self.gpu_peer_oneshot_max_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_ROOTED_MAX_BYTES",
                self.gpu_peer_rooted_max_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_TWO_SHOT",
                (self.gpu_two_shot as u8).to_string(),
            ),
            ("FERROCCL_GPU_PEER_BYTES", self.gpu_peer_bytes.to_string()),
            ("FERROCCL_GPU_PEER_BLOCKS", self.gpu_peer_blocks.to_string()),
            (
                "FERROCCL_GPU_PEER_BLOCK_BYTES",
                self.gpu_peer_block_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_ROUND_BYTES",
                self.gpu_peer_round_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_PULL_MIN_BYTES",
                self.gpu_peer_pull_min_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_PULL_MAX_BYTES",
                self.gpu_peer_pull_max_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES",
                self.gpu_peer_pull_reduce_min_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_PULL_BLOCKS",
                self.gpu_peer_pull_blocks.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_LINES_MAX_BYTES",
                self.gpu_peer_lines_max_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_FOLD_PIECE_BYTES",
                self.gpu_fold_piece_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_FOLD_TAIL_BYTES",
                self.gpu_fold_tail_bytes.to_string(),
            ),
            ("FERROCCL_GPU_FOLD_RAMP", self.gpu_fold_ramp.to_string()),
            (
                "FERROCCL_GPU_FOLD_REDUCE_RAMP",
                self.gpu_fold_reduce_ramp.to_string(),
            ),
            (
                "FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES",
                self.gpu_fold_reduce_min_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_FOLD_MIN_BYTES",
                self.gpu_fold_min_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_PEER_SPLIT",
                auto_bool_setting(self.gpu_peer_split),
            ),
            (
                "FERROCCL_GPU_PEER_READ",
                auto_bool_setting(self.gpu_peer_read),
            ),
            (
                "FERROCCL_GPU_COPY_ENGINE_BYTES",
                self.gpu_copy_engine_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_CE_WINDOW_BYTES",
                self.gpu_ce_window_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_CE_RENDEZVOUS_BYTES",
                self.gpu_ce_rendezvous_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_CE_GATHER_BYTES",
                self.gpu_ce_gather_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_CE_BROADCAST_BYTES",
                self.gpu_ce_broadcast_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_CE_P2P_BYTES",
                self.gpu_ce_p2p_bytes.to_string(),
            ),
            (
                "FERROCCL_GPU_CE_MAP_UNREGISTERED",
                (self.gpu_ce_map_unregistered as u8).to_string(),
            ),
            (
                "FERROCCL_GPU_CE_IN_PROCESS",
                (self.gpu_ce_in_process as u8).to_string(),
            ),
            (
                "FERROCCL_GPU_WINDOWS_IN_PROCESS",
                (self.gpu_windows_in_process as u8).to_string(),
            ),
            (
                "FERROCCL_GPU_FOLD_EVERY_TYPE",
                (self.gpu_fold_every_type as u8).to_string(),
            ),
            (
                "FERROCCL_CHECK_MISMATCH",
                (self.check_mismatch as u8).to_string(),
            ),
            ("FERROCCL_TCP_CRC", (self.tcp_crc as u8).to_string()),
            (
                "FERROCCL_HEARTBEAT_INTERVAL",
                format!("{}", self.heartbeat_interval.as_secs_f64()),
            ),
            (
                "FERROCCL_HEARTBEAT_MISSES",
                self.heartbeat_misses.to_string(),
            ),
        ]
    }

    /// [`Config::shared_settings`] as the bytes a rank sends its peers at communicator creation.
    pub fn encode_shared(&self) -> Vec<u8> {
        self.shared_settings()
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect::<String>()
            .into_bytes()
    }

    /// Checks the relations between knobs.
    pub fn validate(&self) -> Result<(), Error> {
        if self.channels == 0 || self.channels > 64 {
            return Err(Error::InvalidArgument(format!(
                "channels={} must be in 1..=64",
                self.channels
            )));
        }
        if self.gpu_channels == 0 || self.gpu_channels > 128 {
            return Err(Error::InvalidArgument(format!(
                "gpu_channels={} must be in 1..=128",
                self.gpu_channels
            )));
        }
        if self.gpu_peer_pull_blocks == 0 {
            return Err(Error::InvalidArgument(
                "gpu_peer_pull_blocks must be at least 1".into(),
            ));
        }
        if self.gpu_p2p_channels == 0 || self.gpu_p2p_channels > 64 {
            return Err(Error::InvalidArgument(format!(
                "gpu_p2p_channels={} must be in 1..=64",
                self.gpu_p2p_channels
            )));
        }
        if self.gpu_channel_bytes == 0 {
            return Err(Error::InvalidArgument(
                "gpu_channel_bytes must be at least 1".into(),
            ));
        }
        if self.slots == 0 || self.slot_bytes < 64 || !self.slot_bytes.is_multiple_of(64) {
            return Err(Error::InvalidArgument(format!(
                "slots={} slot_bytes={}: need at least one slot of a multiple of 64 bytes",
                self.slots, self.slot_bytes
            )));
        }
        // Bounds that keep every product below overflow (and a FIFO's size sane).
        if self.slots > MAX_SLOTS || self.slot_bytes > MAX_SLOT_BYTES {
            return Err(Error::InvalidArgument(format!(
                "slots={} slot_bytes={}: at most {MAX_SLOTS} slots of at most {MAX_SLOT_BYTES} bytes",
                self.slots, self.slot_bytes
            )));
        }
        if !(1..=MAX_GPU_SLOTS).contains(&self.gpu_slots) {
            return Err(Error::InvalidArgument(format!(
                "gpu_slots={} must be 1 to {MAX_GPU_SLOTS}",
                self.gpu_slots
            )));
        }
        let fifo = self.slots * self.slot_bytes;
        if self.chunk_bytes == 0 || self.chunk_bytes.saturating_mul(PLAN_FIFO_MESSAGES) > fifo {
            return Err(Error::InvalidArgument(format!(
                "chunk_bytes={} must be in 1..=slots*slot_bytes/{PLAN_FIFO_MESSAGES}={} (a FIFO must hold {PLAN_FIFO_MESSAGES} chunks)",
                self.chunk_bytes,
                fifo / PLAN_FIFO_MESSAGES
            )));
        }
        if self.heartbeat_interval < Duration::from_millis(1) || self.heartbeat_misses == 0 {
            return Err(Error::InvalidArgument(format!(
                "heartbeat_interval={:?} must be at least 1 ms and heartbeat_misses={} at least 1",
                self.heartbeat_interval, self.heartbeat_misses
            )));
        }
        if self.gpu_peer_blocks > crate::tune::PEER_MAX_BLOCKS {
            return Err(Error::InvalidArgument(format!(
                "gpu_peer_blocks={} must be at most {} (0: by rank count)",
                self.gpu_peer_blocks,
                crate::tune::PEER_MAX_BLOCKS
            )));
        }
        for (name, v) in [
            ("gpu_fold_blocks", self.gpu_fold_blocks),
            ("gpu_fold_reduce_blocks", self.gpu_fold_reduce_blocks),
        ] {
            if !(1..=132).contains(&v) {
                return Err(Error::InvalidArgument(format!(
                    "{name}={v} must be 1 to 132"
                )));
            }
        }
        for (name, v) in [
            ("gpu_fold_piece_bytes", self.gpu_fold_piece_bytes),
            ("gpu_fold_tail_bytes", self.gpu_fold_tail_bytes),
        ] {
            if v < (64 << 10) || !v.is_multiple_of(4096) {
                return Err(Error::InvalidArgument(format!(
                    "{name}={v} must be a multiple of 4096, at least 65536"
                )));
            }
        }
        for (name, v) in [
            ("gpu_fold_ramp", self.gpu_fold_ramp),
            ("gpu_fold_reduce_ramp", self.gpu_fold_reduce_ramp),
        ] {
            if !(110..=400).contains(&v) {
                return Err(Error::InvalidArgument(format!(
                    "{name}={v} must be 110 to 400 (per cent)"
                )));
            }
        }
        if self.gpu_peer_block_bytes == 0 {
            return Err(Error::InvalidArgument(
                "gpu_peer_block_bytes must be at least 1".into(),
            ));
        }
        if self.gpu_peer_bytes > MAX_GPU_PEER_BYTES {
            return Err(Error::InvalidArgument(format!(
                "gpu_peer_bytes={} must be at most {MAX_GPU_PEER_BYTES}",
                self.gpu_peer_bytes
            )));
        }
        if self.max_bootstrap_msg < 4096 {
            return Err(Error::InvalidArgument(
                "max_bootstrap_msg must be at least 4096 bytes".into(),
            ));
        }
        Ok(())
    }
}

/// Compares every rank's [`Config::encode_shared`] bytes (`all[r]` from rank r): an argument
/// error naming each knob the ranks set differently, with every value and the ranks holding it.
/// Every rank compares the same bytes, so every rank fails alike, or none does.
pub fn compare_shared(all: &[Vec<u8>]) -> Result<(), Error> {
    let parse = |b: &[u8]| -> Option<Vec<(String, String)>> {
        let text = std::str::from_utf8(b).ok()?;
        text.lines()
            .map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect()
    };
    let parsed: Vec<Option<Vec<(String, String)>>> = all.iter().map(|b| parse(b)).collect();
    if let Some(r) = parsed.iter().position(|p| p.is_none()) {
        return Err(Error::Protocol(format!(
            "rank {r} sent unreadable settings at communicator creation"
        )));
    }
    let parsed: Vec<Vec<(String, String)>> =
        parsed.into_iter().map(|p| p.expect("checked")).collect();
    let mut diffs = Vec::new();
    // Every name any rank sent (a rank of another build may know a knob the others do not: that
    // is a disagreement too, "(not sent)" against a value), in first-seen order.
    let mut names: Vec<&String> = Vec::new();
    for (k, _) in parsed.iter().flatten() {
        if !names.contains(&k) {
            names.push(k);
        }
    }
    for name in names {
        let value = |p: &Vec<(String, String)>| {
            p.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| "(not sent)".into())
        };
        let values: Vec<String> = parsed.iter().map(value).collect();
        if values.iter().all(|v| *v == values[0]) {
            continue;
        }
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for (r, v) in values.into_iter().enumerate() {
            match groups.iter_mut().find(|(x, _)| *x == v) {
                Some((_, rs)) => rs.push(r),
                None => groups.push((v, vec![r])),
            }
        }
        let said: Vec<String> = groups
            .iter()
            .map(|(v, rs)| format!("{v} on rank(s) {rs:?}"))
            .collect();
        diffs.push(format!("{name}: {}", said.join(", ")));
    }
    if diffs.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "the ranks disagree on settings that every rank must set alike (docs/ENV.md): {}",
        diffs.join("; ")
    )))
}

/// What a launcher (torchrun, mpirun, `ferroccl run`) tells each process about the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank (RANK).
    pub rank: usize,
    /// Ranks in the job (WORLD_SIZE).
    pub world_size: usize,
    /// This process's rank on its host (LOCAL_RANK): its GPU.
    pub local_rank: usize,
    /// Where rank 0 runs the rendezvous (MASTER_ADDR / FERROCCL_MASTER_ADDR).
    pub master_addr: String,
    /// The rendezvous port (MASTER_PORT / FERROCCL_MASTER_PORT).
    pub master_port: u16,
    /// Which launcher's variables were found, for messages.
    pub source: &'static str,
}

impl LaunchEnv {
    /// The job as this process's environment describes it (see `from_vars`).
    pub fn from_env() -> Result<Option<LaunchEnv>, Error> {
        LaunchEnv::from_vars(&std::env::vars().collect())
    }

    /// `Ok(None)` when no launcher variables are present; an error when they are present but
    /// incomplete or inconsistent.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Option<LaunchEnv>, Error> {
        let get = |k: &str| {
            vars.get(k)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let (rank_k, size_k, local_k, source) =
            if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
                // `ferroccl run` sets torchrun's variables and says so.
                let who = if get("FERROCCL_LAUNCHER").as_deref() == Some("ferroccl run") {
                    "ferroccl run"
                } else {
                    "torchrun"
                };
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", who)
            } else if get("OMPI_COMM_WORLD_RANK").is_some() {
                (
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "mpirun",
                )
            } else {
                return Ok(None);
            };
        let need = |k: &str| {
            get(k).ok_or_else(|| {
                Error::InvalidArgument(format!("{source} environment: {k} is not set"))
            })
        };
        let rank: usize = parse(rank_k, &need(rank_k)?)?;
        let world_size: usize = parse(size_k, &need(size_k)?)?;
        let local_rank: usize = match get(local_k) {
            Some(v) => parse(local_k, &v)?,
            None => 0,
        };
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "{source} environment: {rank_k}={rank} is not below {size_k}={world_size}"
            )));
        }
        let master_addr = get("MASTER_ADDR")
            .or_else(|| get("FERROCCL_MASTER_ADDR"))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{source} environment: MASTER_ADDR (or FERROCCL_MASTER_ADDR) is not set"
                ))
            })?;
        let (port_k, port_s) = ["MASTER_PORT", "FERROCCL_MASTER_PORT"]
            .into_iter()
            .find_map(|k| get(k).map(|v| (k, v)))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{source} environment: MASTER_PORT (or FERROCCL_MASTER_PORT) is not set"
                ))
            })?;
        let master_port = parse_master_port(port_k, &port_s)
            .map_err(|m| Error::InvalidArgument(format!("{source} environment: {m}")))?;
        Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            source,
        }))
    }
}

/// The rendezvous port: one every rank can connect to. Port 0 would have rank 0 listen on a
/// port of the kernel's choosing that no other rank is told, so the job would only fail at
/// its deadline; it is refused here instead.
fn parse_master_port(key: &str, v: &str) -> Result<u16, String> {
    let want = "give the fixed TCP port (1-65535) that rank 0 listens on for the rendezvous, the same on every rank (e.g. 29500)";
    match v.parse::<u64>() {
        Err(_) => Err(format!("{key}='{v}' is not a port number: {want}")),
        Ok(0) => Err(format!(
            "{key}=0 asks for any free port, which rank 0 could listen on but no other rank would know to connect to: {want}"
        )),
        Ok(p) => u16::try_from(p).map_err(|_| format!("{key}={p} is above 65535, the largest TCP port: {want}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/ENV.md's list of the settings every rank must set alike names every one the ranks
    /// compare (`shared_settings`), so that a new shared knob cannot go undocumented there.
    #[test]
    fn the_env_docs_list_every_shared_setting() {
        let doc = include_str!("../../../docs/ENV.md");
        let at = doc
            .find("Every rank of a communicator must set these alike")
            .expect("the list");
        let list = &doc[at..at + doc[at..].find("\n\n").expect("its end")];
        for (key, _) in Config::default().shared_settings() {
            assert!(
                list.contains(&format!("`{key}`")),
                "{key} is not in docs/ENV.md's list"
            );
        }
    }

    /// Whether `c` gives its peers `key` with `value` to agree on.
    fn shares(c: &Config, key: &str, value: &str) -> bool {
        c.shared_settings()
            .iter()
            .any(|(k, v)| *k == key && v == value)
    }

    fn vars(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn p2p_channels_and_kernel_defines() {
        let c = Config::from_vars(&vars(&[("FERROCCL_GPU_P2P_CHANNELS", "32")])).unwrap();
        assert_eq!(
            (c.gpu_p2p_channels, Config::default().gpu_p2p_channels),
            (32, 32)
        );
        assert_eq!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_P2P_CHANNELS", "8")]))
                .unwrap()
                .gpu_p2p_channels,
            8
        );
        for bad in ["0", "65", "x"] {
            assert!(
                Config::from_vars(&vars(&[("FERROCCL_GPU_P2P_CHANNELS", bad)])).is_err(),
                "{bad}"
            );
        }
        // A rank with other p2p channels builds other plans: the knob must be compared.
        assert!(shares(&c, "FERROCCL_GPU_P2P_CHANNELS", "32"));
        let t = Config::from_vars(&vars(&[("FERROCCL_GPU_TWO_SHOT", "1")])).unwrap();
        assert!(t.gpu_two_shot && !Config::default().gpu_two_shot);
        assert!(shares(&t, "FERROCCL_GPU_TWO_SHOT", "1"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_TWO_SHOT", "sometimes")])).is_err());
        let p = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_BYTES", "0")])).unwrap();
        assert_eq!(
            (p.gpu_peer_bytes, Config::default().gpu_peer_bytes),
            (0, 32 << 20)
        );
        assert!(shares(&p, "FERROCCL_GPU_PEER_BYTES", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_BYTES", "2147483648")])).is_err());
        let split = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_SPLIT", "1")])).unwrap();
        assert_eq!(
            (split.gpu_peer_split, Config::default().gpu_peer_split),
            (Some(true), None)
        );
        let off = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_SPLIT", "0")])).unwrap();
        assert_eq!(off.gpu_peer_split, Some(false));
        assert_eq!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_SPLIT", "auto")]))
                .unwrap()
                .gpu_peer_split,
            None
        );
        assert!(shares(
            &Config::default(),
            "FERROCCL_GPU_PEER_SPLIT",
            "auto"
        ));
        assert!(shares(&split, "FERROCCL_GPU_PEER_SPLIT", "1"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_SPLIT", "half")])).is_err());
        let read = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_READ", "1")])).unwrap();
        assert_eq!(
            (read.gpu_peer_read, Config::default().gpu_peer_read),
            (Some(true), None)
        );
        let unread = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_READ", "0")])).unwrap();
        assert_eq!(unread.gpu_peer_read, Some(false));
        assert!(shares(&Config::default(), "FERROCCL_GPU_PEER_READ", "auto"));
        assert!(shares(&unread, "FERROCCL_GPU_PEER_READ", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_READ", "pull")])).is_err());
        // A bounded wait, so not among the settings every rank must share.
        let wait = Config::from_vars(&vars(&[(
            "FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES",
            "4194304",
        )]))
        .unwrap();
        assert_eq!(wait.gpu_peer_wait_posts_min_bytes, 4 << 20);
        assert!(!shares(
            &wait,
            "FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES",
            "4194304"
        ));
        assert!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES", "4M")])).is_err()
        );
        let pb = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_BLOCKS", "16")])).unwrap();
        assert_eq!(
            (pb.gpu_peer_blocks, Config::default().gpu_peer_blocks),
            (16, 0)
        );
        assert!(shares(&pb, "FERROCCL_GPU_PEER_BLOCKS", "16"));
        let err = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_BLOCKS", "129")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gpu_peer_blocks=129") && err.contains("at most 128"),
            "{err}"
        );
        let bb = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_BLOCK_BYTES", "32768")])).unwrap();
        assert_eq!(
            (
                bb.gpu_peer_block_bytes,
                Config::default().gpu_peer_block_bytes
            ),
            (32 << 10, 8 << 10)
        );
        assert!(shares(&bb, "FERROCCL_GPU_PEER_BLOCK_BYTES", "32768"));
        let round =
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_ROUND_BYTES", "16384")])).unwrap();
        assert_eq!(
            (
                round.gpu_peer_round_bytes,
                Config::default().gpu_peer_round_bytes
            ),
            (16 << 10, 0)
        );
        assert!(shares(&round, "FERROCCL_GPU_PEER_ROUND_BYTES", "16384"));
        let pull = Config::from_vars(&vars(&[
            ("FERROCCL_GPU_PEER_PULL_MIN_BYTES", "4096"),
            ("FERROCCL_GPU_PEER_PULL_MAX_BYTES", "0"),
        ]))
        .unwrap();
        assert_eq!(
            (
                pull.gpu_peer_pull_min_bytes,
                pull.gpu_peer_pull_max_bytes,
                Config::default().gpu_peer_pull_min_bytes,
                Config::default().gpu_peer_pull_max_bytes
            ),
            (
                4096,
                0,
                crate::tune::PEER_PULL_MIN_BYTES,
                crate::tune::PEER_PULL_MAX_BYTES
            )
        );
        assert!(shares(&pull, "FERROCCL_GPU_PEER_PULL_MIN_BYTES", "4096"));
        assert!(shares(&pull, "FERROCCL_GPU_PEER_PULL_MAX_BYTES", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_PULL_MAX_BYTES", "lots")])).is_err());
        let reduce_pull =
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES", "0")])).unwrap();
        assert_eq!(
            (
                reduce_pull.gpu_peer_pull_reduce_min_bytes,
                Config::default().gpu_peer_pull_reduce_min_bytes
            ),
            (0, crate::tune::PEER_PULL_REDUCE_MIN_BYTES)
        );
        assert!(shares(
            &reduce_pull,
            "FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES",
            "0"
        ));
        assert!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES", "-1")])).is_err()
        );
        let blocks = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_PULL_BLOCKS", "64")])).unwrap();
        assert_eq!(
            (
                blocks.gpu_peer_pull_blocks,
                Config::default().gpu_peer_pull_blocks
            ),
            (64, crate::tune::PEER_PULL_BLOCKS)
        );
        assert!(shares(&blocks, "FERROCCL_GPU_PEER_PULL_BLOCKS", "64"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_PULL_BLOCKS", "0")])).is_err());
        let lines =
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_LINES_MAX_BYTES", "65536")])).unwrap();
        assert_eq!(
            (
                lines.gpu_peer_lines_max_bytes,
                Config::default().gpu_peer_lines_max_bytes
            ),
            (64 << 10, crate::tune::PEER_LINES_MAX_BYTES)
        );
        assert!(shares(&lines, "FERROCCL_GPU_PEER_LINES_MAX_BYTES", "65536"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_LINES_MAX_BYTES", "-1")])).is_err());
        let fold = Config::from_vars(&vars(&[
            ("FERROCCL_GPU_FOLD_BLOCKS", "64"),
            ("FERROCCL_GPU_FOLD_PIECE_BYTES", "33554432"),
            ("FERROCCL_GPU_FOLD_TAIL_BYTES", "1048576"),
            ("FERROCCL_GPU_FOLD_RAMP", "200"),
        ]))
        .unwrap();
        assert_eq!(
            (
                fold.gpu_fold_blocks,
                fold.gpu_fold_piece_bytes,
                fold.gpu_fold_tail_bytes,
                fold.gpu_fold_ramp
            ),
            (64, 32 << 20, 1 << 20, 200)
        );
        let min = Config::from_vars(&vars(&[("FERROCCL_GPU_FOLD_MIN_BYTES", "0")])).unwrap();
        assert_eq!(
            (min.gpu_fold_min_bytes, Config::default().gpu_fold_min_bytes),
            (0, 512 << 20)
        );
        assert!(shares(&min, "FERROCCL_GPU_FOLD_MIN_BYTES", "0"));
        // The reduce's own: its blocks each rank's, its ramp and threshold shared.
        let reduce = Config::from_vars(&vars(&[
            ("FERROCCL_GPU_FOLD_REDUCE_BLOCKS", "48"),
            ("FERROCCL_GPU_FOLD_REDUCE_RAMP", "160"),
            ("FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES", "0"),
        ]))
        .unwrap();
        let d = Config::default();
        assert_eq!(
            (
                reduce.gpu_fold_reduce_blocks,
                reduce.gpu_fold_reduce_ramp,
                reduce.gpu_fold_reduce_min_bytes,
                reduce.gpu_fold_blocks
            ),
            (48, 160, 0, d.gpu_fold_blocks)
        );
        assert_eq!(
            (
                d.gpu_fold_reduce_blocks,
                d.gpu_fold_reduce_ramp,
                d.gpu_fold_reduce_min_bytes
            ),
            (32, 140, 512 << 20)
        );
        assert!(shares(&reduce, "FERROCCL_GPU_FOLD_REDUCE_RAMP", "160"));
        assert!(shares(&reduce, "FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES", "0"));
        assert!(!reduce
            .shared_settings()
            .iter()
            .any(|(k, _)| *k == "FERROCCL_GPU_FOLD_REDUCE_BLOCKS"));
        // The pieces are every rank's alike, the blocks each rank's own.
        assert!(shares(&fold, "FERROCCL_GPU_FOLD_PIECE_BYTES", "33554432"));
        assert!(shares(&fold, "FERROCCL_GPU_FOLD_TAIL_BYTES", "1048576"));
        assert!(shares(&fold, "FERROCCL_GPU_FOLD_RAMP", "200"));
        assert!(!fold
            .shared_settings()
            .iter()
            .any(|(k, _)| *k == "FERROCCL_GPU_FOLD_BLOCKS"));
        for (k, v) in [
            ("FERROCCL_GPU_FOLD_BLOCKS", "0"),
            ("FERROCCL_GPU_FOLD_BLOCKS", "133"),
            ("FERROCCL_GPU_FOLD_PIECE_BYTES", "4096"),
            ("FERROCCL_GPU_FOLD_PIECE_BYTES", "65537"),
            ("FERROCCL_GPU_FOLD_TAIL_BYTES", "4096"),
            ("FERROCCL_GPU_FOLD_TAIL_BYTES", "65537"),
            ("FERROCCL_GPU_FOLD_RAMP", "109"),
            ("FERROCCL_GPU_FOLD_RAMP", "401"),
            ("FERROCCL_GPU_FOLD_REDUCE_BLOCKS", "0"),
            ("FERROCCL_GPU_FOLD_REDUCE_BLOCKS", "133"),
            ("FERROCCL_GPU_FOLD_REDUCE_RAMP", "109"),
            ("FERROCCL_GPU_FOLD_REDUCE_RAMP", "401"),
        ] {
            let err = Config::from_vars(&vars(&[(k, v)])).unwrap_err().to_string();
            assert!(err.contains("gpu_fold"), "{k}={v}: {err}");
        }
        let err = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_BLOCK_BYTES", "0")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpu_peer_block_bytes"), "{err}");
        let from = Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_FROM_BYTES", "262144")])).unwrap();
        assert_eq!(
            (
                from.gpu_peer_from_bytes,
                Config::default().gpu_peer_from_bytes
            ),
            (256 << 10, 128 << 10)
        );
        assert!(shares(&from, "FERROCCL_GPU_PEER_FROM_BYTES", "262144"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_FROM_BYTES", "-1")])).is_err());
        let one =
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES", "0")])).unwrap();
        assert_eq!(
            (
                one.gpu_peer_oneshot_max_bytes,
                Config::default().gpu_peer_oneshot_max_bytes
            ),
            (0, PEER_ONESHOT_MAX_BYTES)
        );
        assert!(shares(&one, "FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES", "0"));
        assert!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES", "4M")])).is_err()
        );
        let rooted =
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_ROOTED_MAX_BYTES", "0")])).unwrap();
        assert_eq!(
            (
                rooted.gpu_peer_rooted_max_bytes,
                Config::default().gpu_peer_rooted_max_bytes
            ),
            (0, PEER_ROOTED_MAX_BYTES)
        );
        assert!(shares(&rooted, "FERROCCL_GPU_PEER_ROOTED_MAX_BYTES", "0"));
        assert!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_PEER_ROOTED_MAX_BYTES", "")]))
                .is_ok_and(|c| c.gpu_peer_rooted_max_bytes == PEER_ROOTED_MAX_BYTES)
        );
        let ce =
            Config::from_vars(&vars(&[("FERROCCL_GPU_COPY_ENGINE_BYTES", "8388608")])).unwrap();
        assert_eq!(
            (
                ce.gpu_copy_engine_bytes,
                Config::default().gpu_copy_engine_bytes
            ),
            (8 << 20, 0)
        );
        assert!(shares(&ce, "FERROCCL_GPU_COPY_ENGINE_BYTES", "8388608"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_COPY_ENGINE_BYTES", "lots")])).is_err());
        let cw = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_WINDOW_BYTES", "0")])).unwrap();
        assert_eq!(
            (
                cw.gpu_ce_window_bytes,
                Config::default().gpu_ce_window_bytes
            ),
            (0, 32 << 20)
        );
        assert!(shares(&cw, "FERROCCL_GPU_CE_WINDOW_BYTES", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_CE_WINDOW_BYTES", "-1")])).is_err());
        let cr = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_RENDEZVOUS_BYTES", "0")])).unwrap();
        assert_eq!(
            (
                cr.gpu_ce_rendezvous_bytes,
                Config::default().gpu_ce_rendezvous_bytes
            ),
            (0, 32 << 20)
        );
        assert!(shares(&cr, "FERROCCL_GPU_CE_RENDEZVOUS_BYTES", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_CE_RENDEZVOUS_BYTES", "x")])).is_err());
        let cg = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_GATHER_BYTES", "0")])).unwrap();
        assert_eq!(
            (
                cg.gpu_ce_gather_bytes,
                Config::default().gpu_ce_gather_bytes
            ),
            (0, 128 << 20)
        );
        assert!(shares(&cg, "FERROCCL_GPU_CE_GATHER_BYTES", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_CE_GATHER_BYTES", "1M")])).is_err());
        let cb = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_BROADCAST_BYTES", "1")])).unwrap();
        assert_eq!(
            (
                cb.gpu_ce_broadcast_bytes,
                Config::default().gpu_ce_broadcast_bytes
            ),
            (1, 64 << 20)
        );
        assert!(shares(&cb, "FERROCCL_GPU_CE_BROADCAST_BYTES", "1"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_CE_BROADCAST_BYTES", "-3")])).is_err());
        let cp = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_P2P_BYTES", "1")])).unwrap();
        assert_eq!(
            (cp.gpu_ce_p2p_bytes, Config::default().gpu_ce_p2p_bytes),
            (1, 16 << 20)
        );
        assert!(shares(&cp, "FERROCCL_GPU_CE_P2P_BYTES", "1"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_CE_P2P_BYTES", "-4")])).is_err());
        let cm = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_MAP_UNREGISTERED", "0")])).unwrap();
        assert!(!cm.gpu_ce_map_unregistered && Config::default().gpu_ce_map_unregistered);
        assert!(shares(&cm, "FERROCCL_GPU_CE_MAP_UNREGISTERED", "0"));
        assert!(
            Config::from_vars(&vars(&[("FERROCCL_GPU_CE_MAP_UNREGISTERED", "maybe")])).is_err()
        );
        let ci = Config::from_vars(&vars(&[("FERROCCL_GPU_CE_IN_PROCESS", "0")])).unwrap();
        assert!(!ci.gpu_ce_in_process && Config::default().gpu_ce_in_process);
        assert!(shares(&ci, "FERROCCL_GPU_CE_IN_PROCESS", "0"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_CE_IN_PROCESS", "2")])).is_err());
        let wi = Config::from_vars(&vars(&[("FERROCCL_GPU_WINDOWS_IN_PROCESS", "1")])).unwrap();
        assert!(wi.gpu_windows_in_process && !Config::default().gpu_windows_in_process);
        assert!(shares(&wi, "FERROCCL_GPU_WINDOWS_IN_PROCESS", "1"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_WINDOWS_IN_PROCESS", "y")])).is_err());
        let fe = Config::from_vars(&vars(&[("FERROCCL_GPU_FOLD_EVERY_TYPE", "1")])).unwrap();
        assert!(fe.gpu_fold_every_type && !Config::default().gpu_fold_every_type);
        assert!(shares(&fe, "FERROCCL_GPU_FOLD_EVERY_TYPE", "1"));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_FOLD_EVERY_TYPE", "2")])).is_err());
        let early = Config::from_vars(&vars(&[("FERROCCL_GPU_EARLY_LAUNCH", "0")])).unwrap();
        assert!(!early.gpu_early_launch && Config::default().gpu_early_launch);
        // How a launch starts changes no plan: ranks may differ.
        assert!(!early
            .shared_settings()
            .iter()
            .any(|(k, _)| k.contains("EARLY")));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_EARLY_LAUNCH", "soon")])).is_err());
        let plain = Config::from_vars(&vars(&[("FERROCCL_GPU_P2P_KERNEL", "0")])).unwrap();
        assert!(!plain.gpu_p2p_kernel && Config::default().gpu_p2p_kernel);
        // Both kernels speak the same protocol on the same connections: ranks may differ.
        assert!(!plain
            .shared_settings()
            .iter()
            .any(|(k, _)| k.contains("P2P_KERNEL")));
        assert!(Config::from_vars(&vars(&[("FERROCCL_GPU_P2P_KERNEL", "maybe")])).is_err());
        let spin = Config::from_vars(&vars(&[("FERROCCL_LAUNCH_SPIN_US", "0")])).unwrap();
        assert_eq!(
            (spin.launch_spin_us, Config::default().launch_spin_us),
            (0, 200)
        );
        // Who makes a launch changes no byte: ranks may differ.
        assert!(!spin
            .shared_settings()
            .iter()
            .any(|(k, _)| k.contains("SPIN")));
        assert!(Config::from_vars(&vars(&[("FERROCCL_LAUNCH_SPIN_US", "-1")])).is_err());
        let d = Config::from_vars(&vars(&[(
            "FERROCCL_KERNEL_DEFINES",
            " FC_COPY_UNROLL=8 ,FC_X ",
        )]))
        .unwrap();
        assert_eq!(
            d.kernel_defines,
            vec!["-DFC_COPY_UNROLL=8".to_string(), "-DFC_X".to_string()]
        );
        // Speed only: not a setting ranks must share.
        assert!(!d
            .shared_settings()
            .iter()
            .any(|(k, _)| k.contains("DEFINES")));
        for bad in ["A=1 --use_fast_math", "1A=2", "A=$(x)", "A=1;B", "=3"] {
            let e = Config::from_vars(&vars(&[("FERROCCL_KERNEL_DEFINES", bad)])).unwrap_err();
            assert!(
                e.message().contains("FERROCCL_KERNEL_DEFINES"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn env_overrides_defaults() {
        let c = Config::from_vars(&vars(&[
            ("FERROCCL_TIMEOUT", "2.5"),
            ("FERROCCL_TRANSPORT", "tcp"),
            ("FERROCCL_CHANNELS", "3"),
        ]))
        .unwrap();
        assert_eq!(c.ll_max_bytes, 512 << 10);
        assert_eq!(
            Config::from_vars(&vars(&[("FERROCCL_LL_MAX_BYTES", "0")]))
                .unwrap()
                .ll_max_bytes,
            0
        );
        assert_eq!(
            Config::from_vars(&vars(&[("FERROCCL_DIRECT_MAX_BYTES", "4096")]))
                .unwrap()
                .direct_max_bytes,
            4096
        );
        assert!(Config::from_vars(&vars(&[("FERROCCL_LL_MAX_BYTES", "-1")])).is_err());
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.transport, TransportChoice::Tcp);
        assert_eq!(c.channels, 3);
        assert!(Config::from_vars(&vars(&[("FERROCCL_TIMEOUT", "-1")])).is_err());
        assert!(Config::from_vars(&vars(&[("FERROCCL_TRANSPORT", "carrier-pigeon")])).is_err());
        assert!(Config::from_vars(&vars(&[("FERROCCL_CHUNK_BYTES", "999999999")])).is_err());
        let h = Config::from_vars(&vars(&[
            ("FERROCCL_HEARTBEAT_INTERVAL", "0.25"),
            ("FERROCCL_HEARTBEAT_MISSES", "3"),
        ]))
        .unwrap();
        assert_eq!(
            (h.heartbeat_interval, h.heartbeat_misses),
            (Duration::from_millis(250), 3)
        );
        assert!(Config::from_vars(&vars(&[("FERROCCL_HEARTBEAT_INTERVAL", "0")])).is_err());
        assert!(Config::from_vars(&vars(&[("FERROCCL_HEARTBEAT_MISSES", "0")])).is_err());
        // Found by the environment fuzzer: products of huge values overflowed (a panic).
        let max = usize::MAX.to_string();
        for k in [
            "FERROCCL_CHUNK_BYTES",
            "FERROCCL_SLOTS",
            "FERROCCL_SLOT_BYTES",
        ] {
            assert!(Config::from_vars(&vars(&[(k, &max)])).is_err(), "{k}");
        }
        let c = Config::from_vars(&vars(&[
            ("FERROCCL_CHECK_MISMATCH", "on"),
            ("FERROCCL_TCP_CRC", "1"),
        ]))
        .unwrap();
        assert!(c.check_mismatch && c.tcp_crc);
        let e = Config::from_vars(&vars(&[("FERROCCL_TCP_CRC", "maybe")])).unwrap_err();
        assert!(e.message().contains("FERROCCL_TCP_CRC='maybe'"), "{e}");
        let e = Config::from_vars(&vars(&[("FERROCCL_TRANSPORT", "rdma")])).unwrap_err();
        assert!(e.message().contains("FERROCCL_TRANSPORT"), "{e}");
    }

    #[test]
    fn ranks_that_disagree_on_a_shared_knob_are_told_which_and_how() {
        let base = Config::default();
        let same = vec![base.encode_shared(); 4];
        assert!(compare_shared(&same).is_ok());
        let mut all = same.clone();
        all[0] = Config {
            chunk_bytes: 131072,
            ..base.clone()
        }
        .encode_shared();
        all[2] = Config {
            heartbeat_interval: Duration::from_millis(50),
            ..base.clone()
        }
        .encode_shared();
        let e = compare_shared(&all).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(
            m.contains("FERROCCL_CHUNK_BYTES: 131072 on rank(s) [0], 262144 on rank(s) [1, 2, 3]"),
            "{m}"
        );
        assert!(
            m.contains(
                "FERROCCL_HEARTBEAT_INTERVAL: 0.5 on rank(s) [0, 1, 3], 0.05 on rank(s) [2]"
            ),
            "{m}"
        );
        // What may differ does not count.
        let local = Config {
            timeout: Duration::from_secs(3),
            bootstrap_addr: Some("10.0.0.1".into()),
            ..base.clone()
        };
        assert!(compare_shared(&[base.encode_shared(), local.encode_shared()]).is_ok());
        // Every knob named is one the environment sets, and each changes the bytes.
        for (k, _) in base.shared_settings() {
            assert!(k.starts_with("FERROCCL_"), "{k}");
        }
        assert!(compare_shared(&[base.encode_shared(), b"\xff\xfe".to_vec()]).is_err());
        // A rank of an older build, which does not send a knob the others do, disagrees on it
        // whichever rank it is (rank 0's list of names is not the only one read).
        let newer = String::from_utf8(base.encode_shared()).unwrap();
        let older: String = newer
            .lines()
            .filter(|l| !l.starts_with("FERROCCL_GPU_PEER_BLOCKS="))
            .map(|l| format!("{l}\n"))
            .collect();
        for pair in [
            [older.clone(), newer.clone()],
            [newer.clone(), older.clone()],
        ] {
            let e = compare_shared(&pair.map(String::into_bytes))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("FERROCCL_GPU_PEER_BLOCKS") && e.contains("(not sent)"),
                "{e}"
            );
        }
    }

    #[test]
    fn secret_parses_only_32_hex_digits() {
        let s = parse_secret("00112233445566778899aabbccddeeff").unwrap();
        assert_eq!(s[0], 0x00);
        assert_eq!(s[15], 0xff);
        assert_eq!(format_secret(&s), "00112233445566778899aabbccddeeff");
        assert!(parse_secret("0011").is_err());
        assert!(parse_secret("zz112233445566778899aabbccddeeff").is_err());
    }

    #[test]
    fn launcher_environments() {
        assert_eq!(LaunchEnv::from_vars(&vars(&[])).unwrap(), None);
        let t = LaunchEnv::from_vars(&vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.master_port, t.source),
            (2, 4, 2, 29500, "torchrun")
        );
        let f = LaunchEnv::from_vars(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("FERROCCL_LAUNCHER", "ferroccl run"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(f.source, "ferroccl run");
        let m = LaunchEnv::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((m.rank, m.world_size, m.source), (1, 2, "mpirun"));
        assert!(LaunchEnv::from_vars(&vars(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1")
        ]))
        .is_err());
        assert!(LaunchEnv::from_vars(&vars(&[("RANK", "0"), ("WORLD_SIZE", "4")])).is_err());
    }

    /// A port no rank can connect to is refused when the environment is read, naming the
    /// variable, instead of failing every rank at its deadline.
    #[test]
    fn a_master_port_no_rank_can_connect_to_is_refused_at_once() {
        let with = |k: &str, v: &str| {
            LaunchEnv::from_vars(&vars(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                (k, v),
            ]))
            .map(|_| ())
            .unwrap_err()
            .to_string()
        };
        let e = with("MASTER_PORT", "0");
        assert!(
            e.contains("torchrun environment: MASTER_PORT=0 asks for any free port")
                && e.contains("no other rank would know"),
            "{e}"
        );
        assert!(with("FERROCCL_MASTER_PORT", " 0 ")
            .contains("FERROCCL_MASTER_PORT=0 asks for any free port"));
        let e = with("MASTER_PORT", "70000");
        assert!(
            e.contains("MASTER_PORT=70000 is above 65535, the largest TCP port"),
            "{e}"
        );
        for bad in ["abc", "-1", "29500x", "1.5"] {
            let e = with("MASTER_PORT", bad);
            assert!(
                e.contains(&format!(
                    "MASTER_PORT='{bad}' is not a port number: give the fixed TCP port (1-65535)"
                )),
                "{e}"
            );
        }
        assert_eq!(
            LaunchEnv::from_vars(&vars(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "65535")
            ]))
            .unwrap()
            .unwrap()
            .master_port,
            65535
        );
    }
}
