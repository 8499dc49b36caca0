//! Local registrations (`ncclCommRegister`, [`crate::Comm::register_local`]) reach peers in
//! other processes through each rank's mapper: a thread that maps the buffers its peers lend it
//! and answers where it mapped them.
//!
//! A local registration is one rank's own call: its peers are busy with their own work and take
//! no part, unlike a window's registration, which is collective. So the registering rank
//! exports the allocation holding its buffer (a cuMem allocation as a file descriptor,
//! `cuMemAlloc` memory as its CUDA IPC handle, which rides in the message) and hands it to every
//! peer process's mapper, which imports and maps it for its GPU and replies with the address;
//! that address is what the registering rank posts to that peer when an operation's output
//! lies in the buffer (the peer engine's direct rounds). A peer it cannot reach (or whose
//! mapper fails) keeps no address: it stages, as for any unregistered buffer. Deregistration
//! asks the mappers to unmap. Peers in the same process need no mapper: they reach a buffer at its
//! own address once their GPU may (a cuMem allocation's range granted to it, or peer access to
//! the lender's context for `cuMemAlloc` memory).
//!
//! The mapper listens on an abstract socket named by the communicator and rank
//! ([`socket_job`]), talks only to processes of the same user (`fdpass`), checks every message
//! (a lender must be a rank of the communicator in another process, as it described itself at
//! creation, send from that process, as the socket's `SO_PEERCRED` names it, and say what it
//! lends consistently) and never maps more than [`MAX_LOANS`] buffers; a lender in turn only
//! hands its descriptor or handle to a socket held by the process the receiving rank runs as. Both checks
//! take the pid a rank reported at creation for its process, as the communicator does
//! throughout: ranks in different pid namespaces are not supported. A lend whose answer is lost
//! may still have been mapped: the lender recalls it at deregistration, after the loans it
//! knows of.

use super::window::WindowDesc;
use crate::cuda::device::Gpu;
use crate::cuda::fdpass::{FdChannel, FdListener};
use crate::cuda::mem::{DeviceBuffer, IpcMapping, MemStats, Shared, IPC_HANDLE_LEN};
use ferroccl_core::{Error, Rank};
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The most buffers one mapper keeps mapped for all its peers together.
pub(crate) const MAX_LOANS: usize = 4096;

/// How long the mapper waits for one message of a peer that connected.
const MESSAGE_WAIT: Duration = Duration::from_secs(5);

const LEND: u8 = b'L';
const LEND_IPC: u8 = b'I';
const RECALL: u8 = b'R';
const OK: u8 = 0;
const REFUSED: u8 = 0xff;

/// The fd-socket job of communicator `comm_id`'s mappers (apart from its creation's sockets).
pub(crate) fn socket_job(comm_id: u64) -> u64 {
    comm_id ^ 0x4d41_5050_4552_0000
}

/// Where each rank runs: what a mapper checks lenders against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub pid: u32,
    pub gpu: u32,
}

/// A lend request: rank `from` lends registration `id`, described by `desc`: a cuMem allocation
/// (its descriptor rides beside the message), or `cuMemAlloc` memory by its CUDA IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Request {
    Lend {
        from: u32,
        id: u64,
        desc: WindowDesc,
    },
    LendIpc {
        from: u32,
        id: u64,
        desc: WindowDesc,
        handle: [u8; IPC_HANDLE_LEN],
    },
    Recall {
        from: u32,
        id: u64,
    },
}

