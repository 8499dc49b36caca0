//! The GPU connections of one communicator: every rank's receive FIFOs and send counters,
//! made once at init in two cuMem allocations, mapped by every peer GPU (directly within one
//! process, through exported file descriptors across processes), and described to the kernel
//! as one table of `FcConn`.
//!
//! Layout on each GPU, for every (peer, channel): in the receive arena a FIFO of `slots` data
//! slots, their lengths, `head` (written by the sender over NVLink) and `consumed` (ours); in
//! the send arena `tail` (written by the receiver over NVLink) and `produced` (ours). Each word
//! has its own 128-byte line so that remote writes never share a line with local spins.

use super::devplan::{FcConn, CONN_RECV, CONN_SEND};
use super::device::Gpu;
use super::fdpass::{FdChannel, FdListener};
use super::mem::{DeviceBuffer, MemStats};
use crate::bootstrap::Bootstrap;
use ferroccl_core::plan::{ConnKey, Dir, P2P_CHANNEL_BASE};
use ferroccl_core::{Config, Error, Rank};
use std::os::fd::AsFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

const LINE: usize = 128;

/// Point-to-point channels of a GPU communicator with `channels` collective channels: enough
/// blocks to fill NVLink, without doubling the FIFO memory.
pub(crate) fn p2p_channels(channels: usize) -> usize {
    channels.clamp(1, 8)
}

/// Where things are inside one FIFO and one counter pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub slots: usize,
    pub slot_bytes: usize,
    /// Collective channels per peer; the point-to-point channels follow them.
    pub coll: usize,
    /// Channels per peer in all.
    pub nchan: usize,
}

