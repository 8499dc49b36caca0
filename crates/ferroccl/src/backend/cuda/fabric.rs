//! The GPU connections of one communicator: every rank's receive FIFOs and send counters,
//! made once at init in two cuMem allocations, mapped by every peer GPU (directly within one
//! process, through exported file descriptors across processes), and described to the kernel
//! as one table of `FcConn`.
//!
//! Layout on each GPU, for every (peer, channel): in the receive arena a FIFO of `slots` data
//! slots, their lengths, `head` (written by the sender over NVLink) and `consumed` (ours); in
//! the send arena `tail` and the zero-copy post (written by the receiver over NVLink) and
//! `produced` (ours). Each word
//! has its own 128-byte line so that remote writes never share a line with local spins.

use super::comm::Status;
use super::mapper::Place;
use super::tables::{
    FcConn, FcDirect, FcPeer, CONN_RECV, CONN_SEND, DIRECT_MAX_BLOCKS, DIRECT_MAX_RANKS,
    DIRECT_SLOT_BYTES, LL_DATA_BYTES, PEER_MAX_BLOCKS, PEER_PHASES,
};
use crate::bootstrap::Bootstrap;
use crate::cuda::device::Gpu;
use crate::cuda::fdpass::{FdChannel, FdListener};
use crate::cuda::hostpage::HostPage;
use crate::cuda::mem::{DeviceBuffer, MemStats};
use ferroccl_core::plan::lanes::CeFlags;
use ferroccl_core::plan::{ConnKey, Dir, P2P_CHANNEL_BASE};
use ferroccl_core::tune::{ce_slot_bytes, channel_budget, peer_blocks, peer_slot_bytes, Device};
use ferroccl_core::{Config, Error, Rank};
use std::os::fd::AsFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

const LINE: usize = 128;

/// Where things are inside one FIFO and one counter pair, and where the direct engine's slots
/// and words follow them in the two arenas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub slots: usize,
    pub slot_bytes: usize,
    /// Collective channels per peer; the point-to-point channels follow them.
    pub coll: usize,
    /// Channels per peer in all.
    pub nchan: usize,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// Bytes of one peer-engine slot (`tune::peer_slot_bytes`); 0: no peer engine.
    pub peer_slot: usize,
    /// Blocks the peer engine's staging is cut for (`tune::peer_blocks`).
    pub peer_blocks: usize,
}

impl Geometry {
    /// The layout of a communicator of `nranks` GPU ranks under `config`: FIFOs for the most
    /// channels the tuner may give an operation.
    pub fn of(config: &Config, nranks: usize) -> Geometry {
        let (coll, p2p) = channel_budget(Device::Gpu, config, nranks);
        Geometry {
            slots: config.gpu_slots,
            slot_bytes: config.slot_bytes,
            coll,
            nchan: coll + p2p,
            nranks,
            peer_slot: peer_slot_bytes(config, nranks),
            peer_blocks: peer_blocks(config, nranks),
        }
    }
    /// Whether the communicator has the direct engine's slots (few enough ranks).
    pub fn has_direct(&self) -> bool {
        self.nranks <= DIRECT_MAX_RANKS
    }
    /// The receive arena: a FIFO per other rank and channel (none for the arena's owner, which
    /// never sends to itself: with 2 ranks that halves the arena), then the direct slots
    /// [block][sender][parity] of two slot's worth of LL lines each.
    pub fn direct_slots_off(&self) -> usize {
        (self.nranks.saturating_sub(1) * self.nchan * self.fifo_stride()).div_ceil(LINE) * LINE
    }
    /// The FIFO for `of`'s messages on channel index `chan` in `owner`'s receive arena.
    pub fn fifo_index(&self, owner: Rank, of: Rank, chan: usize) -> usize {
        debug_assert!(owner != of, "no rank keeps a FIFO for itself");
        let q = if of < owner { of } else { of - 1 };
        q * self.nchan + chan
    }
    fn direct_slots_end(&self) -> usize {
        let direct = if self.has_direct() {
            DIRECT_MAX_BLOCKS * self.nranks * 2 * 2 * DIRECT_SLOT_BYTES
        } else {
            0
        };
        self.direct_slots_off() + direct
    }
    /// Whether the communicator has the peer engine's staging.
    pub fn has_peer(&self) -> bool {
        self.peer_slot > 0
    }
    /// Then the peer engine's staging: slots [sender other than the owner][block][parity][phase]
    /// for `peer_blocks` blocks,
    /// on a 4 KiB boundary (every slot 16-byte aligned for the vector stores). Each sender's
    /// slots are one region (`peer_region_bytes`): the copy engine's slots for that sender.
    pub fn peer_region_bytes(&self) -> usize {
        self.peer_blocks * 4 * self.peer_slot
    }
    /// Where the peer engine's staging starts.
    pub fn peer_stage_off(&self) -> usize {
        self.direct_slots_end().div_ceil(4096) * 4096
    }
    /// Then its flag lines [block][sender][phase], written by the senders (phase 2: the
    /// receivers' acknowledgements), 128 bytes each.
    pub fn peer_flags_off(&self) -> usize {
        self.peer_stage_off() + self.nranks.saturating_sub(1) * self.peer_region_bytes()
    }
    /// Then the copy-and-fold's piece words [sender][lane], a line per sender (written by the
    /// senders' copy lanes, polled by the owner's fold kernel): in GPU memory, where the kernel's
    /// polls stay local (polling the host page from many blocks slowed the copies 2-9 x on 2 x
    /// H200, docs/PERFORMANCE.md section 21).
    pub fn peer_fold_off(&self) -> usize {
        self.peer_flags_off() + PEER_MAX_BLOCKS * self.nranks * PEER_PHASES * LINE
    }
    pub fn recv_arena_bytes(&self) -> usize {
        if self.has_peer() {
            self.peer_fold_off() + self.nranks * LINE
        } else {
            self.direct_slots_end()
        }
    }
    /// The send arena: every counter pair, then the direct acks [block][receiver] (written by
    /// the receivers), then the epoch word of each block (ours).
    pub fn direct_acks_off(&self) -> usize {
        self.nranks * self.nchan * Self::COUNTER_STRIDE
    }
    pub fn direct_epochs_off(&self) -> usize {
        (self.direct_acks_off() + DIRECT_MAX_BLOCKS * self.nranks * 8).div_ceil(LINE) * LINE
    }
    fn direct_words_end(&self) -> usize {
        if self.has_direct() {
            self.direct_epochs_off() + DIRECT_MAX_BLOCKS * 8
        } else {
            self.direct_acks_off()
        }
    }
    /// Then the peer engine's round counter of each block (ours): one per slice for the blocks
    /// that send (or do both), then one per slice for a split launch's receive blocks, which
    /// must not read a counter their slice's send block of the same launch may have moved on.
    pub fn peer_seqs_off(&self) -> usize {
        self.direct_words_end().div_ceil(LINE) * LINE
    }
    /// Then the round each slice's send block of a split launch in place last stored (ours: its
    /// receive block waits for it before writing over the input the send block reads; the
    /// kernel finds it after the counters, `peer_sent_word` in `peer.cu`).
    pub fn peer_sent_off(&self) -> usize {
        self.peer_seqs_off() + 2 * PEER_MAX_BLOCKS * 8
    }
    pub fn send_arena_bytes(&self) -> usize {
        if self.has_peer() {
            self.peer_sent_off() + PEER_MAX_BLOCKS * 8
        } else {
            self.direct_words_end()
        }
    }
    /// Both arenas are one allocation, the send arena after the receive arena: memory comes in
    /// granules (2 MiB on the GPUs we know), so one allocation rounds up once where two did
    /// twice, and peers import one descriptor.
    pub fn send_arena_off(&self) -> usize {
        self.recv_arena_bytes().div_ceil(4096) * 4096
    }
    /// Bytes of the one allocation holding both arenas.
    pub fn arena_bytes(&self) -> usize {
        self.send_arena_off() + self.send_arena_bytes()
    }
    /// Bytes of the kernel's connection table: a send and a receive connection per rank and
    /// channel (none used for oneself).
    pub fn conn_table_bytes(&self) -> usize {
        self.nranks * self.nchan * 2 * std::mem::size_of::<FcConn>()
    }
    pub fn lens_off(&self) -> usize {
        self.slots * self.slot_bytes
    }
    pub fn head_off(&self) -> usize {
        (self.lens_off() + self.slots * 4).div_ceil(LINE) * LINE
    }
    pub fn consumed_off(&self) -> usize {
        self.head_off() + LINE
    }
    /// The LL slots (`slots` of `2 * LL_DATA_BYTES`): apart from the data slots, so that no
    /// simple-protocol payload left in a slot can pass for an LL flag.
    pub fn ll_off(&self) -> usize {
        self.consumed_off() + LINE
    }
    pub fn fifo_stride(&self) -> usize {
        self.ll_off() + self.slots * 2 * LL_DATA_BYTES
    }
    /// tail (written by the receiver), produced (ours), the zero-copy post (written by the
    /// receiver), each on its own line.
    pub const COUNTER_STRIDE: usize = 3 * LINE;
    pub const POST_OFF: usize = 2 * LINE;
    /// Slot of (peer, channel index) in either arena.
    pub fn index(&self, peer: Rank, chan: usize) -> usize {
        peer * self.nchan + chan
    }
    /// Channel index of a plan channel: collective channels first, point-to-point last.
    pub fn chan_index(&self, channel: u32) -> Option<usize> {
        let i = if channel >= P2P_CHANNEL_BASE {
            self.coll + (channel - P2P_CHANNEL_BASE) as usize
        } else if (channel as usize) < self.coll {
            channel as usize
        } else {
            return None;
        };
        (i < self.nchan).then_some(i)
    }
    /// Index of a connection in the kernel's table.
    pub fn conn_index(&self, key: ConnKey) -> Option<u32> {
        let c = self.chan_index(key.channel)?;
        let d = if key.dir == Dir::Send { 0 } else { 1 };
        u32::try_from(self.index(key.peer, c) * 2 + d).ok()
    }
}

