//! Passing file descriptors (cuMem allocations exported as POSIX fds, shared-memory
//! segments) between processes of one host: `SCM_RIGHTS` over a Unix-domain socket.
//!
//! Naming: a listener binds the *abstract* socket `"\0ferroccl-fd/<job:016x>/<rank>"`.
//! Abstract names need no file to create or clean up (a crashed rank leaves nothing behind
//! in /tmp, and a restarted job with a new id cannot collide with it) and vanish when the
//! socket closes. They are visible to every process of the same network namespace, so both
//! ends check with `SO_PEERCRED` that the other runs as the same user; the job id (random,
//! from the UniqueId) keeps concurrent jobs apart.
//!
//! Sockets are `SOCK_SEQPACKET`: one send is one message, so a message and its descriptors
//! arrive together or not at all, with no framing to resynchronise. Every message is
//! bounded ([`MAX_FDS`], [`MAX_PAYLOAD`]) and every wait has a deadline and an abort flag.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferroccl_core::{Error, Result};

/// Most descriptors in one message: enough for a buffer set per channel, small enough that
/// a confused peer cannot exhaust our descriptor table in one message.
pub const MAX_FDS: usize = 16;
/// Most payload bytes in one message.
pub const MAX_PAYLOAD: usize = 4096;

const MAGIC: u32 = u32::from_le_bytes(*b"FCFD");
const HEADER: usize = 12;
/// How long one poll sleeps before looking at the abort flag again.
const SLICE: Duration = Duration::from_millis(50);

/// The abstract socket name of `rank` in `job` (leading NUL included).
pub fn socket_name(job: u64, rank: u32) -> Vec<u8> {
    format!("\0ferroccl-fd/{job:016x}/{rank}").into_bytes()
}

fn sys_err(what: &str) -> Error {
    Error::System(format!("{what}: {}", io::Error::last_os_error()))
}

fn sockaddr(name: &[u8]) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() > addr.sun_path.len() {
        return Err(Error::InvalidArgument(format!(
            "socket name of {} bytes is too long",
            name.len()
        )));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    // Abstract names are exactly as long as the length says: no terminating NUL.
    let len = std::mem::size_of::<libc::sa_family_t>() + name.len();
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> Result<OwnedFd> {
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(sys_err("socket(AF_UNIX, SOCK_SEQPACKET)"));
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Waits until `fd` is ready for `events`, the deadline passes, or `abort` is set.
fn wait(
    fd: BorrowedFd<'_>,
    events: libc::c_short,
    deadline: Instant,
    abort: &AtomicBool,
    what: &str,
) -> Result<()> {
    loop {
        if abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted(format!("{what}: aborted")));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(format!(
                "{what}: no progress before the deadline"
            )));
        }
        let slice = (deadline - now).min(SLICE);
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        };
        let r = unsafe { libc::poll(&mut p, 1, slice.as_millis().max(1) as libc::c_int) };
        if r > 0 {
            return Ok(());
        }
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Err(sys_err(&format!("{what}: poll")));
        }
    }
}

/// The connected peer's process and user, as the kernel recorded them at connect time.
fn peer_cred(sock: BorrowedFd<'_>) -> Result<libc::ucred> {
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(sys_err("getsockopt(SO_PEERCRED)"));
    }
    Ok(cred)
}

/// Refuses a peer running as another user: abstract sockets have no file permissions.
fn check_peer_user(sock: BorrowedFd<'_>) -> Result<()> {
    let cred = peer_cred(sock)?;
    let me = unsafe { libc::geteuid() };
    if cred.uid != me {
        return Err(Error::Protocol(format!(
            "fd-passing peer (pid {}) runs as uid {}, not {me}",
            cred.pid, cred.uid
        )));
    }
    Ok(())
}

/// Where a rank waits for the peers that will send it descriptors.
pub struct FdListener {
    sock: OwnedFd,
    job: u64,
    rank: u32,
}