impl Request {
    /// The request that lends `shared` (described by `desc`) as rank `from`'s loan `id`, and the
    /// descriptor that must ride beside it (a cuMem allocation's; an IPC loan carries its handle).
    pub fn lend_of(
        from: u32,
        id: u64,
        desc: WindowDesc,
        shared: &Shared,
    ) -> (Request, Option<BorrowedFd<'_>>) {
        match shared {
            Shared::Fd(f) => (Request::Lend { from, id, desc }, Some(f.as_fd())),
            Shared::Ipc(handle) => (
                Request::LendIpc {
                    from,
                    id,
                    desc,
                    handle: *handle,
                },
                None,
            ),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let (tag, from, id) = match *self {
            Request::Lend { from, id, .. } => (LEND, from, id),
            Request::LendIpc { from, id, .. } => (LEND_IPC, from, id),
            Request::Recall { from, id } => (RECALL, from, id),
        };
        let mut v = vec![tag];
        v.extend_from_slice(&from.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
        match self {
            Request::Lend { desc, .. } => v.extend(desc.encode()),
            Request::LendIpc { desc, handle, .. } => {
                v.extend(desc.encode());
                v.extend_from_slice(handle);
            }
            Request::Recall { .. } => {}
        }
        v
    }

    /// A request as a peer sent it, checked against where the ranks run (`places`, this rank
    /// `me`): the lender is another process's rank, the request came from that process
    /// (`sender`: the socket's `SO_PEERCRED`, so that another process of the same user cannot
    /// lend or recall in a rank's name), and a lent buffer is that process's, on its GPU,
    /// inside its allocation.
    pub fn parse(b: &[u8], places: &[Place], me: Rank, sender: u32) -> Result<Request, Error> {
        let bad = |why: String| Error::Protocol(format!("mapper: {why}"));
        if b.len() < 13 {
            return Err(bad(format!("a request of {} bytes", b.len())));
        }
        let from = u32::from_le_bytes(b[1..5].try_into().expect("4 bytes"));
        let id = u64::from_le_bytes(b[5..13].try_into().expect("8 bytes"));
        let place = places
            .get(from as usize)
            .filter(|_| from as usize != me)
            .ok_or_else(|| bad(format!("rank {from} is not a peer")))?;
        if place.pid == std::process::id() {
            return Err(bad(format!(
                "rank {from} runs in this process: it needs no mapper"
            )));
        }
        if place.pid != sender {
            return Err(bad(format!(
                "a request for rank {from} (pid {}) came from pid {sender}",
                place.pid
            )));
        }
        let lent = |d: &[u8]| {
            let desc = WindowDesc::parse(d)?;
            if desc.pid != place.pid || desc.gpu != place.gpu {
                return Err(bad(format!(
                    "rank {from} lends a buffer of pid {} GPU {}, but runs as pid {} on GPU {}",
                    desc.pid, desc.gpu, place.pid, place.gpu
                )));
            }
            Ok(desc)
        };
        match (b[0], b.len() - 13) {
            (LEND, WindowDesc::LEN) => Ok(Request::Lend {
                from,
                id,
                desc: lent(&b[13..])?,
            }),
            (LEND_IPC, n) if n == WindowDesc::LEN + IPC_HANDLE_LEN => {
                let (d, h) = b[13..].split_at(WindowDesc::LEN);
                Ok(Request::LendIpc {
                    from,
                    id,
                    desc: lent(d)?,
                    handle: h.try_into().expect("the handle's length"),
                })
            }
            (RECALL, 0) => Ok(Request::Recall { from, id }),
            (tag, extra) => Err(bad(format!("request {tag:#x} with {extra} more bytes"))),
        }
    }
}

/// What the mapper answers: the lent buffer's address here, or why not.
pub(crate) fn encode_reply(r: &Result<u64, Error>) -> Vec<u8> {
    match r {
        Ok(addr) => {
            let mut v = vec![OK];
            v.extend_from_slice(&addr.to_le_bytes());
            v
        }
        Err(e) => {
            let mut v = vec![REFUSED];
            v.extend(e.to_string().bytes().take(300));
            v
        }
    }
}

pub(crate) fn parse_reply(b: &[u8]) -> Result<u64, Error> {
    match b.split_first() {
        Some((&OK, rest)) if rest.len() == 8 => {
            Ok(u64::from_le_bytes(rest.try_into().expect("8 bytes")))
        }
        Some((&REFUSED, why)) => Err(Error::Remote(format!(
            "the peer's mapper refused: {}",
            String::from_utf8_lossy(why)
        ))),
        _ => Err(Error::Protocol(format!(
            "mapper: a reply of {} bytes",
            b.len()
        ))),
    }
}

/// How a lent allocation of `len` bytes comes: by the descriptor beside the request, or by a
/// CUDA IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Import {
    Fd {
        len: u64,
    },
    Ipc {
        len: u64,
        handle: [u8; IPC_HANDLE_LEN],
    },
}

/// The buffers a mapper holds, by (lender, registration): each mapping, and the range of this
/// process's addresses it takes; and what the mapper does with a request. `import` maps a lent
/// allocation and returns the mapping, its address and the bytes it maps.
pub(crate) struct Loans<B> {
    held: HashMap<(u32, u64), (B, std::ops::Range<u64>)>,
}

impl<B> Default for Loans<B> {
    fn default() -> Self {
        Loans {
            held: HashMap::new(),
        }
    }
}

impl<B> Loans<B> {
    /// Serves one request (`fds`: the descriptors that came with it); returns the address of a
    /// lent buffer as mapped here (0 for a recall).
    pub fn serve(
        &mut self,
        req: Request,
        fds: usize,
        import: impl FnOnce(Import) -> Result<(B, u64, u64), Error>,
    ) -> Result<u64, Error> {
        match req {
            Request::Lend { from, id, desc } | Request::LendIpc { from, id, desc, .. } => {
                let (how, want) = match req {
                    Request::LendIpc { handle, .. } => (
                        Import::Ipc {
                            len: desc.alloc_len,
                            handle,
                        },
                        0,
                    ),
                    _ => (
                        Import::Fd {
                            len: desc.alloc_len,
                        },
                        1,
                    ),
                };
                if fds != want {
                    return Err(Error::Protocol(format!(
                        "mapper: a loan came with {fds} descriptors, not {want}"
                    )));
                }
                if self.held.contains_key(&(from, id)) {
                    return Err(Error::Protocol(format!(
                        "mapper: rank {from} lends registration {id} twice"
                    )));
                }
                if self.held.len() >= MAX_LOANS {
                    return Err(Error::InvalidArgument(format!(
                        "mapper: {MAX_LOANS} buffers mapped already"
                    )));
                }
                let (buf, base, mapped) = import(how)?;
                if mapped < desc.alloc_len {
                    // An IPC handle names its allocation, which the driver maps whole (its
                    // length rounded up to pages): what the lender describes must lie in it, or
                    // a posting inside the described range could name addresses not mapped.
                    return Err(Error::Protocol(format!(
                        "mapper: rank {from} lends {} bytes of an allocation mapped here in {mapped}",
                        desc.alloc_len
                    )));
                }
                let addr = base + (desc.ptr - desc.alloc_base);
                self.held
                    .insert((from, id), (buf, base..base + desc.alloc_len));
                Ok(addr)
            }
            Request::Recall { from, id } => {
                if fds != 0 {
                    return Err(Error::Protocol(format!(
                        "mapper: a recall came with {fds} descriptors"
                    )));
                }
                // Forgetting unmaps (the buffer's drop); a recall of nothing is not an error:
                // the loan may have failed.
                self.held.remove(&(from, id));
                Ok(0)
            }
        }
    }
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether a mapping lent by rank `from` holds all of `[addr, addr + len)`: what a posting of
    /// an output mapped on the fly must name (`CudaComm::posted_far`).
    pub fn holds(&self, from: Rank, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        self.held
            .iter()
            .any(|(&(f, _), (_, r))| f as usize == from && addr >= r.start && end <= r.end)
    }
}

/// A lent allocation as a mapper maps it.
#[allow(dead_code)] // Held for their drops, which unmap.
enum Mapping {
    CuMem(DeviceBuffer),
    Ipc(IpcMapping),
}

/// A rank's mapper thread; stopped and joined on drop (its mappings go with it).
pub(crate) struct Mapper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// What it holds, shared with the thread (which locks it for each request it serves).
    loans: Arc<Mutex<Loans<Mapping>>>,
}

