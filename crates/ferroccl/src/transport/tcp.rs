//! Bridges between a local heap FIFO and a TCP socket, for ranks on different hosts.
//!
//! The executor only ever sees a Producer or Consumer, exactly as for shared memory; a thread
//! per direction moves slots between the FIFO and the socket. Each socket carries one
//! direction only: a 4-byte preamble naming the frame check ("FCT0" none, "FCT1" CRC32C),
//! then frames: a little-endian u32 length, that many bytes, and with CRC32C a u32 checksum
//! of the length and the bytes. The preamble makes ranks that disagree on the check fail at
//! the first frame instead of misreading each other's streams.

use super::crc32c;
use super::fifo::{Consumer, FifoLayout, FifoMem, PoisonKind, Producer};
use crate::Error;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a bridge thread blocked on the socket or the FIFO looks at abort/close flags.
const POLL: Duration = Duration::from_millis(10);

/// After its producer is dropped, a sender keeps flushing what is queued, but gives up if the
/// peer accepts nothing for this long, so that a hung peer cannot pin the thread forever.
const LINGER: Duration = Duration::from_secs(10);

/// What protects each frame against corruption in transit (TCP's own 16-bit checksum misses
/// some errors, and middleboxes that rewrite payloads recompute it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FrameCheck {
    #[default]
    None,
    /// A CRC32C of each frame's length and payload (`Config::tcp_crc`).
    Crc32c,
}

impl FrameCheck {
    pub fn from_config(crc: bool) -> FrameCheck {
        if crc {
            FrameCheck::Crc32c
        } else {
            FrameCheck::None
        }
    }
    fn preamble(self) -> [u8; 4] {
        match self {
            FrameCheck::None => *b"FCT0",
            FrameCheck::Crc32c => *b"FCT1",
        }
    }
    fn name(self) -> &'static str {
        match self {
            FrameCheck::None => "off",
            FrameCheck::Crc32c => "on",
        }
    }
}

/// Why a socket loop stopped early.
enum Stop {
    /// Our own side is done (local end dropped or already poisoned): exit quietly.
    Local,
    /// Fail the FIFO with this.
    Fail(PoisonKind, String),
}

fn io_stop(label: &str, e: &io::Error) -> Stop {
    let what = match e.kind() {
        io::ErrorKind::ConnectionReset => "connection reset by peer".to_string(),
        io::ErrorKind::BrokenPipe => "connection closed by peer (broken pipe)".to_string(),
        io::ErrorKind::ConnectionAborted => "connection aborted".to_string(),
        _ => format!("socket error: {e}"),
    };
    Stop::Fail(PoisonKind::Remote, format!("{label}: {what}"))
}

fn prepare(stream: &TcpStream, label: &str) -> Result<(), Error> {
    let sys = |e: io::Error| Error::System(format!("{label}: configuring socket: {e}"));
    stream.set_nodelay(true).map_err(sys)?;
    // Timeouts turn blocking socket calls into polls of the abort/close flags.
    stream.set_read_timeout(Some(POLL)).map_err(sys)?;
    stream.set_write_timeout(Some(POLL)).map_err(sys)?;
    Ok(())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

fn spawn(
    name: &str,
    label: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| {
            Error::System(format!(
                "{label}: cannot start a transport thread: {e} (thread or memory limit reached)"
            ))
        })
}

#[cfg(test)]
/// Starts a thread that sends everything committed to the returned Producer over `stream`.
pub fn tcp_sender(
    stream: TcpStream,
    layout: FifoLayout,
    check: FrameCheck,
    label: String,
    abort: Arc<AtomicBool>,
) -> Result<Producer, Error> {
    tcp_sender_joinable(stream, layout, check, label, abort).map(|(p, _)| p)
}

/// `tcp_sender`, with the thread's handle: it exits within `POLL` of an abort, or once it has
/// sent everything after the Producer is dropped.
pub fn tcp_sender_joinable(
    stream: TcpStream,
    layout: FifoLayout,
    check: FrameCheck,
    label: String,
    abort: Arc<AtomicBool>,
) -> Result<(Producer, JoinHandle<()>), Error> {
    prepare(&stream, &label)?;
    let mem = FifoMem::heap(layout)?;
    let producer = Producer::new(mem.clone());
    let mut consumer = Consumer::new(mem);
    let t = spawn("ferroccl-tcp-tx", &label.clone(), move || {
        if let Stop::Fail(kind, reason) = send_loop(&stream, &mut consumer, check, &label, &abort) {
            tracing::debug!("{reason}");
            consumer.mem().poison_kind(kind, &reason);
        }
        let _ = stream.shutdown(Shutdown::Both);
    })?;
    Ok((producer, t))
}

