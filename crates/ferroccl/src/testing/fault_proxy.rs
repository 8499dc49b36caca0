//! Test support: a TCP proxy that sits between two endpoints and, on command, delays,
//! swallows, resets or corrupts the bytes it forwards, so tests can show what each fault
//! turns into (an error naming the peer, within the deadline) rather than assume it.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the proxy does to traffic from now on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Fault {
    /// Forward unchanged.
    Pass,
    /// Hold every chunk this long before forwarding it.
    Delay(Duration),
    /// Swallow everything while keeping the connections open: a black hole.
    Drop,
    /// Close both sides of every connection with a TCP reset.
    Reset,
    /// Flip the lowest bit of the byte at this offset of the client-to-server stream of
    /// each connection (past the handshake, in the data); everything else passes unchanged.
    Corrupt { at: u64 },
}

struct Shared {
    fault: Mutex<Fault>,
    stop: AtomicBool,
    /// Bytes forwarded client to server, over all connections.
    forwarded: AtomicU64,
    /// Bytes this proxy corrupted.
    corrupted: AtomicU64,
    /// The first bytes each connection's client sent (for replay attacks), per connection.
    recorded: Mutex<Vec<Vec<u8>>>,
    streams: Mutex<Vec<TcpStream>>,
}

pub(crate) struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

const POLL: Duration = Duration::from_millis(5);

impl FaultProxy {
    /// Listens on an ephemeral loopback port and forwards each connection to `target`.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let l = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        l.set_nonblocking(true).expect("proxy listener");
        let addr = l.local_addr().expect("proxy addr");
        let shared = Arc::new(Shared {
            fault: Mutex::new(Fault::Pass),
            stop: AtomicBool::new(false),
            forwarded: AtomicU64::new(0),
            corrupted: AtomicU64::new(0),
            recorded: Mutex::new(Vec::new()),
            streams: Mutex::new(Vec::new()),
        });
        let sh = shared.clone();
        let accept = std::thread::spawn(move || {
            while !sh.stop.load(Ordering::Acquire) {
                match l.accept() {
                    Ok((client, _)) => {
                        let Ok(server) = TcpStream::connect(target) else {
                            continue;
                        };
                        for s in [&client, &server] {
                            s.set_nonblocking(false).ok();
                            s.set_nodelay(true).ok();
                            s.set_read_timeout(Some(POLL)).ok();
                            sh.streams.lock().unwrap().push(s.try_clone().unwrap());
                        }
                        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                        let (a, b) = (sh.clone(), sh.clone());
                        std::thread::spawn(move || pump(client, server, true, a));
                        std::thread::spawn(move || pump(s2, c2, false, b));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
                    Err(_) => std::thread::sleep(POLL),
                }
            }
        });
        FaultProxy {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set(&self, f: Fault) {
        *self.shared.fault.lock().unwrap() = f;
        if f == Fault::Reset {
            for s in self.shared.streams.lock().unwrap().drain(..) {
                reset(&s);
            }
        }
    }

    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::Acquire)
    }

    /// What the clients sent, connection by connection (the first 64 KiB of each).
    pub fn recorded(&self) -> Vec<Vec<u8>> {
        self.shared.recorded.lock().unwrap().clone()
    }

    pub fn corrupted(&self) -> u64 {
        self.shared.corrupted.load(Ordering::Acquire)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for s in self.shared.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// An abortive close: SO_LINGER with a zero timeout makes close() send RST, not FIN.
fn reset(s: &TcpStream) {
    let lin = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a descriptor we own, with a correctly sized linger struct.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &lin as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    // No shutdown(): that would send a FIN first. The reset goes out when the last
    // descriptor of the socket closes, i.e. when the pump threads notice and exit.
}

/// Moves bytes from `from` to `to`, applying the current fault, until either side closes.
fn pump(mut from: TcpStream, mut to: TcpStream, client_to_server: bool, sh: Arc<Shared>) {
    let mut buf = vec![0u8; 64 << 10];
    let mut offset = 0u64;
    let conn = if client_to_server {
        let mut r = sh.recorded.lock().unwrap();
        r.push(Vec::new());
        r.len() - 1
    } else {
        0
    };
    loop {
        if sh.stop.load(Ordering::Acquire) {
            break;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if *sh.fault.lock().unwrap() == Fault::Reset {
                    break;
                }
                continue;
            }
            Err(_) => break,
        };
        let fault = *sh.fault.lock().unwrap();
        let chunk = &mut buf[..n];
        match fault {
            Fault::Pass => {}
            Fault::Delay(d) => std::thread::sleep(d),
            Fault::Drop => {
                offset += n as u64;
                continue;
            }
            Fault::Reset => break,
            Fault::Corrupt { at } => {
                if client_to_server && at >= offset && at < offset + n as u64 {
                    chunk[(at - offset) as usize] ^= 1;
                    sh.corrupted.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        offset += n as u64;
        if to.write_all(chunk).is_err() {
            break;
        }
        if client_to_server {
            sh.forwarded.fetch_add(n as u64, Ordering::AcqRel);
            let mut r = sh.recorded.lock().unwrap();
            let rec = &mut r[conn];
            let room = (64usize << 10).saturating_sub(rec.len());
            rec.extend_from_slice(&chunk[..n.min(room)]);
        }
    }
    if *sh.fault.lock().unwrap() == Fault::Reset {
        reset(&from);
        reset(&to);
    } else {
        let _ = to.shutdown(Shutdown::Write);
    }
}