impl Geometry {
    pub fn lens_off(&self) -> usize {
        self.slots * self.slot_bytes
    }
    pub fn head_off(&self) -> usize {
        (self.lens_off() + self.slots * 4).div_ceil(LINE) * LINE
    }
    pub fn consumed_off(&self) -> usize {
        self.head_off() + LINE
    }
    pub fn fifo_stride(&self) -> usize {
        self.consumed_off() + LINE
    }
    pub const COUNTER_STRIDE: usize = 2 * LINE;
    /// Slot of (peer, channel index) in either arena.
    pub fn index(&self, peer: Rank, chan: usize) -> usize {
        peer * self.nchan + chan
    }
    /// Channel index of a plan channel: collective channels first, point-to-point last.
    pub fn chan_index(&self, channel: u32) -> Option<usize> {
        let i = if channel >= P2P_CHANNEL_BASE { self.coll + (channel - P2P_CHANNEL_BASE) as usize } else if (channel as usize) < self.coll { channel as usize } else { return None };
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
pub(crate) fn explain_alloc_failure(e: Error, geo: &Geometry, nranks: usize, ordinal: usize, need: usize) -> Error {
    if !e.message().contains("CUDA_ERROR_OUT_OF_MEMORY") {
        return e;
    }
    e.context(format!(
        "GPU {ordinal} has no room for this communicator's FIFOs: {need} bytes = {nranks} ranks x {} channels \
         (FERROCCL_GPU_CHANNELS={} plus point-to-point) x {} slots (FERROCCL_SLOTS) x {} bytes (FERROCCL_SLOT_BYTES), \
         plus counters. Free GPU memory (other communicators, the framework's cache) or lower those knobs",
        geo.nchan, geo.coll, geo.slots, geo.slot_bytes
    ))
}

pub(crate) struct Fabric {
    pub geo: Geometry,
    // Mapped by the peers for the communicator's life; only the kernel touches them.
    _recv_arena: DeviceBuffer,
    _send_arena: DeviceBuffer,
    /// Peers' arenas imported from other processes (kept mapped for the communicator's life).
    _imported: Vec<DeviceBuffer>,
    /// The FcConn table on the device.
    pub table: DeviceBuffer,
    pub nconns: u32,
}

impl Fabric {
    pub fn new(gpu: &Gpu, boot: &Bootstrap, config: &Config, stats: &Arc<MemStats>, abort: &AtomicBool) -> Result<Fabric, Error> {
        let (me, n) = (boot.rank(), boot.nranks());
        let geo = Geometry {
            slots: config.slots,
            slot_bytes: config.slot_bytes,
            coll: config.channels,
            nchan: config.channels + p2p_channels(config.channels),
        };
        let entries = n * geo.nchan;
        let need = entries * (geo.fifo_stride() + Geometry::COUNTER_STRIDE);
        let explain = |e: Error| explain_alloc_failure(e, &geo, n, gpu.ordinal(), need);
        // If the second allocation fails, the first is released as `recv_arena` drops.
        let recv_arena = DeviceBuffer::alloc(gpu, entries * geo.fifo_stride(), &[], stats).map_err(explain)?;
        let send_arena = DeviceBuffer::alloc(gpu, entries * Geometry::COUNTER_STRIDE, &[], stats).map_err(explain)?;
        // Counters start at zero on both sides (the kernel's protocol assumes it).
        recv_arena.copy_from_host(0, &vec![0u8; recv_arena.len()])?;
        send_arena.copy_from_host(0, &vec![0u8; send_arena.len()])?;
        let deadline = Instant::now() + config.timeout;
        let listener = FdListener::bind(boot.comm_id(), me as u32)?;

        let pid = std::process::id();
        let mut mine = Vec::with_capacity(32);
        mine.extend_from_slice(&pid.to_le_bytes());
        mine.extend_from_slice(&(gpu.ordinal() as u32).to_le_bytes());
        mine.extend_from_slice(&recv_arena.device_ptr().to_le_bytes());
        mine.extend_from_slice(&send_arena.device_ptr().to_le_bytes());
        let all = boot.allgather(&mine)?;
        let parse = |b: &Vec<u8>| -> Result<(u32, u32, u64, u64), Error> {
            if b.len() != 24 {
                return Err(Error::Protocol(format!("GPU fabric: a peer sent {} bytes of arena description, expected 24", b.len())));
            }
            let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
            let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
            Ok((u32_at(0), u32_at(4), u64_at(8), u64_at(16)))
        };
        let peers: Vec<(u32, u32, u64, u64)> = all.iter().map(parse).collect::<Result<_, _>>()?;
        let same_host = |q: Rank| boot.peers()[q].host_id == boot.peers()[me].host_id;
        // Peers in this process reach our arenas at the same addresses once access is granted.
        let local_gpus: Vec<usize> = (0..n).filter(|&q| q != me && peers[q].0 == pid && same_host(q)).map(|q| peers[q].1 as usize).collect();
        recv_arena.grant_access(&local_gpus)?;
        send_arena.grant_access(&local_gpus)?;
        let mut arenas = vec![Arenas::default(); n];
        for q in 0..n {
            if peers[q].0 == pid && same_host(q) {
                arenas[q] = Arenas { recv: peers[q].2, send: peers[q].3 };
            } else if !same_host(q) {
                return Err(Error::InvalidArgument(format!(
                    "rank {q} is on another host ({}): the GPU backend reaches peers through NVLink on one host only for now",
                    boot.peers()[q].hostname
                )));
            }
        }
        // Other processes get our arenas as file descriptors, and we theirs.
        let remote: Vec<Rank> = (0..n).filter(|&q| q != me && peers[q].0 != pid).collect();
        let mut imported = Vec::new();
        if !remote.is_empty() {
            let (rfd, sfd) = (recv_arena.export_fd()?, send_arena.export_fd()?);
            for &q in &remote {
                let ch = FdChannel::connect(boot.comm_id(), q as u32, deadline, abort)?;
                ch.send_fds(&[rfd.as_fd(), sfd.as_fd()], &(me as u32).to_le_bytes(), deadline, abort)?;
            }
            for _ in &remote {
                let ch = listener.accept(deadline, abort)?;
                let (fds, payload) = ch.recv_fds(deadline, abort)?;
                if fds.len() != 2 || payload.len() != 4 {
                    return Err(Error::Protocol("GPU fabric: a peer sent a malformed arena descriptor".into()));
                }
                let q = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes")) as usize;
                if !remote.contains(&q) {
                    return Err(Error::Protocol(format!("GPU fabric: descriptors from unexpected rank {q}")));
                }
                let r = DeviceBuffer::import(fds[0].as_fd(), entries * geo.fifo_stride(), gpu, &[], stats)?;
                let s = DeviceBuffer::import(fds[1].as_fd(), entries * Geometry::COUNTER_STRIDE, gpu, &[], stats)?;
                arenas[q] = Arenas { recv: r.device_ptr(), send: s.device_ptr() };
                imported.push(r);
                imported.push(s);
            }
        }
        // Nobody may write into a peer's arena before that peer granted access.
        boot.barrier()?;

        let mut conns = vec![FcConn::default(); entries * 2];
        for q in (0..n).filter(|&q| q != me) {
            for c in 0..geo.nchan {
                let fifo = |base: u64, of: Rank| base + (geo.index(of, c) * geo.fifo_stride()) as u64;
                let ctr = |base: u64, of: Rank| base + (geo.index(of, c) * Geometry::COUNTER_STRIDE) as u64;
                // Receiving from q: our FIFO for q; q's send counters for us.
                let rbase = fifo(recv_arena.device_ptr(), q);
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
                };
                // Sending to q: q's FIFO for us; our counters for q.
                let sbase = fifo(arenas[q].recv, me);
                let mine = ctr(send_arena.device_ptr(), q);
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
                };
            }
        }
        let bytes = conns.len() * std::mem::size_of::<FcConn>();
        let table = DeviceBuffer::alloc(gpu, bytes.max(1), &[], stats)?;
        // SAFETY: FcConn is plain old data (repr(C), integers only).
        let raw = unsafe { std::slice::from_raw_parts(conns.as_ptr() as *const u8, bytes) };
        table.copy_from_host(0, raw)?;
        Ok(Fabric { geo, _recv_arena: recv_arena, _send_arena: send_arena, _imported: imported, table, nconns: conns.len() as u32 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_keeps_words_on_their_own_lines_and_indexes_every_connection_once() {
        let g = Geometry { slots: 8, slot_bytes: 1 << 18, coll: 2, nchan: 3 };
        assert_eq!(g.head_off() % LINE, 0);
        assert!(g.head_off() >= g.lens_off() + 8 * 4);
        assert_eq!(g.consumed_off() - g.head_off(), LINE);
        assert_eq!(g.chan_index(0), Some(0));
        assert_eq!(g.chan_index(1), Some(1));
        assert_eq!(g.chan_index(2), None);
        assert_eq!(g.chan_index(P2P_CHANNEL_BASE), Some(2));
        assert_eq!(g.chan_index(P2P_CHANNEL_BASE + 1), None);
        let mut seen = std::collections::HashSet::new();
        for peer in 0..4 {
            for ch in [0, 1, P2P_CHANNEL_BASE] {
                for dir in [Dir::Send, Dir::Recv] {
                    assert!(seen.insert(g.conn_index(ConnKey { peer, channel: ch, dir }).unwrap()));
                }
            }
        }
        assert_eq!(seen.len(), 4 * 3 * 2);
        assert!(seen.iter().all(|&i| (i as usize) < 4 * 3 * 2));
    }
}

#[cfg(test)]
mod oom_tests {
    use super::*;

    #[test]
    fn out_of_gpu_memory_names_the_size_and_the_knobs() {
        let geo = Geometry { slots: 8, slot_bytes: 262144, coll: 32, nchan: 40 };
        let oom = Error::System("cuMemCreate(84934656 bytes on GPU 3) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)".into());
        let e = explain_alloc_failure(oom, &geo, 4, 3, 84_000_000);
        assert!(matches!(e, Error::System(_)), "{e}");
        let m = e.message();
        for want in ["GPU 3", "84000000 bytes", "4 ranks x 40 channels", "FERROCCL_GPU_CHANNELS=32", "FERROCCL_SLOTS", "FERROCCL_SLOT_BYTES", "CUDA_ERROR_OUT_OF_MEMORY"] {
            assert!(m.contains(want), "{want:?} missing from: {m}");
        }
        // Other failures are not dressed up as a memory problem.
        let other = Error::System("cuMemCreate(4096 bytes on GPU 0) failed: CUDA_ERROR_INVALID_VALUE".into());
        assert_eq!(explain_alloc_failure(other.clone(), &geo, 4, 0, 1), other);
    }
}