fn send_loop(
    stream: &TcpStream,
    consumer: &mut Consumer,
    check: FrameCheck,
    label: &str,
    abort: &AtomicBool,
) -> Stop {
    let mut stream = stream;
    if let Err(s) = write_frame(&mut stream, &[&check.preamble()], consumer, label, abort) {
        return s;
    }
    loop {
        if abort.load(Ordering::Acquire) {
            return Stop::Fail(PoisonKind::Aborted, format!("{label}: aborted"));
        }
        if let Some(e) = consumer.mem().poison_error() {
            send_poison(stream, &e.to_string());
            return Stop::Local;
        }
        match consumer.try_peek() {
            Ok(Some((p, len))) => {
                // SAFETY: the slot holds `len` published bytes and is ours until release().
                let payload = unsafe { std::slice::from_raw_parts(p, len) };
                let hdr = (len as u32).to_le_bytes();
                let sum = match check {
                    FrameCheck::None => &[][..],
                    FrameCheck::Crc32c => {
                        &crc32c::extend(crc32c::crc32c(&hdr), payload).to_le_bytes()[..]
                    }
                };
                if let Err(s) =
                    write_frame(&mut stream, &[&hdr, payload, sum], consumer, label, abort)
                {
                    return s;
                }
                consumer.release();
            }
            Ok(None) => {
                if let Some(s) = peer_gone(stream, label) {
                    return s;
                }
                consumer.wait(POLL);
            }
            // Drained after the producer was dropped: a clean end, which the peer sees as EOF.
            Err(_) if consumer.peer_closed() && !consumer.mem().is_poisoned() => {
                let _ = stream.flush();
                return Stop::Local;
            }
            Err(_) => return Stop::Local,
        }
    }
}

/// Frame length that announces a failure instead of data: the reason follows (u32 length +
/// UTF-8), so that a rank on another host learns why its peer stopped, not just that it did.
const POISON_FRAME: u32 = u32::MAX;
const MAX_REASON: usize = 1024;

/// Best effort: the socket may already be unusable, and the peer learns of the failure by EOF.
fn send_poison(mut stream: &TcpStream, reason: &str) {
    let reason = ferroccl_core::types::clip_message(reason, MAX_REASON);
    let r = reason.as_bytes();
    let mut frame = Vec::with_capacity(8 + r.len());
    frame.extend_from_slice(&POISON_FRAME.to_le_bytes());
    frame.extend_from_slice(&(r.len() as u32).to_le_bytes());
    frame.extend_from_slice(r);
    let _ = stream.write_all(&frame);
}

/// Nothing is ever sent back on a send-only socket, so readability means EOF or reset. This
/// is what tells an idle sender that the receiving rank went away.
fn peer_gone(stream: &TcpStream, label: &str) -> Option<Stop> {
    let mut b = 0u8;
    // SAFETY: one-byte peek into a local; MSG_DONTWAIT keeps it from blocking.
    let r = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            &mut b as *mut u8 as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match r {
        0 => Some(Stop::Fail(
            PoisonKind::Remote,
            format!("{label}: connection closed by peer"),
        )),
        n if n > 0 => Some(Stop::Fail(
            PoisonKind::Protocol,
            format!("{label}: peer sent data on a send-only connection"),
        )),
        _ => {
            let e = io::Error::last_os_error();
            if is_timeout(&e) {
                None
            } else {
                Some(io_stop(label, &e))
            }
        }
    }
}