/// Addresses of one rank's arenas as this process sees them.
#[derive(Clone, Copy, Debug, Default)]
struct Arenas {
    recv: u64,
    send: u64,
}

/// A failed arena allocation, explained: out of GPU memory names what the communicator needs
/// and the knobs that size it; any other failure is passed on as it is.
pub(crate) fn explain_alloc_failure(
    e: Error,
    geo: &Geometry,
    nranks: usize,
    ordinal: usize,
    need: usize,
) -> Error {
    if !e.message().contains("CUDA_ERROR_OUT_OF_MEMORY") {
        return e;
    }
    e.context(format!(
        "GPU {ordinal} has no room for this communicator's FIFOs: {need} bytes = {} peers x {} channels \
         (FERROCCL_GPU_CHANNELS={} plus {} point-to-point: FERROCCL_GPU_P2P_CHANNELS) x {} slots (FERROCCL_SLOTS) x {} bytes \
         (FERROCCL_SLOT_BYTES), plus counters, plus {} bytes of peer-engine staging (FERROCCL_GPU_PEER_BYTES). \
         Free GPU memory (other communicators, the framework's cache) or lower those knobs",
        nranks.saturating_sub(1), geo.nchan, geo.coll, geo.nchan - geo.coll, geo.slots, geo.slot_bytes,
        if geo.has_peer() { geo.peer_flags_off() - geo.peer_stage_off() } else { 0 }
    ))
}

pub(crate) struct Fabric {
    pub geo: Geometry,
    // Both arenas (`Geometry::send_arena_off`), mapped by the peers for the communicator's
    // life; only the kernel touches them.
    _arena: DeviceBuffer,
    /// Peers' arenas imported from other processes (kept mapped for the communicator's life).
    _imported: Vec<DeviceBuffer>,
    /// The FcConn table on the device (in the communicator's status allocation).
    pub table: u64,
    pub nconns: u32,
    /// The same table on the host: the point-to-point kernel's parameter carries its
    /// connections' addresses (`p2p.rs`).
    pub conns: Vec<FcConn>,
    /// The direct engine's slots, acks and epochs, for its kernel parameter (None: too many
    /// ranks for it).
    pub direct: Option<FcDirect>,
    /// The peer engine's staging, flags and counters, for its kernel parameter (None: off).
    pub peer: Option<FcPeer>,
    /// Every rank's staging and copy-engine flag page as this process addresses them, and
    /// this rank's page (None: the copy engine is off).
    pub ce: Option<CeFabric>,
    /// Where every rank runs (process, GPU), as each described itself here.
    pub places: Vec<Place>,
    /// Every rank's GPU and links carry the line rounds (`lines_carried`): the same on every
    /// rank. The peer engine's line rounds run only then.
    pub carries_lines: bool,
    /// `FERROCCL_GPU_CE_IN_PROCESS`: ranks sharing a process take the rendezvous paths where no
    /// two share a GPU (`ranks_post`).
    pub copies_in_process: bool,
    /// `FERROCCL_GPU_WINDOWS_IN_PROCESS`: such ranks take the paths between symmetric windows
    /// too (`ranks_window`).
    pub windows_in_process: bool,
}

/// `Fabric::ranks_post` of ranks at `places`: no two in one process, or (`in_process`) no two
/// of one process on one GPU.
fn ranks_post_at(places: &[Place], in_process: bool) -> bool {
    every_pair(places, |a, b| {
        a.pid != b.pid || (in_process && a.gpu != b.gpu)
    })
}

/// `Fabric::ranks_window` of ranks at `places`: as `ranks_post_at`, ranks of one process only
/// where both knobs let them.
fn ranks_window_at(places: &[Place], copies_in_process: bool, windows_in_process: bool) -> bool {
    ranks_post_at(places, copies_in_process && windows_in_process)
}