impl Mapper {
    /// Starts rank `me`'s mapper for communicator `comm_id`, mapping on `gpu`; listening before
    /// it returns, so a peer may lend as soon as creation is over.
    pub fn start(
        gpu: &Gpu,
        comm_id: u64,
        me: Rank,
        places: Vec<Place>,
        stats: &Arc<MemStats>,
    ) -> Result<Mapper, Error> {
        let listener = FdListener::bind(socket_job(comm_id), me as u32)?;
        let stop = Arc::new(AtomicBool::new(false));
        let loans = Arc::new(Mutex::new(Loans::default()));
        let (gpu, stats, halt, held) = (gpu.clone(), stats.clone(), stop.clone(), loans.clone());
        let thread = std::thread::Builder::new()
            .name(format!("ferroccl-mapper-{me}"))
            .spawn(move || serve(&listener, &gpu, me, &places, &stats, &halt, &held))
            .map_err(|e| Error::System(format!("starting the mapper thread: {e}")))?;
        Ok(Mapper {
            stop,
            thread: Some(thread),
            loans,
        })
    }

    /// Whether this mapper holds a mapping lent by rank `from` that covers `[addr, addr + len)`.
    pub fn holds(&self, from: Rank, addr: u64, len: u64) -> bool {
        self.loans.lock().is_ok_and(|l| l.holds(from, addr, len))
    }
}