/// A vectored write that never raises SIGPIPE. std's `write_vectored` is `writev`, which has no
/// flag against it: a write to a dead peer's socket would kill this process wherever the program
/// restored SIGPIPE's default disposition (the `ferroccl` command does; PyTorch programs may),
/// instead of failing with EPIPE. `sendmsg` takes MSG_NOSIGNAL.
pub(crate) fn send_vectored(stream: &TcpStream, iov: &[IoSlice]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed msghdr is valid; IoSlice is ABI-compatible with iovec on Unix, and the
    // slices outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Writes the concatenation of `parts` (a frame's header, payload and checksum), in as few
/// system calls as the socket allows.
fn write_frame(
    stream: &mut &TcpStream,
    parts: &[&[u8]],
    consumer: &Consumer,
    label: &str,
    abort: &AtomicBool,
) -> Result<(), Stop> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut done = 0usize;
    let mut last_progress = Instant::now();
    while done < total {
        // The unsent tail of `parts`, as slices for one vectored write.
        let mut skip = done;
        let mut iov: [IoSlice; 3] = [IoSlice::new(&[]), IoSlice::new(&[]), IoSlice::new(&[])];
        let mut k = 0;
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            iov[k] = IoSlice::new(&p[skip..]);
            skip = 0;
            k += 1;
        }
        match send_vectored(stream, &iov[..k]) {
            Ok(0) => {
                return Err(Stop::Fail(
                    PoisonKind::Remote,
                    format!("{label}: connection closed by peer"),
                ))
            }
            Ok(n) => {
                done += n;
                last_progress = Instant::now();
            }
            Err(e) if is_timeout(&e) => {
                if abort.load(Ordering::Acquire) {
                    return Err(Stop::Fail(PoisonKind::Aborted, format!("{label}: aborted")));
                }
                if consumer.mem().is_poisoned() {
                    return Err(Stop::Local);
                }
                if consumer.peer_closed() && last_progress.elapsed() > LINGER {
                    return Err(Stop::Fail(
                        PoisonKind::Remote,
                        format!("{label}: peer stopped reading; dropping unsent data at shutdown"),
                    ));
                }
            }
            Err(e) => return Err(io_stop(label, &e)),
        }
    }
    Ok(())
}

#[cfg(test)]
/// Starts a thread that receives frames from `stream` into the returned Consumer.
pub fn tcp_receiver(
    stream: TcpStream,
    layout: FifoLayout,
    check: FrameCheck,
    label: String,
    abort: Arc<AtomicBool>,
) -> Result<Consumer, Error> {
    tcp_receiver_joinable(stream, layout, check, label, abort).map(|(c, _)| c)
}

/// `tcp_receiver`, with the thread's handle: it exits within `POLL` of an abort, of the
/// Consumer being dropped, or of the peer closing.
pub fn tcp_receiver_joinable(
    stream: TcpStream,
    layout: FifoLayout,
    check: FrameCheck,
    label: String,
    abort: Arc<AtomicBool>,
) -> Result<(Consumer, JoinHandle<()>), Error> {
    prepare(&stream, &label)?;
    let mem = FifoMem::heap(layout)?;
    let consumer = Consumer::new(mem.clone());
    let mut producer = Producer::new(mem);
    let t = spawn("ferroccl-tcp-rx", &label.clone(), move || {
        if let Stop::Fail(kind, reason) = recv_loop(&stream, &mut producer, check, &label, &abort) {
            tracing::debug!("{reason}");
            producer.mem().poison_kind(kind, &reason);
        }
        let _ = stream.shutdown(Shutdown::Both);
    })?;
    Ok((consumer, t))
}

