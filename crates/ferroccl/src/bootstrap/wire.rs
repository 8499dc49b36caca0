//! Deadline- and abort-aware socket I/O, length-prefixed frames, and a tiny binary codec.
//!
//! Every blocking call here wakes at least every `POLL` so that an abort flag set by another
//! thread (or a passed deadline) is noticed promptly even when the peer is silent.

use super::health::Health;
use ferroccl_core::Error;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a wait re-checks its abort flags and deadline; below the 100 ms promptness promise.
pub(crate) const POLL: Duration = Duration::from_millis(50);

/// The upper bound of a handshake, so that a silent connection cannot hold a listener's slot long.
pub(crate) const HANDSHAKE_MAX: Duration = Duration::from_secs(10);

/// A set of abort flags; any of them set aborts. A child communicator watches its parent's
/// flags too, while aborting the child leaves the parent alone. The communicator's health, when
/// present, ends waits too: a peer's death is an error naming it, not a wait until the deadline.
#[derive(Clone, Default)]
pub(crate) struct AbortSet {
    flags: Vec<Arc<AtomicBool>>,
    health: Option<Arc<Health>>,
}

impl AbortSet {
    pub fn new(flag: Arc<AtomicBool>) -> AbortSet {
        AbortSet {
            flags: vec![flag],
            health: None,
        }
    }

    pub fn with(&self, flag: Arc<AtomicBool>) -> AbortSet {
        let mut a = self.clone();
        a.flags.push(flag);
        a
    }

    /// The same flags, watching `health` (a communicator's own, replacing any parent's).
    pub fn with_health(&self, health: Arc<Health>) -> AbortSet {
        AbortSet {
            flags: self.flags.clone(),
            health: Some(health),
        }
    }

    pub fn is_set(&self) -> bool {
        self.flagged() || self.health.as_ref().is_some_and(|h| h.is_failed())
    }

    /// Our own abort (not a peer's failure).
    fn flagged(&self) -> bool {
        self.flags.iter().any(|f| f.load(Ordering::Acquire))
    }

    /// Why the wait must end: the peer failure first (it names who), else a plain abort.
    fn error(&self, doing: impl FnOnce() -> String) -> Error {
        match self.health.as_ref().and_then(|h| h.failure()) {
            Some(e) => e.context(doing()),
            None => Error::Aborted(doing()),
        }
    }
}

/// A deadline plus the abort flags that cut it short.
#[derive(Clone)]
pub(crate) struct Wait {
    pub deadline: Instant,
    pub timeout: Duration,
    /// Set when `timeout` is a handshake's cap rather than FERROCCL_TIMEOUT (which it holds),
    /// so that an expired wait names the limit that ended it.
    capped_from: Option<Duration>,
    pub abort: AbortSet,
}

impl Wait {
    pub fn new(timeout: Duration, abort: AbortSet) -> Wait {
        Wait {
            deadline: Instant::now() + timeout,
            timeout,
            capped_from: None,
            abort,
        }
    }

    /// A handshake's wait inside this one: at most `cap`, never beyond this one's deadline.
    pub fn capped(&self, cap: Duration) -> Wait {
        let d = Instant::now() + cap;
        if d >= self.deadline {
            return self.clone();
        }
        Wait {
            deadline: d,
            timeout: cap,
            capped_from: Some(self.capped_from.unwrap_or(self.timeout)),
            abort: self.abort.clone(),
        }
    }

    /// The limit and where it comes from, for messages: "30s (FERROCCL_TIMEOUT)".
    pub fn limit(&self) -> String {
        match self.capped_from {
            Some(t) => format!(
                "{:?} (the limit on a bootstrap handshake; FERROCCL_TIMEOUT is {t:?})",
                self.timeout
            ),
            None => format!("{:?} (FERROCCL_TIMEOUT)", self.timeout),
        }
    }

    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// `doing` describes the operation for the error message, e.g. "reading from rank 2 (addr)".
    pub fn check(&self, doing: impl FnOnce() -> String) -> Result<(), Error> {
        if self.abort.is_set() {
            return Err(self.abort.error(doing));
        }
        self.check_deadline(doing)
    }