impl Drop for Mapper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    listener: &FdListener,
    gpu: &Gpu,
    me: Rank,
    places: &[Place],
    stats: &Arc<MemStats>,
    stop: &AtomicBool,
    loans: &Mutex<Loans<Mapping>>,
) {
    while !stop.load(Ordering::Relaxed) {
        // Short waits: the stop word is looked at between them.
        let Ok(ch) = listener.accept(Instant::now() + Duration::from_millis(200), stop) else {
            continue;
        };
        let deadline = Instant::now() + MESSAGE_WAIT;
        let Ok((fds, payload)) = ch.recv_fds(deadline, stop) else {
            continue;
        };
        let reply = match loans.lock() {
            Ok(mut loans) => {
                answer(
                    &ch,
                    &payload,
                    fds.len(),
                    places,
                    me,
                    &mut loans,
                    |how| match how {
                        Import::Fd { len } => {
                            let b = DeviceBuffer::import(
                                fds[0].as_fd(),
                                len as usize,
                                gpu,
                                &[],
                                stats,
                            )?;
                            let base = b.device_ptr();
                            Ok((Mapping::CuMem(b), base, len))
                        }
                        Import::Ipc { handle, .. } => {
                            let m = IpcMapping::open(gpu, &handle, stats)?;
                            let (base, len) = (m.device_ptr(), m.len() as u64);
                            Ok((Mapping::Ipc(m), base, len))
                        }
                    },
                )
            }
            Err(_) => Err(Error::Internal(
                "mapper: its loans' lock is poisoned".into(),
            )),
        };
        if let Err(e) = &reply {
            tracing::warn!(rank = me, "mapper: {e}");
        }
        let _ = ch.send_fds(&[], &encode_reply(&reply), deadline, stop);
    }
}

/// A lend that failed: why, and whether the peer's mapper may hold the loan all the same (the
/// request went out and no readable answer came back), so that deregistration recalls it.
#[derive(Debug)]
pub(crate) struct LendFailed {
    pub error: Error,
    pub maybe_mapped: bool,
}

/// Connects to rank `to`'s mapper, which must run in process `pid` (`SO_PEERCRED`): another
/// process of the same user holding the socket's name gets no descriptor of ours.
fn connect_mapper(
    comm_id: u64,
    to: Rank,
    pid: u32,
    deadline: Instant,
    abort: &AtomicBool,
) -> Result<FdChannel, Error> {
    let ch = FdChannel::connect(socket_job(comm_id), to as u32, deadline, abort)?;
    let got = ch.peer_pid()?;
    if got != pid {
        return Err(Error::Protocol(format!(
            "mapper: rank {to}'s mapper socket is held by pid {got}, not by rank {to} (pid {pid})"
        )));
    }
    Ok(ch)
}

/// What the mapper answers a request (`payload`, with `nfds` descriptors) that came over `ch`:
/// checked, from its rank's process, then served.
fn answer<B>(
    ch: &FdChannel,
    payload: &[u8],
    nfds: usize,
    places: &[Place],
    me: Rank,
    loans: &mut Loans<B>,
    import: impl FnOnce(Import) -> Result<(B, u64, u64), Error>,
) -> Result<u64, Error> {
    let req = Request::parse(payload, places, me, ch.peer_pid()?)?;
    loans.serve(req, nfds, import)
}

/// Lends registration `id` of rank `from` (described by `desc`, with its allocation's fd `fd`
/// where it is a cuMem allocation's loan; an IPC loan carries its handle) to rank `to`'s mapper,
/// in process `pid`; returns where `to` maps the buffer.
pub(crate) fn lend(
    comm_id: u64,
    to: Rank,
    pid: u32,
    req: &Request,
    fd: Option<BorrowedFd<'_>>,
    deadline: Instant,
    abort: &AtomicBool,
) -> Result<u64, LendFailed> {
    let unsent = |error| LendFailed {
        error,
        maybe_mapped: false,
    };
    let ch = connect_mapper(comm_id, to, pid, deadline, abort).map_err(unsent)?;
    // A sequenced-packet send delivers the whole message or nothing.
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    ch.send_fds(&fds, &req.encode(), deadline, abort)
        .map_err(unsent)?;
    let reply = ch.recv_fds(deadline, abort).map_err(|error| LendFailed {
        error,
        maybe_mapped: true,
    })?;
    parse_reply(&reply.1).map_err(|error| LendFailed {
        // A refusal is an answer (nothing mapped); a reply that does not parse is none.
        maybe_mapped: !matches!(error, Error::Remote(_)),
        error,
    })
}