fn every_pair(p: &[Place], ok: impl Fn(&Place, &Place) -> bool) -> bool {
    (0..p.len()).all(|a| (a + 1..p.len()).all(|b| ok(&p[a], &p[b])))
}

/// What the copy engine needs of the fabric: where every rank's staging starts and how big
/// one sender's region is there, and every rank's flag page (device addresses of this
/// process), with the pages this process maps.
pub(crate) struct CeFabric {
    pub stage: Vec<u64>,
    /// Rank q's copy-and-fold piece words (`Geometry::peer_fold_off`), as this GPU maps them.
    pub fold: Vec<u64>,
    pub region_bytes: usize,
    pub pages: Vec<u64>,
    pub mine: HostPage,
    pub imported: Vec<HostPage>,
}

impl Fabric {
    /// Whether the copies between symmetric windows, and the pulls offered with them
    /// (`CudaComm::far_in`), may run: between windows no launch exchanges anything, each rank
    /// names its peers' buffers from the registration. Ranks apart (no two in one process), or
    /// (`FERROCCL_GPU_WINDOWS_IN_PROCESS` with `FERROCCL_GPU_CE_IN_PROCESS`) ranks of one process
    /// on distinct GPUs. The same on every rank.
    ///
    /// Off in one process by default: there nccl-tests `-R 2` (`-g 2`, `-t 2`) got every peer's
    /// block wrong from the first such copy or pull on, in about a quarter of its runs in session
    /// 15 and in 8 of 16 all-gather and broadcast runs and a reduce and an all-reduce run of two
    /// each in session 35 (2 x H200), where a process per GPU never did. The likely cause: the
    /// drop-in ran a group's two registrations of one communicator at once, crossing their
    /// pairing (`ferroccl-nccl`'s `group::run_colls` keeps their order since). The same
    /// nccl-tests on buffers nobody registered, whose copies and pulls follow a rendezvous at
    /// each launch ([`Self::ranks_post`]), were exact in all 36 runs.
    pub fn ranks_window(&self) -> bool {
        ranks_window_at(
            &self.places,
            self.copies_in_process,
            self.windows_in_process,
        )
    }

    /// Whether the paths that learn their peers' buffers at a rendezvous before each launch (the
    /// copies into posted outputs, the reduce's pull of a lent input, posted sends and
    /// receives) may run: ranks apart, or (`FERROCCL_GPU_CE_IN_PROCESS`, on by default) ranks
    /// of one process where no two share a GPU (a copy lane's wait could otherwise sit in a
    /// hardware queue in front of the stream its peer must run). The same on every rank.
    pub fn ranks_post(&self) -> bool {
        ranks_post_at(&self.places, self.copies_in_process)
    }

    /// `geo`: `Geometry::of(config, nranks)`, which the caller already needed.
    /// The connection table goes into `status`'s room for it.
    pub fn new(
        gpu: &Gpu,
        boot: &Bootstrap,
        config: &Config,
        geo: Geometry,
        stats: &Arc<MemStats>,
        abort: &AtomicBool,
        status: &Status,
    ) -> Result<Fabric, Error> {
        let (me, n) = (boot.rank(), boot.nranks());
        debug_assert_eq!(geo, Geometry::of(config, n));
        let need = geo.arena_bytes();
        let explain = |e: Error| explain_alloc_failure(e, &geo, n, gpu.ordinal(), need);
        let arena = DeviceBuffer::alloc(gpu, need, &[], stats).map_err(explain)?;
        let send_off = geo.send_arena_off() as u64;
        // Counters start at zero on both sides (the kernel's protocol assumes it).
        arena.copy_from_host(0, &vec![0u8; arena.len()])?;
        let deadline = Instant::now() + config.timeout;
        let listener = FdListener::bind(boot.comm_id(), me as u32)?;

        // The copy engine's flag page, where it is on, staged, between symmetric windows or for
        // the copy-and-fold (every rank alike: shared settings); free slots start free
        // (`CeFlags::initial`).
        let page = if ce_slot_bytes(config, n) > 0
            || config.gpu_ce_window_bytes > 0
            || config.gpu_fold_min_bytes > 0
            || config.gpu_fold_reduce_min_bytes > 0
        {
            let p = HostPage::create(gpu)?;
            for i in 0..CeFlags::words(n) {
                p.set(i, CeFlags::initial(n, i));
            }
            Some(p)
        } else {
            None
        };
        let pid = std::process::id();
        let mine = ArenaDesc {
            pid,
            gpu: gpu.ordinal() as u32,
            recv: arena.device_ptr(),
            send: arena.device_ptr() + send_off,
            flags: page.as_ref().map_or(0, |p| p.device_ptr()),
            // A driver that cannot say costs the line rounds, not the communicator.
            carries_lines: gpu.peers_on_nvlink().unwrap_or(false)
                && lines_measured_on(gpu.compute_capability()),
        };
        let all = boot.allgather(&mine.encode())?;
        let peers: Vec<ArenaDesc> = all
            .iter()
            .map(|b| ArenaDesc::parse(b))
            .collect::<Result<_, _>>()?;
        let same_host = |q: Rank| boot.peers()[q].host_id == boot.peers()[me].host_id;
        // Peers in this process reach our arenas at the same addresses once access is granted.
        let local_gpus: Vec<usize> = (0..n)
            .filter(|&q| q != me && peers[q].pid == pid && same_host(q))
            .map(|q| peers[q].gpu as usize)
            .collect();
        arena.grant_access(&local_gpus)?;
        let mut arenas = vec![Arenas::default(); n];
        let mut pages = vec![0u64; n];
        for q in 0..n {
            if peers[q].pid == pid && same_host(q) {
                arenas[q] = Arenas {
                    recv: peers[q].recv,
                    send: peers[q].send,
                };
                pages[q] = peers[q].flags;
            } else if !same_host(q) {
                return Err(Error::InvalidArgument(format!(
                    "rank {q} is on another host ({}): the GPU backend reaches peers through NVLink on one host only for now",
                    boot.peers()[q].hostname
                )));
            }
        }
        // Other processes get our arenas as file descriptors, and we theirs.
        let remote: Vec<Rank> = (0..n).filter(|&q| q != me && peers[q].pid != pid).collect();
        let mut imported = Vec::new();
        let mut imported_pages = Vec::new();
        let mut imported_ranks: Vec<Rank> = Vec::new();
        if !remote.is_empty() {
            let afd = arena.export_fd()?;
            let mut fds = vec![afd.as_fd()];
            fds.extend(page.as_ref().map(|p| p.fd()));
            for &q in &remote {
                let ch = FdChannel::connect(boot.comm_id(), q as u32, deadline, abort)?;
                ch.send_fds(&fds, &(me as u32).to_le_bytes(), deadline, abort)?;
            }
            for _ in &remote {
                let ch = listener.accept(deadline, abort)?;
                let (got, payload) = ch.recv_fds(deadline, abort)?;
                let q = check_fd_message(
                    got.len(),
                    fds.len(),
                    &payload,
                    &remote,
                    &arenas,
                    &imported_ranks,
                )?;
                imported_ranks.push(q);
                let a = DeviceBuffer::import(got[0].as_fd(), geo.arena_bytes(), gpu, &[], stats)?;
                arenas[q] = Arenas {
                    recv: a.device_ptr(),
                    send: a.device_ptr() + send_off,
                };
                imported.push(a);
                if let Some(fd) = got.get(1) {
                    let p = HostPage::import(fd.as_fd(), gpu)?;
                    pages[q] = p.device_ptr();
                    imported_pages.push(p);
                }
            }
        }
        // Nobody may write into a peer's arena before that peer granted access.
        boot.barrier()?;

        arenas[me] = Arenas {
            recv: arena.device_ptr(),
            send: arena.device_ptr() + send_off,
        };
        let conns = conn_table(&geo, me, &arenas);
        let bytes = conns.len() * std::mem::size_of::<FcConn>();
        debug_assert_eq!(bytes, geo.conn_table_bytes());
        // SAFETY: FcConn is plain old data (repr(C), integers only).
        let raw = unsafe { std::slice::from_raw_parts(conns.as_ptr() as *const u8, bytes) };
        status.write_table(raw)?;
        let table = status.table_ptr();
        let direct = geo.has_direct().then(|| direct_param(&geo, me, &arenas));
        // The line rounds' salt rides in the template; each launch keeps it or clears it.
        let peer = geo.has_peer().then(|| FcPeer {
            lines: line_salt(boot.comm_id()),
            ..peer_param(&geo, me, &arenas)
        });
        // The copy engine borrows the peer engine's staging: the same addresses.
        let ce = page.zip(peer.as_ref()).map(|(mine, p)| {
            pages[me] = mine.device_ptr();
            CeFabric {
                stage: p.stage[..n].to_vec(),
                fold: arenas
                    .iter()
                    .map(|a| a.recv + geo.peer_fold_off() as u64)
                    .collect(),
                region_bytes: geo.peer_region_bytes(),
                pages,
                mine,
                imported: imported_pages,
            }
        });
        Ok(Fabric {
            carries_lines: lines_carried(&peers),
            copies_in_process: config.gpu_ce_in_process,
            windows_in_process: config.gpu_windows_in_process,
            places: peers
                .iter()
                .map(|p| Place {
                    pid: p.pid,
                    gpu: p.gpu,
                })
                .collect(),
            geo,
            _arena: arena,
            _imported: imported,
            table,
            nconns: conns.len() as u32,
            conns,
            direct,
            peer,
            ce,
        })
    }
}