    /// For a socket wait that found nothing to do: our own abort ends it at once; a peer's
    /// failure elsewhere in the job only `PEER_FAILURE_GRACE` after `*seen` (set here the first
    /// time), since the peer at the other end of this socket may still be sending what it owes
    /// us (the rest of an all-gather the failed rank already finished, say).
    fn check_blocked(
        &self,
        seen: &mut Option<Instant>,
        doing: impl FnOnce() -> String,
    ) -> Result<(), Error> {
        if self.abort.flagged() {
            return Err(self.abort.error(doing));
        }
        if self.abort.is_set()
            && seen.get_or_insert_with(Instant::now).elapsed() >= PEER_FAILURE_GRACE
        {
            return Err(self.abort.error(doing));
        }
        self.check_deadline(doing)
    }

    /// The deadline alone.
    pub fn check_deadline(&self, doing: impl FnOnce() -> String) -> Result<(), Error> {
        if Instant::now() >= self.deadline {
            return Err(Error::Timeout(format!(
                "{} did not complete within {}: that peer is stuck, slow, or not making this call",
                doing(),
                self.limit()
            )));
        }
        Ok(())
    }

    fn aborted_or(&self, doing: impl FnOnce() -> String, e: Error) -> Error {
        if self.abort.is_set() {
            self.abort.error(doing)
        } else {
            e
        }
    }
}

/// What to do when a socket call fails for want of descriptors or memory.
pub(crate) fn fd_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EMFILE) => " (this process has run out of file descriptors: raise `ulimit -n`, the RLIMIT_NOFILE of the job)",
        Some(libc::ENFILE) => " (the system has run out of file descriptors: raise fs.file-max)",
        Some(libc::ENOBUFS) | Some(libc::ENOMEM) => " (the kernel is out of socket memory)",
        _ => "",
    }
}

/// A descriptor kept in reserve by a listener, so that when `accept` fails for want of
/// descriptors it can still take the connection and tell the client why, rather than leave
/// it waiting for a handshake that never comes.
pub(crate) struct SpareFd(Option<std::fs::File>);

impl SpareFd {
    pub fn new() -> SpareFd {
        SpareFd(std::fs::File::open("/dev/null").ok())
    }

    /// After `accept` failed with `e`: if for want of descriptors, answer one waiting client
    /// with the refusal and return true.
    pub fn refuse_one(&mut self, l: &std::net::TcpListener, e: &io::Error, what: &str) -> bool {
        if !is_resource_exhaustion(e) {
            return false;
        }
        self.0 = None;
        if let Ok((mut s, from)) = l.accept() {
            let _ = s.set_nonblocking(true);
            let _ = s.write(&super::auth::refusal_for_lack_of_fds());
            tracing::warn!(remote = %from, "{what} refused a connection: {e}{}", fd_hint(e));
        }
        *self = SpareFd::new();
        true
    }
}

/// Failures that retrying cannot cure: connecting again only fails again, so they end a
/// connection attempt at once instead of at the deadline.
pub(crate) fn is_resource_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM)
    )
}

fn is_retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// How long a socket wait goes on after another rank's failure, for what its own peer still
/// sends (see `Wait::check_blocked`).
const PEER_FAILURE_GRACE: Duration = Duration::from_millis(200);

pub(crate) fn read_exact(
    s: &mut TcpStream,
    buf: &mut [u8],
    w: &Wait,
    peer: &str,
) -> Result<(), Error> {
    s.set_read_timeout(Some(POLL))
        .map_err(|e| Error::System(format!("socket to {peer}: {e}{}", fd_hint(&e))))?;
    let mut got = 0;
    let mut seen = None;
    while got < buf.len() {
        // The deadline on every pass, so that a peer trickling bytes cannot stretch a wait
        // beyond it; aborts and peers' failures only when nothing is there to read: what a
        // peer sent before another rank aborted (the rest of an all-gather, say) is still read,
        // so every rank can tell what the exchange found, not only the quickest.
        w.check_deadline(|| format!("reading from {peer}"))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(w.aborted_or(
                    || format!("reading from {peer}"),
                    Error::Remote(format!(
                        "{peer} closed the connection (it failed, aborted or exited; truncated message: got {got} of {} bytes)",
                        buf.len()
                    )),
                ))
            }
            Ok(k) => got += k,
            Err(e) if is_retry(&e) => w.check_blocked(&mut seen, || format!("reading from {peer}"))?,
            Err(e) => return Err(w.aborted_or(|| format!("reading from {peer}"), Error::Remote(format!("reading from {peer}: {e}")))),
        }
    }
    Ok(())
}