fn recv_loop(
    stream: &TcpStream,
    producer: &mut Producer,
    check: FrameCheck,
    label: &str,
    abort: &AtomicBool,
) -> Stop {
    let mut stream = stream;
    let slot_bytes = producer.slot_bytes();
    let mut pre = [0u8; 4];
    match read_full(&mut stream, &mut pre, producer, label, abort) {
        Ok(()) => {}
        Err(ReadEnd::Eof(_)) => {
            return Stop::Fail(
                PoisonKind::Remote,
                format!("{label}: connection closed by peer before its first frame"),
            )
        }
        Err(ReadEnd::Stop(s)) => return s,
    }
    if pre != check.preamble() {
        let theirs = [FrameCheck::None, FrameCheck::Crc32c]
            .into_iter()
            .find(|c| c.preamble() == pre);
        return Stop::Fail(
            PoisonKind::Protocol,
            match theirs {
                Some(t) => format!(
                    "{label}: the peer sends with FERROCCL_TCP_CRC {} but this rank expects it {}: set it the same way on every rank",
                    t.name(),
                    check.name()
                ),
                None => format!("{label}: the peer's stream does not start like a ferroccl socket transport (bytes {pre:02x?})"),
            },
        );
    }
    let mut frames = 0u64;
    loop {
        let mut hdr = [0u8; 4];
        match read_full(&mut stream, &mut hdr, producer, label, abort) {
            Ok(()) => {}
            Err(ReadEnd::Eof(0)) => {
                return Stop::Fail(
                    PoisonKind::Remote,
                    format!("{label}: connection closed by peer"),
                );
            }
            Err(ReadEnd::Eof(_)) => {
                return Stop::Fail(
                    PoisonKind::Remote,
                    format!("{label}: connection closed by peer in a frame header"),
                );
            }
            Err(ReadEnd::Stop(s)) => return s,
        }
        if u32::from_le_bytes(hdr) == POISON_FRAME {
            let mut lb = [0u8; 4];
            let mut reason = String::from("(no reason)");
            if read_full(&mut stream, &mut lb, producer, label, abort).is_ok() {
                let n = (u32::from_le_bytes(lb) as usize).min(MAX_REASON);
                let mut b = vec![0u8; n];
                if read_full(&mut stream, &mut b, producer, label, abort).is_ok() {
                    reason = String::from_utf8_lossy(&b).into_owned();
                }
            }
            return Stop::Fail(
                PoisonKind::Remote,
                format!("{label}: the peer failed: {reason}"),
            );
        }
        let len = u32::from_le_bytes(hdr) as usize;
        if len > slot_bytes {
            return Stop::Fail(
                PoisonKind::Protocol,
                format!("{label}: frame of {len} bytes exceeds the slot size of {slot_bytes} bytes (peers disagree on FERROCCL_SLOT_BYTES, or the stream is corrupt)"),
            );
        }
        let slot = loop {
            if abort.load(Ordering::Acquire) {
                return Stop::Fail(PoisonKind::Aborted, format!("{label}: aborted"));
            }
            match producer.try_reserve() {
                Ok(Some(p)) => break p,
                Ok(None) => producer.wait(POLL),
                Err(_) => return Stop::Local,
            }
        };
        // SAFETY: a reserved slot has slot_bytes >= len writable bytes that only we touch until commit.
        let buf = unsafe { std::slice::from_raw_parts_mut(slot, len) };
        match read_full(&mut stream, buf, producer, label, abort) {
            Ok(()) if check == FrameCheck::Crc32c => {
                let mut sum = [0u8; 4];
                match read_full(&mut stream, &mut sum, producer, label, abort) {
                    Ok(()) => {}
                    Err(ReadEnd::Eof(_)) => {
                        return Stop::Fail(
                            PoisonKind::Remote,
                            format!("{label}: connection closed by peer in a frame checksum"),
                        )
                    }
                    Err(ReadEnd::Stop(s)) => return s,
                }
                let (got, want) = (
                    u32::from_le_bytes(sum),
                    crc32c::extend(crc32c::crc32c(&hdr), buf),
                );
                if got != want {
                    // Not committed: the corrupt bytes never reach the executor.
                    return Stop::Fail(
                        PoisonKind::Protocol,
                        format!(
                            "{label}: CRC32C mismatch in frame {frames} ({len} bytes; sent {got:#010x}, received data \
                             gives {want:#010x}): the bytes were corrupted between the two hosts and were not used; check \
                             the network path (NIC, cable, middlebox) to that peer"
                        ),
                    );
                }
                frames += 1;
                producer.commit(len);
            }
            Ok(()) => {
                frames += 1;
                producer.commit(len);
            }
            Err(ReadEnd::Eof(got)) => {
                return Stop::Fail(
                    PoisonKind::Remote,
                    format!(
                        "{label}: connection closed by peer after {got} of {len} bytes of a frame"
                    ),
                );
            }
            Err(ReadEnd::Stop(s)) => return s,
        }
    }
}

enum ReadEnd {
    /// EOF after this many bytes of the buffer.
    Eof(usize),
    Stop(Stop),
}

fn read_full(
    stream: &mut &TcpStream,
    buf: &mut [u8],
    producer: &Producer,
    label: &str,
    abort: &AtomicBool,
) -> Result<(), ReadEnd> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(ReadEnd::Eof(got)),
            Ok(n) => got += n,
            Err(e) if is_timeout(&e) => {
                if abort.load(Ordering::Acquire) {
                    return Err(ReadEnd::Stop(Stop::Fail(
                        PoisonKind::Aborted,
                        format!("{label}: aborted"),
                    )));
                }
                if producer.peer_closed() || producer.mem().is_poisoned() {
                    return Err(ReadEnd::Stop(Stop::Local));
                }
            }
            Err(e) => return Err(ReadEnd::Stop(io_stop(label, &e))),
        }
    }
    Ok(())
}