/// Asks rank `to`'s mapper, in process `pid`, to unmap a loan.
pub(crate) fn recall(
    comm_id: u64,
    to: Rank,
    pid: u32,
    req: &Request,
    deadline: Instant,
    abort: &AtomicBool,
) -> Result<(), Error> {
    let ch = connect_mapper(comm_id, to, pid, deadline, abort)?;
    ch.send_fds(&[], &req.encode(), deadline, abort)?;
    let (_, reply) = ch.recv_fds(deadline, abort)?;
    parse_reply(&reply).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places() -> Vec<Place> {
        let me = std::process::id();
        vec![
            Place { pid: me, gpu: 0 },
            Place {
                pid: me + 1,
                gpu: 1,
            },
            Place { pid: me, gpu: 2 },
        ]
    }
    fn desc_of(pid: u32, gpu: u32) -> WindowDesc {
        WindowDesc {
            pid,
            gpu,
            ptr: 0x2000_1000,
            len: 4096,
            alloc_base: 0x2000_0000,
            alloc_len: 2 << 20,
            symmetric: false,
        }
    }

    #[test]
    fn requests_round_trip_and_are_checked_against_the_ranks() {
        let p = places();
        let lend = Request::Lend {
            from: 1,
            id: 7,
            desc: desc_of(p[1].pid, 1),
        };
        assert_eq!(
            Request::parse(&lend.encode(), &p, 0, p[1].pid).unwrap(),
            lend
        );
        let recall = Request::Recall { from: 1, id: 7 };
        assert_eq!(
            Request::parse(&recall.encode(), &p, 0, p[1].pid).unwrap(),
            recall
        );
        let err = |b: &[u8]| Request::parse(b, &p, 0, p[1].pid).unwrap_err().to_string();
        // Not a peer: out of range, this rank, a rank of this process.
        assert!(err(&Request::Recall { from: 3, id: 1 }.encode()).contains("not a peer"));
        assert!(err(&Request::Recall { from: 0, id: 1 }.encode()).contains("not a peer"));
        assert!(err(&Request::Recall { from: 2, id: 1 }.encode()).contains("needs no mapper"));
        // A buffer of another process or GPU than the lender's.
        assert!(err(&Request::Lend {
            from: 1,
            id: 7,
            desc: desc_of(p[1].pid + 5, 1)
        }
        .encode())
        .contains("runs as pid"));
        assert!(err(&Request::Lend {
            from: 1,
            id: 7,
            desc: desc_of(p[1].pid, 0)
        }
        .encode())
        .contains("runs as pid"));
        // Truncated, padded, unknown, a range outside its allocation.
        let b = lend.encode();
        assert!(err(&b[..5]).contains("request of 5 bytes"));
        assert!(err(&b[..b.len() - 1]).contains("more bytes"));
        let mut padded = recall.encode();
        padded.push(0);
        assert!(err(&padded).contains("more bytes"));
        let mut unknown = recall.encode();
        unknown[0] = b'X';
        assert!(err(&unknown).contains("request 0x58"));
        let outside = WindowDesc {
            ptr: 0x1000,
            ..desc_of(p[1].pid, 1)
        };
        assert!(err(&Request::Lend {
            from: 1,
            id: 7,
            desc: outside
        }
        .encode())
        .contains("not inside"));
    }

    #[test]
    fn a_request_must_come_from_its_ranks_process() {
        let p = places();
        let lend = Request::Lend {
            from: 1,
            id: 7,
            desc: desc_of(p[1].pid, 1),
        };
        let parse = |r: &Request, sender| Request::parse(&r.encode(), &p, 0, sender);
        assert_eq!(parse(&lend, p[1].pid).unwrap(), lend);
        let e = parse(&lend, p[1].pid + 9).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("came from pid"), "{e}");
        let recall = Request::Recall { from: 1, id: 7 };
        assert!(parse(&recall, std::process::id())
            .unwrap_err()
            .to_string()
            .contains("came from pid"));
        // The kernel's record of a socket's peer: this process, for a pair made here.
        let (a, b) = FdChannel::pair().unwrap();
        assert_eq!(a.peer_pid().unwrap(), std::process::id());
        assert_eq!(b.peer_pid().unwrap(), std::process::id());
        // So the mapper refuses a lend in rank 1's name that came over it, mapping nothing.
        let mut loans: Loans<u32> = Loans::default();
        let e = answer(&b, &lend.encode(), 1, &p, 0, &mut loans, |_| {
            panic!("nothing may be mapped")
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("came from pid"), "{e}");
        assert_eq!(loans.len(), 0);
    }

    /// What a lender learns from a mapper that answers, refuses, says nothing, or is not there:
    /// only a lost answer leaves a loan to recall.
    #[test]
    fn a_lend_whose_answer_is_lost_may_have_been_mapped() {
        use std::os::fd::{FromRawFd, OwnedFd};
        let fd = unsafe { libc::memfd_create(c"ferroccl-lend-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let abort = AtomicBool::new(false);
        let comm_id = 0x5eed_0000_0000_0000 ^ u64::from(std::process::id());
        let req = Request::Lend {
            from: 1,
            id: 3,
            desc: desc_of(1, 1),
        };
        let soon = || Instant::now() + Duration::from_millis(300);
        // Nobody listens: nothing was sent.
        let here = std::process::id();
        let f = lend(comm_id, 0, here, &req, Some(fd.as_fd()), soon(), &abort).unwrap_err();
        assert!(!f.maybe_mapped, "{:?}", f.error);
        let listener = FdListener::bind(socket_job(comm_id), 0).unwrap();
        // The socket is held by another process than rank 0's: no descriptor goes out.
        std::thread::scope(|s| {
            s.spawn(|| {
                let never = AtomicBool::new(false);
                let ch = listener.accept(soon(), &never).unwrap();
                assert!(ch.recv_fds(soon(), &never).is_err(), "nothing was sent");
            });
            let f = lend(comm_id, 0, here + 1, &req, Some(fd.as_fd()), soon(), &abort).unwrap_err();
            assert!(!f.maybe_mapped, "{:?}", f.error);
            assert!(
                f.error.to_string().contains("is held by pid"),
                "{}",
                f.error
            );
        });
        for (answer, want) in [
            (Some(encode_reply(&Ok(0x7000))), None),
            (
                Some(encode_reply(&Err(Error::InvalidArgument("full".into())))),
                Some(false),
            ),
            (Some(vec![OK, 1]), Some(true)),
            (None, Some(true)),
        ] {
            let server = std::thread::scope(|s| {
                let t = s.spawn(|| {
                    let never = AtomicBool::new(false);
                    let ch = listener.accept(soon(), &never).unwrap();
                    let (fds, payload) = ch.recv_fds(soon(), &never).unwrap();
                    assert_eq!((fds.len(), payload), (1, req.encode()));
                    if let Some(a) = &answer {
                        ch.send_fds(&[], a, soon(), &never).unwrap();
                    } else {
                        // Hold the connection past the lender's deadline, then drop it.
                        std::thread::sleep(Duration::from_millis(400));
                    }
                });
                let got = lend(comm_id, 0, here, &req, Some(fd.as_fd()), soon(), &abort);
                t.join().unwrap();
                got
            });
            match (server, want) {
                (Ok(addr), None) => assert_eq!(addr, 0x7000),
                (Err(f), Some(m)) => assert_eq!(f.maybe_mapped, m, "{:?}", f.error),
                (got, want) => panic!("{got:?} where {want:?} was expected"),
            }
        }
    }

    #[test]
    fn replies_round_trip() {
        assert_eq!(
            parse_reply(&encode_reply(&Ok(0xdead_0000))).unwrap(),
            0xdead_0000
        );
        let e = parse_reply(&encode_reply(&Err(Error::InvalidArgument(
            "no room".into(),
        ))))
        .unwrap_err();
        assert!(
            matches!(e, Error::Remote(_)) && e.to_string().contains("no room"),
            "{e}"
        );
        assert!(parse_reply(&[OK, 1, 2]).is_err());
        assert!(parse_reply(&[]).is_err());
    }

    #[test]
    fn loans_map_once_unmap_on_recall_and_stay_bounded() {
        let p = places();
        let mut l: Loans<u32> = Loans::default();
        let lend = |id| Request::Lend {
            from: 1,
            id,
            desc: desc_of(p[1].pid, 1),
        };
        // Mapped at 0x9000_0000 here: the buffer's offset in its allocation carries over.
        assert_eq!(
            l.serve(lend(1), 1, |how| {
                assert_eq!(how, Import::Fd { len: 2 << 20 });
                Ok((11, 0x9000_0000, 2 << 20))
            })
            .unwrap(),
            0x9000_1000
        );
        assert!(l
            .serve(lend(1), 1, |_| Ok((12, 0, 2 << 20)))
            .unwrap_err()
            .to_string()
            .contains("twice"));
        assert!(l
            .serve(lend(2), 0, |_| Ok((12, 0, 2 << 20)))
            .unwrap_err()
            .to_string()
            .contains("0 descriptors"));
        // An import that fails maps nothing.
        assert!(l
            .serve(lend(3), 1, |_| Err(Error::Internal("no".into())))
            .is_err());
        assert_eq!(l.len(), 1);
        // What it holds: the whole allocation as mapped here, lent by rank 1 only.
        assert!(l.holds(1, 0x9000_1000, 4096) && l.holds(1, 0x9000_0000, 2 << 20));
        assert!(!l.holds(1, 0x9000_0000, (2 << 20) + 1), "past the mapping");
        assert!(!l.holds(1, 0x8fff_ffff, 2), "before it");
        assert!(!l.holds(2, 0x9000_1000, 4096), "another lender");
        assert!(!l.holds(1, u64::MAX, 2), "wrapping");
        assert_eq!(
            l.serve(Request::Recall { from: 1, id: 1 }, 0, |_| unreachable!())
                .unwrap(),
            0
        );
        assert_eq!(l.len(), 0);
        assert!(!l.holds(1, 0x9000_1000, 4096), "recalled");
        assert_eq!(
            l.serve(Request::Recall { from: 1, id: 1 }, 0, |_| unreachable!())
                .unwrap(),
            0,
            "a recall of nothing"
        );
        for id in 0..MAX_LOANS as u64 {
            l.serve(lend(id), 1, |_| Ok((0, 0x1000_0000, 2 << 20)))
                .unwrap();
        }
        assert!(l
            .serve(lend(u64::MAX), 1, |_| Ok((0, 0, 2 << 20)))
            .unwrap_err()
            .to_string()
            .contains("mapped already"));
    }

    /// A `cuMemAlloc` allocation's loan: its IPC handle rides in the request (no descriptor),
    /// and the mapper maps it only where the driver's mapping covers the allocation the lender
    /// describes.
    #[test]
    fn ipc_loans_carry_their_handle_and_must_describe_their_whole_allocation() {
        let p = places();
        let mut handle = [0u8; IPC_HANDLE_LEN];
        handle
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 ^ 0x5a);
        let ipc = |id| Request::LendIpc {
            from: 1,
            id,
            desc: desc_of(p[1].pid, 1),
            handle,
        };
        let b = ipc(4).encode();
        assert_eq!(b[0], LEND_IPC);
        assert_eq!(Request::parse(&b, &p, 0, p[1].pid).unwrap(), ipc(4));
        // Its handle is part of the message: cut short or padded, it is refused.
        let err = |b: &[u8]| Request::parse(b, &p, 0, p[1].pid).unwrap_err().to_string();
        assert!(err(&b[..b.len() - 1]).contains("more bytes"));
        let mut padded = b.clone();
        padded.push(0);
        assert!(err(&padded).contains("more bytes"));
        // A cuMem loan's length is not an IPC loan's, nor the other way round.
        let mut as_fd = b.clone();
        as_fd[0] = LEND;
        assert!(err(&as_fd).contains("more bytes"));
        // The same checks of its description as a descriptor's loan.
        assert!(err(&Request::LendIpc {
            from: 1,
            id: 4,
            desc: desc_of(p[1].pid, 0),
            handle
        }
        .encode())
        .contains("runs as pid"));

        let mut l: Loans<u32> = Loans::default();
        assert_eq!(
            l.serve(ipc(1), 0, |how| {
                assert_eq!(
                    how,
                    Import::Ipc {
                        len: 2 << 20,
                        handle
                    }
                );
                Ok((11, 0x9000_0000, 2 << 20))
            })
            .unwrap(),
            0x9000_1000
        );
        assert!(l.holds(1, 0x9000_1000, 4096));
        // No descriptor may come with it.
        assert!(l
            .serve(ipc(2), 1, |_| unreachable!())
            .unwrap_err()
            .to_string()
            .contains("1 descriptors, not 0"));
        // The driver maps less than the lender describes: dropped, not held.
        let dropped = std::cell::Cell::new(false);
        struct Probe<'a>(&'a std::cell::Cell<bool>);
        impl Drop for Probe<'_> {
            fn drop(&mut self) {
                self.0.set(true);
            }
        }
        let mut l2: Loans<Probe> = Loans::default();
        let e = l2
            .serve(ipc(3), 0, |_| Ok((Probe(&dropped), 0x9000_0000, 1 << 20)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("mapped here in"), "{e}");
        assert!(dropped.get(), "the mapping is undone");
        assert!(!l2.holds(1, 0x9000_1000, 4096));
        // More (the allocation's length rounded up to the driver's pages) is what it lends.
        assert_eq!(
            l2.serve(ipc(4), 0, |_| Ok((Probe(&dropped), 0xa000_0000, 4 << 20)))
                .unwrap(),
            0xa000_1000
        );
        assert!(l2.holds(1, 0xa000_0000, 2 << 20) && !l2.holds(1, 0xa000_0000, (2 << 20) + 1));
        // A recall unmaps it as any loan.
        l.serve(Request::Recall { from: 1, id: 1 }, 0, |_| unreachable!())
            .unwrap();
        assert_eq!(l.len(), 0);
    }

    /// Two mappers' worth of the socket protocol in one process: a cuMem loan (with its
    /// descriptor) and a `cudaMalloc` one (its IPC handle in the message, no descriptor), each
    /// built as a lender builds it, reach a listener and come back answered, and so do their
    /// recalls (the GPU import stands in a closure here).
    #[test]
    fn lend_and_recall_cross_the_socket() {
        let comm_id = 0x5eed_0000_0000_0001 ^ std::process::id() as u64;
        let me = 0;
        let p = places();
        let listener = FdListener::bind(socket_job(comm_id), me as u32).unwrap();
        let stop = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        let handle = [0x3cu8; IPC_HANDLE_LEN];
        std::thread::scope(|s| {
            s.spawn(|| {
                // What each loan came as: its descriptor, or none (an IPC loan).
                let mut loans: Loans<Option<std::os::fd::OwnedFd>> = Loans::default();
                for _ in 0..4 {
                    let ch = listener.accept(deadline, &stop).unwrap();
                    let (mut fds, payload) = ch.recv_fds(deadline, &stop).unwrap();
                    let n = fds.len();
                    // The lender here is this process, speaking for rank 1 (`answer`
                    // refuses that: a_request_must_come_from_its_ranks_process).
                    let r = Request::parse(&payload, &p, me, p[1].pid).and_then(|req| {
                        loans.serve(req, n, |how| match how {
                            Import::Fd { len } => Ok((fds.pop(), 0x7000_0000, len)),
                            Import::Ipc { len, handle: h } => {
                                assert_eq!(h, handle, "the handle crossed whole");
                                Ok((None, 0x7100_0000, len))
                            }
                        })
                    });
                    ch.send_fds(&[], &encode_reply(&r), deadline, &stop)
                        .unwrap();
                }
                assert_eq!(loans.len(), 0);
            });
            let memfd = std::fs::File::open("/dev/null").unwrap();
            let desc = desc_of(p[1].pid, 1);
            // A cuMem allocation's loan and a cudaMalloc one's, as a lender builds them.
            let shared_fd = Shared::Fd(memfd.as_fd().try_clone_to_owned().unwrap());
            let (req, fd) = Request::lend_of(1, 3, desc, &shared_fd);
            assert!(matches!(req, Request::Lend { id: 3, .. }) && fd.is_some());
            let shared_ipc = Shared::Ipc(handle);
            let (req_ipc, no_fd) = Request::lend_of(1, 4, desc, &shared_ipc);
            assert!(matches!(req_ipc, Request::LendIpc { id: 4, .. }) && no_fd.is_none());
            for (req, fd, at) in [(req, fd, 0x7000_1000), (req_ipc, no_fd, 0x7100_1000)] {
                let id = match req {
                    Request::Lend { id, .. } | Request::LendIpc { id, .. } => id,
                    Request::Recall { .. } => unreachable!(),
                };
                assert_eq!(
                    lend(comm_id, me, std::process::id(), &req, fd, deadline, &stop).unwrap(),
                    at
                );
                recall(
                    comm_id,
                    me,
                    std::process::id(),
                    &Request::Recall { from: 1, id },
                    deadline,
                    &stop,
                )
                .unwrap();
            }
        });
    }
}