pub(crate) fn write_all(
    s: &mut TcpStream,
    mut buf: &[u8],
    w: &Wait,
    peer: &str,
) -> Result<(), Error> {
    s.set_write_timeout(Some(POLL))
        .map_err(|e| Error::System(format!("socket to {peer}: {e}{}", fd_hint(&e))))?;
    let mut seen = None;
    while !buf.is_empty() {
        w.check_deadline(|| format!("writing to {peer}"))?;
        match s.write(buf) {
            Ok(0) => return Err(Error::Remote(format!("{peer} stopped accepting data"))),
            Ok(k) => buf = &buf[k..],
            Err(e) if is_retry(&e) => {
                w.check_blocked(&mut seen, || format!("writing to {peer}"))?
            }
            Err(e) => {
                return Err(w.aborted_or(
                    || format!("writing to {peer}"),
                    Error::Remote(format!("writing to {peer}: {e}")),
                ))
            }
        }
    }
    Ok(())
}

/// One frame: a little-endian u64 length, then the concatenation of `parts`.
pub(crate) fn write_frame(
    s: &mut TcpStream,
    parts: &[&[u8]],
    w: &Wait,
    peer: &str,
) -> Result<(), Error> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut head = Vec::with_capacity(8 + if len <= 64 << 10 { len } else { 0 });
    head.extend_from_slice(&(len as u64).to_le_bytes());
    if len <= 64 << 10 {
        // Small frames go out in one write so that TCP_NODELAY does not split them.
        for p in parts {
            head.extend_from_slice(p);
        }
        return write_all(s, &head, w, peer);
    }
    write_all(s, &head, w, peer)?;
    for p in parts {
        write_all(s, p, w, peer)?;
    }
    Ok(())
}

/// Reads one frame; a declared length above `max` is rejected before anything is allocated.
pub(crate) fn read_frame(
    s: &mut TcpStream,
    max: usize,
    w: &Wait,
    peer: &str,
) -> Result<Vec<u8>, Error> {
    let mut head = [0u8; 8];
    read_exact(s, &mut head, w, peer)?;
    let len = u64::from_le_bytes(head);
    if len > max as u64 {
        return Err(Error::Protocol(format!(
            "{peer} sent a {len}-byte message, above the limit of {max} bytes"
        )));
    }
    let mut buf = vec![0u8; len as usize];
    read_exact(s, &mut buf, w, peer)?;
    Ok(buf)
}

/// Connects to `addr`, retrying refused or unreachable attempts until the deadline: ranks may
/// start before the process they connect to is listening.
pub(crate) fn connect_retry(addr: SocketAddr, w: &Wait, what: &str) -> Result<TcpStream, Error> {
    let mut last: Option<io::Error> = None;
    loop {
        if w.abort.is_set() {
            return Err(w.abort.error(|| format!("connecting to {what} at {addr}")));
        }
        if Instant::now() >= w.deadline {
            let why = last
                .map(|e| format!(" (last error: {e})"))
                .unwrap_or_default();
            return Err(Error::Timeout(format!(
                "could not connect to {what} at {addr} within {}{why}",
                w.limit()
            )));
        }
        match connect_once(addr, w) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(Some(e)) if is_resource_exhaustion(&e) => {
                return Err(Error::System(format!(
                    "cannot connect to {what} at {addr}: {e}{}",
                    fd_hint(&e)
                )));
            }
            Err(Some(e)) => {
                last = Some(e);
                let pause = POLL.min(w.remaining());
                std::thread::sleep(pause);
            }
            Err(None) => {} // the wait expired or was aborted; the loop head reports which
        }
    }
}

/// A non-blocking connect polled in `POLL` steps: std's `connect_timeout` cannot watch an
/// abort flag, and a short fixed timeout would fail on slow links. `Err(None)` = interrupted.
fn connect_once(addr: SocketAddr, w: &Wait) -> Result<TcpStream, Option<io::Error>> {
    let fam = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2); the fd is owned by the TcpStream right after.
    let fd = unsafe {
        libc::socket(
            fam,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(Some(io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh, valid socket that nothing else owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (ss, len) = sockaddr_of(addr);
    // SAFETY: ss holds a properly initialised sockaddr of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd,
            &ss as *const libc::sockaddr_storage as *const libc::sockaddr,
            len,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(Some(e));
        }
        loop {
            if w.abort.is_set() || Instant::now() >= w.deadline {
                return Err(None);
            }
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLOUT,
                revents: 0,
            };
            let ms = POLL.min(w.remaining()).as_millis().max(1) as libc::c_int;
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Some(e));
            }
            if n > 0 {
                break;
            }
        }
        match stream.take_error() {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => return Err(Some(e)),
        }
    }
    stream.set_nonblocking(false).map_err(Some)?;
    Ok(stream)
}