/// What each rank tells the others about its arenas: enough to map them in this process (pid,
/// GPU) and the addresses they have there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ArenaDesc {
    pid: u32,
    gpu: u32,
    recv: u64,
    send: u64,
    /// The copy engine's flag page in the owner's process (0: none).
    flags: u64,
    /// Every GPU the owner sees and reaches is joined to its own by NVLink
    /// (`Gpu::peers_on_nvlink`), and its own GPU is of an architecture the line rounds were
    /// measured on (`lines_measured_on`): the peer engine's line rounds need both of every rank.
    carries_lines: bool,
}

impl ArenaDesc {
    const LEN: usize = 40;
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::LEN);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.gpu.to_le_bytes());
        v.extend_from_slice(&self.recv.to_le_bytes());
        v.extend_from_slice(&self.send.to_le_bytes());
        v.extend_from_slice(&self.flags.to_le_bytes());
        v.extend_from_slice(&u64::from(self.carries_lines).to_le_bytes());
        v
    }
    fn parse(b: &[u8]) -> Result<ArenaDesc, Error> {
        if b.len() != Self::LEN {
            return Err(Error::Protocol(format!(
                "GPU fabric: a peer sent {} bytes of arena description, expected {}",
                b.len(),
                Self::LEN
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let d = ArenaDesc {
            pid: u32_at(0),
            gpu: u32_at(4),
            recv: u64_at(8),
            send: u64_at(16),
            flags: u64_at(24),
            carries_lines: match u64_at(32) {
                0 => false,
                1 => true,
                v => {
                    return Err(Error::Protocol(format!(
                        "GPU fabric: a peer described its links as {v} (neither 0 nor 1)"
                    )))
                }
            },
        };
        if d.recv == 0 || d.send == 0 {
            return Err(Error::Protocol(
                "GPU fabric: a peer described a null arena".into(),
            ));
        }
        Ok(d)
    }
}

/// Checks one message of arena file descriptors from another process: as many descriptors as
/// we send (the arenas' allocation, and the copy engine's flag page where it is on: a setting every rank
/// shares) and the sender's rank, a rank that is expected to send them and has
/// not yet. Returns the rank.
fn check_fd_message(
    nfds: usize,
    want: usize,
    payload: &[u8],
    expected: &[Rank],
    arenas: &[Arenas],
    seen: &[Rank],
) -> Result<Rank, Error> {
    if nfds != want || payload.len() != 4 {
        return Err(Error::Protocol(format!(
            "GPU fabric: a peer sent a malformed arena descriptor ({nfds} descriptors, {} payload bytes; expected {want} and 4)",
            payload.len()
        )));
    }
    let q = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes")) as usize;
    if !expected.contains(&q) || seen.contains(&q) || arenas.get(q).is_some_and(|a| a.recv != 0) {
        return Err(Error::Protocol(format!("GPU fabric: arena descriptors from unexpected rank {q} (expected one each from {expected:?})")));
    }
    Ok(q)
}

/// The direct kernel's parameter with rank `me`'s view of every rank's slots and acks, and its
/// own epochs; the operation's fields are the launch's.
fn direct_param(geo: &Geometry, me: Rank, arenas: &[Arenas]) -> FcDirect {
    let mut p = FcDirect {
        epochs: arenas[me].send + geo.direct_epochs_off() as u64,
        rank: me as u32,
        nranks: arenas.len() as u32,
        ..Default::default()
    };
    for (q, a) in arenas.iter().enumerate() {
        p.slots[q] = a.recv + geo.direct_slots_off() as u64;
        p.acks[q] = a.send + geo.direct_acks_off() as u64;
    }
    p
}

/// Whether the ranks described by `descs` may run line rounds: every rank is on one GPU of one
/// process (its own memory, no link), or every rank said every GPU it sees is joined to its own
/// by NVLink (`Gpu::peers_on_nvlink`, false where a rank could not tell) and its GPU is one the
/// lines were measured on (`lines_measured_on`). The same on every rank.
fn lines_carried(descs: &[ArenaDesc]) -> bool {
    let one_gpu = descs
        .iter()
        .all(|d| (d.pid, d.gpu) == (descs[0].pid, descs[0].gpu));
    one_gpu || descs.iter().all(|d| d.carries_lines)
}

/// Whether line rounds may run on a GPU of compute capability `cc` (with NVLink to its peers): a
/// line's flag vouches for its 120 data bytes only where a warp's 128-byte store crosses the link
/// whole and a warp's load of it reads it as one access, which the lines were measured to hold
/// on Hopper (sm_90: H100, H200; check sweeps exact, docs/PERFORMANCE.md sections 23-24). Other
/// architectures take the staged rounds until measured.
fn lines_measured_on(cc: (u32, u32)) -> bool {
    cc.0 == 9
}

/// The salt the line rounds' flags are mixed with (`FcPeer::lines`): the same on every rank of
/// the communicator (from its random id), never 0, and unlike any round number or small value
/// that a slot's earlier raw data would likely hold where a flag goes (splitmix64's finaliser).
fn line_salt(comm_id: u64) -> u64 {
    let mut z = comm_id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1
}

/// The peer kernel's parameter with rank `me`'s view of every rank's staging and flag lines,
/// and its own round counters; the operation's fields are the launch's.
fn peer_param(geo: &Geometry, me: Rank, arenas: &[Arenas]) -> FcPeer {
    let mut p = FcPeer {
        seqs: arenas[me].send + geo.peer_seqs_off() as u64,
        slot_bytes: geo.peer_slot as u64,
        blocks: geo.peer_blocks as u32,
        rank: me as u32,
        nranks: arenas.len() as u32,
        ..Default::default()
    };
    for (q, a) in arenas.iter().enumerate() {
        p.stage[q] = a.recv + geo.peer_stage_off() as u64;
        p.flags[q] = a.recv + geo.peer_flags_off() as u64;
    }
    p
}

/// The kernel's connection table of rank `me`, given every rank's arenas as this process
/// addresses them: for each peer and channel, a send end (the peer's FIFO for us, our counters
/// for the peer) and a receive end (our FIFO for the peer, the peer's counters for us).
fn conn_table(geo: &Geometry, me: Rank, arenas: &[Arenas]) -> Vec<FcConn> {
    let n = arenas.len();
    let mut conns = vec![FcConn::default(); n * geo.nchan * 2];
    for q in (0..n).filter(|&q| q != me) {
        for c in 0..geo.nchan {
            // The FIFO for `of` in `owner`'s receive arena; the counters for `of` in a send arena.
            let fifo = |owner: Rank, of: Rank| {
                arenas[owner].recv + (geo.fifo_index(owner, of, c) * geo.fifo_stride()) as u64
            };
            let ctr =
                |base: u64, of: Rank| base + (geo.index(of, c) * Geometry::COUNTER_STRIDE) as u64;
            // Receiving from q: our FIFO for q; q's send counters for us.
            let rbase = fifo(me, q);
            conns[geo.index(q, c) * 2 + 1] = FcConn {
                data: rbase,
                lens: rbase + geo.lens_off() as u64,
                head: rbase + geo.head_off() as u64,
                tail: ctr(arenas[q].send, me),
                counter: rbase + geo.consumed_off() as u64,
                slots: geo.slots as u32,
                slot_bytes: geo.slot_bytes as u32,
                peer: q as u32,
                dir: CONN_RECV,
                ll: rbase + geo.ll_off() as u64,
                post: ctr(arenas[q].send, me) + Geometry::POST_OFF as u64,
            };
            // Sending to q: q's FIFO for us; our counters for q.
            let sbase = fifo(q, me);
            let mine = ctr(arenas[me].send, q);
            conns[geo.index(q, c) * 2] = FcConn {
                data: sbase,
                lens: sbase + geo.lens_off() as u64,
                head: sbase + geo.head_off() as u64,
                tail: mine,
                counter: mine + LINE as u64,
                slots: geo.slots as u32,
                slot_bytes: geo.slot_bytes as u32,
                peer: q as u32,
                dir: CONN_SEND,
                ll: sbase + geo.ll_off() as u64,
                post: mine + Geometry::POST_OFF as u64,
            };
        }
    }
    conns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_of_one_process_post_and_share_windows_on_distinct_gpus_only() {
        let at = |v: &[(u32, u32)]| -> Vec<Place> {
            v.iter().map(|&(pid, gpu)| Place { pid, gpu }).collect()
        };
        // A process per rank, whatever the GPUs (two processes may share one).
        for p in [at(&[(10, 0), (11, 1)]), at(&[(10, 0), (11, 0), (12, 1)])] {
            assert!(ranks_post_at(&p, false) && ranks_post_at(&p, true));
        }
        // Threads of one process on distinct GPUs: they post where the knob lets them.
        let threads = at(&[(10, 0), (10, 1), (10, 2)]);
        assert!(ranks_post_at(&threads, true) && !ranks_post_at(&threads, false));
        // Two ranks of one process on one GPU: neither; one such pair among others is enough.
        for p in [
            at(&[(10, 0), (10, 0)]),
            at(&[(10, 0), (10, 1), (11, 2), (10, 1)]),
        ] {
            assert!(!ranks_post_at(&p, true) && !ranks_post_at(&p, false));
        }
        // One rank: nothing to tell apart.
        assert!(ranks_post_at(&at(&[(10, 0)]), false));
        // Windows: processes always; threads on distinct GPUs only with both knobs; threads
        // sharing a GPU never.
        for (copies, windows) in [(false, false), (false, true), (true, false), (true, true)] {
            assert!(ranks_window_at(&at(&[(10, 0), (11, 1)]), copies, windows));
            assert_eq!(
                ranks_window_at(&threads, copies, windows),
                copies && windows
            );
            assert!(!ranks_window_at(&at(&[(10, 0), (10, 0)]), copies, windows));
        }
    }

    #[test]
    fn geometry_keeps_words_on_their_own_lines_and_indexes_every_connection_once() {
        let g = Geometry {
            slots: 8,
            slot_bytes: 1 << 18,
            coll: 2,
            nchan: 3,
            nranks: 4,
            peer_slot: 0,
            peer_blocks: 32,
        };
        assert_eq!(g.head_off() % LINE, 0);
        assert!(g.head_off() >= g.lens_off() + 8 * 4);
        assert_eq!(g.consumed_off() - g.head_off(), LINE);
        // LL slots after the counters' lines, each as large as the kernel's LL stride.
        assert_eq!(g.ll_off() % LINE, 0);
        assert!(g.ll_off() >= g.consumed_off() + LINE);
        assert_eq!(g.fifo_stride() - g.ll_off(), 8 * 2 * LL_DATA_BYTES);
        assert_eq!(g.chan_index(0), Some(0));
        assert_eq!(g.chan_index(1), Some(1));
        assert_eq!(g.chan_index(2), None);
        assert_eq!(g.chan_index(P2P_CHANNEL_BASE), Some(2));
        assert_eq!(g.chan_index(P2P_CHANNEL_BASE + 1), None);
        let mut seen = std::collections::HashSet::new();
        for peer in 0..4 {
            for ch in [0, 1, P2P_CHANNEL_BASE] {
                for dir in [Dir::Send, Dir::Recv] {
                    assert!(seen.insert(
                        g.conn_index(ConnKey {
                            peer,
                            channel: ch,
                            dir
                        })
                        .unwrap()
                    ));
                }
            }
        }
        assert_eq!(seen.len(), 4 * 3 * 2);
        assert!(seen.iter().all(|&i| (i as usize) < 4 * 3 * 2));
    }

    /// The direct engine's slots follow the FIFOs and its acks and epochs the counters, inside
    /// the arenas, each peer's view of a rank's slots naming the same bytes as its own.
    #[test]
    fn direct_slots_and_words_lie_inside_the_arenas_past_the_fifos() {
        for n in [1, 2, 5, 16] {
            let g = Geometry {
                slots: 4,
                slot_bytes: 1 << 12,
                coll: 2,
                nchan: 3,
                nranks: n,
                peer_slot: 0,
                peer_blocks: 32,
            };
            assert!(g.has_direct());
            // FIFOs for the other ranks only: with 2 ranks, one peer's worth.
            assert_eq!(
                g.direct_slots_off(),
                ((n - 1) * g.nchan * g.fifo_stride()).div_ceil(LINE) * LINE
            );
            assert_eq!(
                g.recv_arena_bytes() - g.direct_slots_off(),
                DIRECT_MAX_BLOCKS * n * 4 * DIRECT_SLOT_BYTES
            );
            assert!(g.direct_acks_off() >= n * g.nchan * Geometry::COUNTER_STRIDE);
            assert!(g.direct_epochs_off() >= g.direct_acks_off() + DIRECT_MAX_BLOCKS * n * 8);
            assert_eq!(
                g.send_arena_bytes(),
                g.direct_epochs_off() + DIRECT_MAX_BLOCKS * 8
            );
            let arenas: Vec<Arenas> = (0..n as u64)
                .map(|q| Arenas {
                    recv: (q + 1) << 36,
                    send: ((q + 1) << 36) + (1 << 34),
                })
                .collect();
            for me in 0..n {
                let p = direct_param(&g, me, &arenas);
                assert_eq!((p.rank, p.nranks), (me as u32, n as u32));
                for q in 0..n {
                    assert_eq!(p.slots[q], arenas[q].recv + g.direct_slots_off() as u64);
                    let last_line = p.slots[q]
                        + (((DIRECT_MAX_BLOCKS * n - 1) * 2 + 1) * 2 * DIRECT_SLOT_BYTES) as u64
                        + (2 * DIRECT_SLOT_BYTES) as u64;
                    assert!(last_line <= arenas[q].recv + g.recv_arena_bytes() as u64);
                    let last_ack = p.acks[q] + ((DIRECT_MAX_BLOCKS * n) * 8) as u64;
                    assert!(last_ack <= arenas[q].send + g.direct_epochs_off() as u64);
                }
                assert!(
                    p.epochs + (DIRECT_MAX_BLOCKS * 8) as u64
                        <= arenas[me].send + g.send_arena_bytes() as u64
                );
                assert_eq!(
                    p.slots[n..]
                        .iter()
                        .chain(&p.acks[n..])
                        .filter(|&&a| a != 0)
                        .count(),
                    0
                );
            }
        }
        // Beyond 16 ranks there is no direct engine and no room taken for it.
        let g = Geometry {
            slots: 4,
            slot_bytes: 1 << 12,
            coll: 2,
            nchan: 3,
            nranks: 17,
            peer_slot: 0,
            peer_blocks: 32,
        };
        assert!(!g.has_direct());
        assert_eq!(g.recv_arena_bytes(), g.direct_slots_off());
        assert_eq!(g.send_arena_bytes(), g.direct_acks_off());
    }

    /// What a GPU communicator allocates at creation with the default knobs, in the driver's 2
    /// MiB granules: one allocation for both arenas and one for the status record and the
    /// connection table. On 2 ranks that leaves the bandwidth issue's 64 MiB room for the plan
    /// tables' slabs (docs/ENV.md says how each knob sizes it).
    #[test]
    fn a_default_two_rank_communicator_takes_at_most_56_mib() {
        let granules = |b: usize| b.div_ceil(2 << 20) * (2 << 20);
        let at = |n: usize| {
            let g = Geometry::of(&Config::default(), n);
            granules(g.arena_bytes()) + granules(256 + g.conn_table_bytes())
        };
        assert!(at(2) <= 56 << 20, "{} MiB", at(2) >> 20);
        // More ranks, more FIFOs (a peer's share of the channels), the staging the same.
        assert!(at(3) > at(2) && at(8) > at(3));
    }

    /// The staging a communicator allocates is the one the tuner plans rounds for: the same
    /// blocks, slots and regions (the copy engine's), for every rank count and block knob.
    #[test]
    fn the_geometry_cuts_the_staging_as_the_tuner_plans_it() {
        for knob in [0usize, 7, 16, 64] {
            for n in 2..=16 {
                let cfg = Config {
                    gpu_peer_blocks: knob,
                    ..Config::default()
                };
                let g = Geometry::of(&cfg, n);
                assert_eq!(
                    (g.peer_blocks, g.peer_slot),
                    (peer_blocks(&cfg, n), peer_slot_bytes(&cfg, n)),
                    "{n} ranks, knob {knob}"
                );
                assert_eq!(
                    g.peer_region_bytes(),
                    ferroccl_core::tune::peer_region_bytes(&cfg, n)
                );
                if g.has_peer() {
                    assert!(
                        (n - 1) * g.peer_region_bytes() <= cfg.gpu_peer_bytes,
                        "the staging stays within FERROCCL_GPU_PEER_BYTES"
                    );
                    assert!(
                        g.peer_blocks <= PEER_MAX_BLOCKS,
                        "flags and counters are laid out for PEER_MAX_BLOCKS"
                    );
                }
            }
        }
    }

    /// The peer engine's staging and flags follow the direct slots, its counters the direct
    /// words; every slot and flag line of every (block, sender, phase, parity) is distinct and
    /// inside the owner's arena, as the kernel's `peer_slot` / `peer_flag` address them.
    #[test]
    fn peer_staging_and_flags_lie_inside_the_arenas_apart() {
        for (n, blocks) in [(2usize, 64usize), (2, 32), (3, 32), (3, 7), (16, 32)] {
            let slot = 16 << 10;
            let g = Geometry {
                slots: 4,
                slot_bytes: 1 << 12,
                coll: 2,
                nchan: 3,
                nranks: n,
                peer_slot: slot,
                peer_blocks: blocks,
            };
            let plain = Geometry { peer_slot: 0, ..g };
            assert!(g.has_peer() && !plain.has_peer());
            assert_eq!(g.peer_stage_off() % 4096, 0);
            assert!(g.peer_stage_off() >= plain.recv_arena_bytes());
            assert_eq!(
                g.peer_flags_off() - g.peer_stage_off(),
                blocks * (n - 1) * 4 * slot
            );
            assert_eq!(
                g.peer_fold_off() - g.peer_flags_off(),
                PEER_MAX_BLOCKS * n * PEER_PHASES * LINE
            );
            assert_eq!(g.recv_arena_bytes() - g.peer_fold_off(), n * LINE);
            assert!(
                g.peer_seqs_off() >= plain.send_arena_bytes()
                    && g.peer_seqs_off().is_multiple_of(LINE)
            );
            assert_eq!(
                g.peer_sent_off(),
                g.peer_seqs_off() + 2 * PEER_MAX_BLOCKS * 8
            );
            assert_eq!(
                g.send_arena_bytes(),
                g.peer_sent_off() + PEER_MAX_BLOCKS * 8
            );
            // Both arenas in one allocation, as Fabric::new maps them.
            assert!(
                g.send_arena_off() >= g.recv_arena_bytes()
                    && g.send_arena_off().is_multiple_of(4096)
            );
            assert_eq!(g.arena_bytes(), g.send_arena_off() + g.send_arena_bytes());
            let arenas: Vec<Arenas> = (0..n as u64)
                .map(|q| Arenas {
                    recv: (q + 1) << 40,
                    send: ((q + 1) << 40) + g.send_arena_off() as u64,
                })
                .collect();
            // The kernel's addressing (peer.cu's peer_slot), in Rust.
            let slot_at =
                |p: &FcPeer, owner: usize, b: usize, from: usize, phase: usize, parity: usize| {
                    let f = if from < owner { from } else { from - 1 };
                    p.stage[owner]
                        + ((((f * p.blocks as usize + b) * 2 + parity) * 2 + phase) * slot) as u64
                };
            let flag_at = |p: &FcPeer, owner: usize, b: usize, from: usize, phase: usize| {
                p.flags[owner] + (((b * n + from) * PEER_PHASES + phase) * LINE) as u64
            };
            for me in 0..n {
                let p = peer_param(&g, me, &arenas);
                assert_eq!(
                    (p.rank, p.nranks, p.slot_bytes, p.blocks),
                    (me as u32, n as u32, slot as u64, blocks as u32)
                );
                assert_eq!(p.seqs, arenas[me].send + g.peer_seqs_off() as u64);
                let mut slots = std::collections::HashSet::new();
                let mut flags = std::collections::HashSet::new();
                for owner in 0..n {
                    let (lo, hi) = (
                        arenas[owner].recv + g.peer_stage_off() as u64,
                        arenas[owner].recv + g.peer_flags_off() as u64,
                    );
                    for b in [0, 1, blocks - 1] {
                        for from in (0..n).filter(|&f| f != owner) {
                            for phase in 0..2 {
                                for parity in 0..2 {
                                    let a = slot_at(&p, owner, b, from, phase, parity);
                                    assert!(
                                        a >= lo && a + slot as u64 <= hi,
                                        "slot outside the staging"
                                    );
                                    assert!(slots.insert(a));
                                    // A one-shot all-reduce's round spans both phases' slots.
                                    if phase == 1 {
                                        assert_eq!(
                                            a,
                                            slot_at(&p, owner, b, from, 0, parity) + slot as u64
                                        );
                                    }
                                }
                            }
                            for phase in 0..PEER_PHASES {
                                let f = flag_at(&p, owner, b, from, phase);
                                assert!(
                                    f >= hi
                                        && f + LINE as u64
                                            <= arenas[owner].recv + g.recv_arena_bytes() as u64
                                );
                                assert!(flags.insert(f));
                            }
                        }
                    }
                }
            }
        }
    }

    fn fake_arenas(g: &Geometry, n: usize) -> Vec<Arenas> {
        // Disjoint ranges, as if every rank's arenas were mapped in one process.
        let (r, s) = (
            (n * g.nchan * g.fifo_stride()) as u64,
            (n * g.nchan * Geometry::COUNTER_STRIDE) as u64,
        );
        (0..n as u64)
            .map(|q| Arenas {
                recv: 0x1000_0000_0000 + q * (r + s + (1 << 21)),
                send: 0x1000_0000_0000 + q * (r + s + (1 << 21)) + r,
            })
            .collect()
    }

    #[test]
    fn both_ends_of_every_connection_agree_and_no_word_is_shared() {
        for n in [2usize, 3, 4, 5] {
            let g = Geometry {
                slots: 4,
                slot_bytes: 1 << 12,
                coll: 2,
                nchan: 3,
                nranks: n,
                peer_slot: 0,
                peer_blocks: 32,
            };
            let arenas = fake_arenas(&g, n);
            let tables: Vec<Vec<FcConn>> = (0..n).map(|me| conn_table(&g, me, &arenas)).collect();
            let mut words = std::collections::HashSet::new();
            let mut fifos = Vec::new();
            for a in 0..n {
                for b in (0..n).filter(|&b| b != a) {
                    for ch in [0, 1, P2P_CHANNEL_BASE] {
                        let at = |me: usize, peer: usize, dir| {
                            tables[me][g
                                .conn_index(ConnKey {
                                    peer,
                                    channel: ch,
                                    dir,
                                })
                                .unwrap() as usize]
                        };
                        let (s, r) = (at(a, b, Dir::Send), at(b, a, Dir::Recv));
                        assert_eq!(
                            (s.dir, r.dir, s.peer, r.peer),
                            (CONN_SEND, CONN_RECV, b as u32, a as u32)
                        );
                        // One FIFO, seen from both ends: the receiver's memory, before its direct
                        // slots (the receiver keeps FIFOs for the other ranks only).
                        assert_eq!(
                            (s.data, s.lens, s.head, s.ll, s.tail),
                            (r.data, r.lens, r.head, r.ll, r.tail)
                        );
                        let in_recv_arena = |x: u64| {
                            x >= arenas[b].recv && x < arenas[b].recv + g.direct_slots_off() as u64
                        };
                        assert!([
                            s.data,
                            s.lens,
                            s.head,
                            s.ll,
                            r.counter,
                            s.data + g.fifo_stride() as u64 - 1
                        ]
                        .into_iter()
                        .all(in_recv_arena));
                        fifos.push((s.data, s.data + g.fifo_stride() as u64));
                        // tail and the producer's counter live with the sender.
                        let in_send_arena = |x: u64| {
                            x >= arenas[a].send
                                && x < arenas[a].send
                                    + (n * g.nchan * Geometry::COUNTER_STRIDE) as u64
                        };
                        assert!(
                            in_send_arena(s.tail)
                                && in_send_arena(s.counter)
                                && in_send_arena(s.post)
                        );
                        // The receiver posts into the sender's memory, where the sender polls it.
                        assert_eq!(s.post, r.post);
                        assert_eq!(s.post - s.tail, Geometry::POST_OFF as u64);
                        assert!(
                            s.ll >= s.data + (g.slots * g.slot_bytes) as u64,
                            "LL slots overlap the data slots"
                        );
                        for w in [s.head, s.tail, s.counter, r.counter, s.post] {
                            assert!(words.insert(w), "word {w:#x} belongs to two connections");
                        }
                        assert_eq!((s.slots, s.slot_bytes), (4, 1 << 12));
                    }
                }
                // No connection to oneself.
                assert!(
                    tables[a][g.index(a, 0) * 2].data == 0
                        && tables[a][g.index(a, 0) * 2 + 1].data == 0
                );
            }
            fifos.sort_unstable();
            assert_eq!(fifos.len(), n * (n - 1) * g.nchan);
            assert!(
                fifos.windows(2).all(|w| w[0].1 <= w[1].0),
                "{n} ranks: two FIFOs overlap"
            );
        }
    }

    #[test]
    fn line_salts_are_one_per_communicator_and_never_small() {
        let ids = [0u64, 1, 2, 3, u64::MAX, 0x1234_5678_9abc_def0, 1 << 63];
        let salts: Vec<u64> = ids.iter().map(|&id| line_salt(id)).collect();
        for (i, &s) in salts.iter().enumerate() {
            // Odd (never 0), and far from the small values and round numbers raw data would hold.
            assert_eq!(s & 1, 1);
            assert!(s >> 32 != 0, "id {:#x}: salt {s:#x}", ids[i]);
            assert!(salts[..i].iter().all(|&t| t != s), "id {:#x}", ids[i]);
        }
    }

    #[test]
    fn lines_run_on_one_gpu_or_where_every_rank_says_nvlink() {
        let d = |pid: u32, gpu: u32, carries_lines: bool| ArenaDesc {
            pid,
            gpu,
            recv: 1,
            send: 1,
            flags: 0,
            carries_lines,
        };
        // Two ranks of one process on one GPU: no link involved.
        assert!(lines_carried(&[d(7, 0, false), d(7, 0, false)]));
        // On two GPUs: only where every rank said NVLink.
        assert!(lines_carried(&[d(7, 0, true), d(7, 1, true)]));
        assert!(lines_carried(&[d(7, 0, true), d(8, 0, true)]));
        assert!(!lines_carried(&[d(7, 0, true), d(7, 1, false)]));
        assert!(!lines_carried(&[d(7, 0, false), d(8, 0, true)]));
        // Two processes whose GPUs' ordinals match say nothing of sharing one.
        assert!(!lines_carried(&[d(7, 0, false), d(8, 0, false)]));
        assert!(!lines_carried(&[
            d(7, 0, true),
            d(7, 0, true),
            d(7, 1, false)
        ]));
    }

    #[test]
    fn lines_run_only_on_the_architecture_they_were_measured_on() {
        assert!(lines_measured_on((9, 0)));
        for cc in [(7, 0), (8, 0), (8, 6), (8, 9), (10, 0), (12, 0)] {
            assert!(!lines_measured_on(cc), "{cc:?}");
        }
    }

    #[test]
    fn arena_messages_are_checked() {
        let d = ArenaDesc {
            pid: 7,
            gpu: 3,
            recv: 0x7f00_0000_0000,
            send: 0x7f10_0000_0000,
            flags: 0x7f20_0000_0000,
            carries_lines: true,
        };
        assert_eq!(ArenaDesc::parse(&d.encode()).unwrap(), d);
        let pcie = ArenaDesc {
            carries_lines: false,
            ..d
        };
        assert_eq!(ArenaDesc::parse(&pcie.encode()).unwrap(), pcie);
        assert!(matches!(
            ArenaDesc::parse(&d.encode()[..39]),
            Err(Error::Protocol(_))
        ));
        let mut odd = d.encode();
        odd[32] = 2;
        assert!(matches!(ArenaDesc::parse(&odd), Err(Error::Protocol(_))));
        assert!(matches!(
            ArenaDesc::parse(&ArenaDesc { recv: 0, ..d }.encode()),
            Err(Error::Protocol(_))
        ));
        let arenas = vec![Arenas::default(); 4];
        let from = |q: u32| q.to_le_bytes();
        // The arenas' allocation and the copy engine's flag page, or the allocation alone.
        assert_eq!(
            check_fd_message(2, 2, &from(2), &[1, 2], &arenas, &[]).unwrap(),
            2
        );
        assert_eq!(
            check_fd_message(1, 1, &from(2), &[1, 2], &arenas, &[]).unwrap(),
            2,
            "no staging: no flag page"
        );
        let e = check_fd_message(1, 2, &from(2), &[1, 2], &arenas, &[]).unwrap_err();
        assert!(
            e.to_string().contains("1 descriptors") && e.to_string().contains("expected 2"),
            "{e}"
        );
        assert!(check_fd_message(2, 2, &[2, 0], &[1, 2], &arenas, &[]).is_err());
        // A rank in this process, an unknown rank, and a second message from one rank.
        assert!(check_fd_message(2, 2, &from(3), &[1, 2], &arenas, &[]).is_err());
        assert!(check_fd_message(2, 2, &from(99), &[1, 2], &arenas, &[]).is_err());
        assert!(check_fd_message(2, 2, &from(1), &[1, 2], &arenas, &[1]).is_err());
    }
}

#[cfg(test)]
mod oom_tests {
    use super::*;

    #[test]
    fn out_of_gpu_memory_names_the_size_and_the_knobs() {
        let geo = Geometry {
            slots: 8,
            slot_bytes: 262144,
            coll: 32,
            nchan: 40,
            nranks: 4,
            peer_slot: 0,
            peer_blocks: 32,
        };
        let oom = Error::System(
            "cuMemCreate(84934656 bytes on GPU 3) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
                .into(),
        );
        let e = explain_alloc_failure(oom, &geo, 4, 3, 84_000_000);
        assert!(matches!(e, Error::System(_)), "{e}");
        let m = e.message();
        for want in [
            "GPU 3",
            "84000000 bytes",
            "3 peers x 40 channels",
            "FERROCCL_GPU_PEER_BYTES",
            "FERROCCL_GPU_CHANNELS=32",
            "8 point-to-point",
            "FERROCCL_GPU_P2P_CHANNELS",
            "FERROCCL_SLOTS",
            "FERROCCL_SLOT_BYTES",
            "CUDA_ERROR_OUT_OF_MEMORY",
        ] {
            assert!(m.contains(want), "{want:?} missing from: {m}");
        }
        // Other failures are not dressed up as a memory problem.
        let other = Error::System(
            "cuMemCreate(4096 bytes on GPU 0) failed: CUDA_ERROR_INVALID_VALUE".into(),
        );
        assert_eq!(explain_alloc_failure(other.clone(), &geo, 4, 0, 1), other);
    }
}