impl FdListener {
    /// Listens on the abstract socket of (`job`, `rank`), where that rank's peers connect.
    pub fn bind(job: u64, rank: u32) -> Result<FdListener> {
        let sock = seqpacket_socket()?;
        let (addr, len) = sockaddr(&socket_name(job, rank))?;
        if unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        } != 0
        {
            return Err(sys_err(&format!(
                "bind(fd socket of job {job:016x} rank {rank})"
            )));
        }
        if unsafe { libc::listen(sock.as_raw_fd(), 64) } != 0 {
            return Err(sys_err("listen(fd socket)"));
        }
        Ok(FdListener { sock, job, rank })
    }

    /// The next peer to connect.
    pub fn accept(&self, deadline: Instant, abort: &AtomicBool) -> Result<FdChannel> {
        let what = format!(
            "accepting on the fd socket of job {:016x} rank {}",
            self.job, self.rank
        );
        loop {
            let fd = unsafe {
                libc::accept4(
                    self.sock.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if fd >= 0 {
                let ch = FdChannel {
                    sock: unsafe { OwnedFd::from_raw_fd(fd) },
                };
                check_peer_user(ch.sock.as_fd())?;
                return Ok(ch);
            }
            match io::Error::last_os_error().kind() {
                io::ErrorKind::WouldBlock => {
                    wait(self.sock.as_fd(), libc::POLLIN, deadline, abort, &what)?
                }
                io::ErrorKind::Interrupted => {}
                _ => return Err(sys_err(&what)),
            }
        }
    }
}

/// One connected end: sends and receives messages of descriptors plus payload.
pub struct FdChannel {
    sock: OwnedFd,
}

impl FdChannel {
    /// Connects to `rank`'s listener in `job`, retrying until it exists or the deadline
    /// passes: peers start in any order.
    pub fn connect(
        job: u64,
        rank: u32,
        deadline: Instant,
        abort: &AtomicBool,
    ) -> Result<FdChannel> {
        let (addr, len) = sockaddr(&socket_name(job, rank))?;
        let what = format!("connecting to the fd socket of job {job:016x} rank {rank}");
        let mut backoff = Duration::from_millis(1);
        loop {
            let sock = seqpacket_socket()?;
            let r = unsafe {
                libc::connect(
                    sock.as_raw_fd(),
                    (&addr as *const libc::sockaddr_un).cast(),
                    len,
                )
            };
            if r == 0 {
                check_peer_user(sock.as_fd())?;
                return Ok(FdChannel { sock });
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                // No listener yet, or its backlog is full: the peer is still starting.
                Some(libc::ECONNREFUSED)
                | Some(libc::ENOENT)
                | Some(libc::EAGAIN)
                | Some(libc::EINTR) => {}
                _ => return Err(Error::System(format!("{what}: {err}"))),
            }
            if abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted(format!("{what}: aborted")));
            }
            if Instant::now() + backoff >= deadline {
                return Err(Error::Timeout(format!(
                    "{what}: no listener before the deadline ({err})"
                )));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }

    /// The process at the other end (`SO_PEERCRED`: the kernel's record, not the peer's word).
    pub fn peer_pid(&self) -> Result<u32> {
        let pid = peer_cred(self.sock.as_fd())?.pid;
        u32::try_from(pid).map_err(|_| Error::Protocol(format!("fd-passing peer with pid {pid}")))
    }

    /// Two connected ends in this process (threads, tests, or before a fork).
    pub fn pair() -> Result<(FdChannel, FdChannel)> {
        let mut fds = [0; 2];
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
                fds.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(sys_err("socketpair(AF_UNIX, SOCK_SEQPACKET)"));
        }
        unsafe {
            Ok((
                FdChannel {
                    sock: OwnedFd::from_raw_fd(fds[0]),
                },
                FdChannel {
                    sock: OwnedFd::from_raw_fd(fds[1]),
                },
            ))
        }
    }

    /// Sends `fds` (duplicated into the peer; ours stay open) and `payload` as one message.
    pub fn send_fds(
        &self,
        fds: &[BorrowedFd<'_>],
        payload: &[u8],
        deadline: Instant,
        abort: &AtomicBool,
    ) -> Result<()> {
        if fds.len() > MAX_FDS {
            return Err(Error::InvalidArgument(format!(
                "{} descriptors in one message (at most {MAX_FDS})",
                fds.len()
            )));
        }
        if payload.len() > MAX_PAYLOAD {
            return Err(Error::InvalidArgument(format!(
                "{} payload bytes in one message (at most {MAX_PAYLOAD})",
                payload.len()
            )));
        }
        let mut data = Vec::with_capacity(HEADER + payload.len());
        data.extend_from_slice(&MAGIC.to_le_bytes());
        data.extend_from_slice(&(fds.len() as u32).to_le_bytes());
        data.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        data.extend_from_slice(payload);

        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut cbuf = CmsgBuf::new();
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut c_void,
            iov_len: data.len(),
        };
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !raw.is_empty() {
            let bytes = std::mem::size_of_val(raw.as_slice());
            msg.msg_control = cbuf.as_mut_ptr();
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes as u32) } as _;
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
                std::ptr::copy_nonoverlapping(
                    raw.as_ptr(),
                    libc::CMSG_DATA(c).cast::<RawFd>(),
                    raw.len(),
                );
            }
        }
        loop {
            let n = unsafe { libc::sendmsg(self.sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            if n >= 0 {
                // A seqpacket send is all or nothing; anything else is a kernel surprise.
                return if n as usize == data.len() {
                    Ok(())
                } else {
                    Err(Error::Internal(format!(
                        "sendmsg sent {n} of {} bytes",
                        data.len()
                    )))
                };
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EAGAIN) => wait(
                    self.sock.as_fd(),
                    libc::POLLOUT,
                    deadline,
                    abort,
                    "sending descriptors",
                )?,
                Some(libc::EINTR) => {}
                Some(libc::EPIPE) | Some(libc::ECONNRESET) => {
                    return Err(Error::Remote(format!(
                        "sending descriptors: the peer closed its socket ({err})"
                    )))
                }
                _ => return Err(Error::System(format!("sendmsg(SCM_RIGHTS): {err}"))),
            }
        }
    }

    /// Receives one message: its descriptors (close-on-exec, owned by the caller) and
    /// payload.
    pub fn recv_fds(
        &self,
        deadline: Instant,
        abort: &AtomicBool,
    ) -> Result<(Vec<OwnedFd>, Vec<u8>)> {
        let mut data = vec![0u8; HEADER + MAX_PAYLOAD];
        let mut cbuf = CmsgBuf::new();
        loop {
            let mut iov = libc::iovec {
                iov_base: data.as_mut_ptr().cast(),
                iov_len: data.len(),
            };
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr();
            msg.msg_controllen = CmsgBuf::LEN as _;
            let n =
                unsafe { libc::recvmsg(self.sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n < 0 {
                let err = io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(libc::EAGAIN) => {
                        wait(
                            self.sock.as_fd(),
                            libc::POLLIN,
                            deadline,
                            abort,
                            "receiving descriptors",
                        )?;
                        continue;
                    }
                    Some(libc::EINTR) => continue,
                    Some(libc::ECONNRESET) => {
                        return Err(Error::Remote(format!(
                            "receiving descriptors: the peer closed its socket ({err})"
                        )))
                    }
                    _ => return Err(Error::System(format!("recvmsg(SCM_RIGHTS): {err}"))),
                }
            }
            // Take ownership of whatever arrived before judging the message, so that a bad
            // message cannot leak descriptors into this process.
            let fds = unsafe { take_fds(&msg) };
            if n == 0 {
                return Err(Error::Remote(
                    "receiving descriptors: the peer closed its socket".into(),
                ));
            }
            if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
                return Err(Error::Protocol(
                    "fd message larger than its bounds (truncated)".into(),
                ));
            }
            let n = n as usize;
            let word = |i: usize| u32::from_le_bytes(data[i..i + 4].try_into().unwrap());
            if n < HEADER || word(0) != MAGIC {
                return Err(Error::Protocol(
                    "fd message without ferroccl's header".into(),
                ));
            }
            let (nfds, len) = (word(4) as usize, word(8) as usize);
            if nfds != fds.len() || len > MAX_PAYLOAD || HEADER + len != n {
                return Err(Error::Protocol(format!(
                    "fd message says {nfds} descriptors and {len} bytes, carries {} and {}",
                    fds.len(),
                    n - HEADER
                )));
            }
            data.truncate(n);
            data.drain(..HEADER);
            return Ok((fds, data));
        }
    }
}