fn sockaddr_of(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin =
                unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr = libc::in_addr {
                s_addr: u32::from_ne_bytes(a.ip().octets()),
            };
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr_in6)
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_addr = libc::in6_addr {
                s6_addr: a.ip().octets(),
            };
            sin6.sin6_scope_id = a.scope_id();
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

/// Waits up to `timeout` for a pending connection on a non-blocking listener.
pub(crate) fn poll_accept(
    l: &std::net::TcpListener,
    timeout: Duration,
) -> io::Result<Option<(TcpStream, SocketAddr)>> {
    let mut p = libc::pollfd {
        fd: l.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis().max(1) as libc::c_int) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(None)
        } else {
            Err(e)
        };
    }
    if n == 0 {
        return Ok(None);
    }
    match l.accept() {
        Ok((s, a)) => {
            s.set_nonblocking(false)?;
            let _ = s.set_nodelay(true);
            Ok(Some((s, a)))
        }
        Err(e) if is_retry(&e) || e.kind() == io::ErrorKind::ConnectionAborted => Ok(None),
        Err(e) => Err(e),
    }
}

/// Hands a stream to its user in plain blocking mode, without the polling timeouts used here.
pub(crate) fn into_user_stream(s: TcpStream) -> Result<TcpStream, Error> {
    s.set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
        .and_then(|_| s.set_nonblocking(false))
        .map_err(|e| {
            Error::System(format!(
                "configuring a bootstrap connection: {e}{}",
                fd_hint(&e)
            ))
        })?;
    Ok(s)
}

/// Little-endian encoder of bootstrap messages.
#[derive(Default)]
pub(crate) struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// Strings are length-prefixed with a u16; callers keep them short (hostnames, messages).
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16).raw(&s.as_bytes()[..end])
    }
    /// family (4 or 6), 16 address bytes (IPv4 in the first 4), big-endian port: 19 bytes.
    pub fn addr(&mut self, a: SocketAddr) -> &mut Self {
        self.raw(&encode_addr(a))
    }
}

pub(crate) const ADDR_LEN: usize = 19;

pub(crate) fn encode_addr(a: SocketAddr) -> [u8; ADDR_LEN] {
    let mut out = [0u8; ADDR_LEN];
    match a.ip() {
        IpAddr::V4(ip) => {
            out[0] = 4;
            out[1..5].copy_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out[0] = 6;
            out[1..17].copy_from_slice(&ip.octets());
        }
    }
    out[17..19].copy_from_slice(&a.port().to_be_bytes());
    out
}

pub(crate) fn decode_addr(b: &[u8; ADDR_LEN]) -> Option<SocketAddr> {
    let port = u16::from_be_bytes([b[17], b[18]]);
    match b[0] {
        4 if b[5..17].iter().all(|&x| x == 0) => Some(SocketAddr::new(
            Ipv4Addr::new(b[1], b[2], b[3], b[4]).into(),
            port,
        )),
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[1..17]);
            Some(SocketAddr::new(Ipv6Addr::from(o).into(), port))
        }
        _ => None,
    }
}

/// Decoder whose every failure is a `Protocol` error naming the message and its sender.
pub(crate) struct Dec<'a> {
    b: &'a [u8],
    pos: usize,
    what: &'a str,
}

impl<'a> Dec<'a> {
    pub fn new(b: &'a [u8], what: &'a str) -> Dec<'a> {
        Dec { b, pos: 0, what }
    }
    fn bad(&self, why: &str) -> Error {
        Error::Protocol(format!(
            "malformed {}: {why} at byte {}",
            self.what, self.pos
        ))
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.b.len() - self.pos < n {
            return Err(self.bad("message too short"));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, Error> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn i32(&mut self) -> Result<i32, Error> {
        Ok(i32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn usize(&mut self) -> Result<usize, Error> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.bad("value out of range"))
    }
    pub fn str(&mut self, max: usize) -> Result<String, Error> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(self.bad("string too long"));
        }
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    pub fn addr(&mut self) -> Result<SocketAddr, Error> {
        let b: &[u8; ADDR_LEN] = self.take(ADDR_LEN)?.try_into().expect("ADDR_LEN bytes");
        decode_addr(b).ok_or_else(|| self.bad("bad address"))
    }
    pub fn finish(&self) -> Result<(), Error> {
        if self.pos != self.b.len() {
            return Err(self.bad("trailing bytes"));
        }
        Ok(())
    }
}