impl AsFd for FdChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// Control-message space for [`MAX_FDS`] descriptors, aligned as `cmsghdr` requires.
struct CmsgBuf {
    buf: [u64; CmsgBuf::WORDS],
}

impl CmsgBuf {
    // CMSG_SPACE is not const in libc; 16 bytes of header plus the fds, rounded up to 8.
    const LEN: usize = 16 + ((MAX_FDS * 4 + 7) & !7);
    const WORDS: usize = CmsgBuf::LEN / 8;
    fn new() -> Self {
        CmsgBuf {
            buf: [0; CmsgBuf::WORDS],
        }
    }
    fn as_mut_ptr(&mut self) -> *mut c_void {
        self.buf.as_mut_ptr().cast()
    }
}

/// # Safety
/// `msg` must describe a control buffer filled by a successful `recvmsg`.
unsafe fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    let mut c = libc::CMSG_FIRSTHDR(msg);
    while !c.is_null() {
        if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
            let data = libc::CMSG_DATA(c);
            let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
            for i in 0..bytes / std::mem::size_of::<RawFd>() {
                let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                out.push(OwnedFd::from_raw_fd(fd));
            }
        }
        c = libc::CMSG_NXTHDR(msg, c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::process::{Command, Stdio};

    const CHILD_ENV: &str = "FERROCCL_FDPASS_TEST_CHILD";
    static NEVER: AtomicBool = AtomicBool::new(false);

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    fn memfd_with(content: &[u8]) -> File {
        let fd = unsafe { libc::memfd_create(c"ferroccl-fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        f.write_all(content).unwrap();
        f
    }

    fn read_all(fd: OwnedFd) -> (File, Vec<u8>) {
        let mut f = File::from(fd);
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut v = Vec::new();
        f.read_to_end(&mut v).unwrap();
        (f, v)
    }

    #[test]
    fn socket_names_are_abstract_and_distinct() {
        let a = socket_name(0xfeed, 0);
        assert_eq!(a[0], 0);
        assert_ne!(a, socket_name(0xfeed, 1));
        assert_ne!(a, socket_name(0xfeee, 0));
        assert!(sockaddr(&socket_name(u64::MAX, u32::MAX)).is_ok());
    }

    #[test]
    fn pair_passes_memfds_and_payload() {
        let (a, b) = FdChannel::pair().unwrap();
        let m1 = memfd_with(b"first");
        let m2 = memfd_with(b"second");
        a.send_fds(&[m1.as_fd(), m2.as_fd()], b"hello", soon(), &NEVER)
            .unwrap();
        a.send_fds(&[], b"", soon(), &NEVER).unwrap();
        let (fds, payload) = b.recv_fds(soon(), &NEVER).unwrap();
        assert_eq!(payload, b"hello");
        assert_eq!(fds.len(), 2);
        let contents: Vec<_> = fds.into_iter().map(|f| read_all(f).1).collect();
        assert_eq!(contents, vec![b"first".to_vec(), b"second".to_vec()]);
        let (fds, payload) = b.recv_fds(soon(), &NEVER).unwrap();
        assert!(fds.is_empty() && payload.is_empty());
    }

    #[test]
    fn bounds_deadlines_and_closed_peers_are_errors() {
        let (a, b) = FdChannel::pair().unwrap();
        let m = memfd_with(b"x");
        let many: Vec<_> = (0..=MAX_FDS).map(|_| m.as_fd()).collect();
        assert!(matches!(
            a.send_fds(&many, b"", soon(), &NEVER),
            Err(Error::InvalidArgument(_))
        ));
        let big = vec![0u8; MAX_PAYLOAD + 1];
        assert!(matches!(
            a.send_fds(&[], &big, soon(), &NEVER),
            Err(Error::InvalidArgument(_))
        ));
        let t = Instant::now();
        assert!(matches!(
            b.recv_fds(t + Duration::from_millis(100), &NEVER),
            Err(Error::Timeout(_))
        ));
        assert!(t.elapsed() < Duration::from_secs(5));
        let abort = AtomicBool::new(true);
        assert!(matches!(b.recv_fds(soon(), &abort), Err(Error::Aborted(_))));
        drop(a);
        assert!(matches!(b.recv_fds(soon(), &NEVER), Err(Error::Remote(_))));
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        let (a, b) = FdChannel::pair().unwrap();
        let junk = b"not a ferroccl message";
        let n = unsafe { libc::send(a.as_fd().as_raw_fd(), junk.as_ptr().cast(), junk.len(), 0) };
        assert_eq!(n as usize, junk.len());
        assert!(matches!(
            b.recv_fds(soon(), &NEVER),
            Err(Error::Protocol(_))
        ));
    }

    #[test]
    fn connect_times_out_without_listener() {
        let job = u64::from_le_bytes(*b"nobody\0\0") ^ std::process::id() as u64;
        let r = FdChannel::connect(job, 0, Instant::now() + Duration::from_millis(100), &NEVER);
        assert!(matches!(r, Err(Error::Timeout(_))), "{:?}", r.err());
    }

    /// The parent binds, a re-executed copy of this test binary connects and receives a
    /// memfd, checks its content and writes its answer into it; the parent reads that back.
    #[test]
    fn memfd_crosses_processes() {
        if std::env::var(CHILD_ENV).is_ok() {
            return;
        }
        let mut id = [0u8; 8];
        getrandom::getrandom(&mut id).unwrap();
        let job = u64::from_le_bytes(id);
        let listener = FdListener::bind(job, 0).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "cuda::fdpass::tests::child_entry",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, format!("{job}"))
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn child test process");
        let ch = listener.accept(soon(), &NEVER).unwrap();
        let mut m = memfd_with(b"from the parent");
        ch.send_fds(&[m.as_fd()], b"check", soon(), &NEVER).unwrap();
        let (fds, reply) = ch.recv_fds(soon(), &NEVER).unwrap();
        assert!(fds.is_empty());
        assert_eq!(reply, b"done");
        assert!(child.wait().unwrap().success(), "child failed");
        m.seek(SeekFrom::Start(0)).unwrap();
        let mut v = Vec::new();
        m.read_to_end(&mut v).unwrap();
        assert_eq!(v, b"child saw it well");
    }

    #[test]
    fn child_entry() {
        let Ok(job) = std::env::var(CHILD_ENV) else {
            return;
        };
        let job: u64 = job.parse().unwrap();
        let ch = FdChannel::connect(job, 0, soon(), &NEVER).unwrap();
        let (mut fds, payload) = ch.recv_fds(soon(), &NEVER).unwrap();
        assert_eq!(payload, b"check");
        assert_eq!(fds.len(), 1);
        let (mut f, content) = read_all(fds.pop().unwrap());
        assert_eq!(content, b"from the parent");
        f.seek(SeekFrom::Start(0)).unwrap();
        f.write_all(b"child saw it well").unwrap();
        ch.send_fds(&[], b"done", soon(), &NEVER).unwrap();
    }
}
