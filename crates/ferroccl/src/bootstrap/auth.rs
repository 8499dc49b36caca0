//! Mutual challenge-response over the job secret, run on every bootstrap connection before
//! anything else it carries is parsed.
//!
//! server -> client: MAGIC(8) | server_nonce(32)
//! client -> server: client_nonce(32) | HMAC(secret, "client" | server_nonce | client_nonce)
//! server -> client: HMAC(secret, "server" | client_nonce | server_nonce)
//!
//! All three messages have fixed sizes, so no length field from an unauthenticated peer is
//! ever trusted. Fresh nonces on both sides make a recorded handshake useless, and the role
//! labels stop a server's answer from being reflected back as a client's.

use super::wire::{self, read_exact, write_all, Wait, HANDSHAKE_MAX, POLL};
use ferroccl_core::Error;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{SocketAddr, TcpStream};

type HmacSha256 = Hmac<Sha256>;

/// Also a protocol version: a peer speaking another revision fails at the first message.
const MAGIC: [u8; 8] = *b"FCCLBS01";

/// Sent in place of the server's hello by a listener that has run out of file descriptors
/// (it keeps one in reserve to accept and answer), so the client fails at once, naming the
/// cause, instead of waiting out its deadline.
pub(crate) const NO_FDS: [u8; 8] = *b"FCCLNOFD";

pub(crate) fn refusal_for_lack_of_fds() -> [u8; 40] {
    let mut b = [0u8; 40];
    b[..8].copy_from_slice(&NO_FDS);
    b
}

pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N], Error> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b)
        .map_err(|e| Error::System(format!("no randomness from the OS: {e}")))?;
    Ok(b)
}

fn mac(secret: &[u8; 16], label: &[u8], a: &[u8], b: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(a);
    m.update(b);
    m
}

pub(crate) fn server(
    s: &mut TcpStream,
    secret: &[u8; 16],
    w: &Wait,
    peer: &str,
) -> Result<(), Error> {
    let sn: [u8; 32] = random_bytes()?;
    let mut hello = [0u8; 40];
    hello[..8].copy_from_slice(&MAGIC);
    hello[8..].copy_from_slice(&sn);
    write_all(s, &hello, w, peer)?;
    let mut resp = [0u8; 64];
    read_exact(s, &mut resp, w, peer)?;
    let (cn, tag) = resp.split_at(32);
    // verify_slice compares in constant time.
    mac(secret, b"client", &sn, cn)
        .verify_slice(tag)
        .map_err(|_| {
            Error::Protocol(format!(
                "{peer} failed authentication (wrong job secret, or not a ferroccl rank)"
            ))
        })?;
    let answer = mac(secret, b"server", cn, &sn).finalize().into_bytes();
    write_all(s, &answer, w, peer)
}

#[cfg(test)]
pub(crate) fn client(
    s: &mut TcpStream,
    secret: &[u8; 16],
    w: &Wait,
    peer: &str,
) -> Result<(), Error> {
    client_or_retry(s, secret, w, peer).map_err(|(_, e)| e)
}

/// Connects to `addr` and authenticates. A server that closes the connection before its
/// first byte (a listener cutting off handshakes under a flood of strangers) is tried again
/// until the deadline; anything later is final.
pub(crate) fn connect(
    addr: SocketAddr,
    secret: &[u8; 16],
    w: &Wait,
    what: &str,
    peer: &str,
) -> Result<TcpStream, Error> {
    loop {
        let mut s = wire::connect_retry(addr, w, what)?;
        match client_or_retry(&mut s, secret, &w.capped(HANDSHAKE_MAX), peer) {
            Ok(()) => return Ok(s),
            Err((true, e)) => {
                tracing::debug!(
                    "{peer} closed the connection before its handshake, trying again: {e}"
                );
                w.check(|| {
                    format!("authenticating with {peer} (it kept closing connections: {e})")
                })?;
                std::thread::sleep(POLL.min(w.remaining()));
            }
            Err((false, e)) => return Err(e),
        }
    }
}

/// The client handshake; the flag in the error says whether it is worth trying again.
fn client_or_retry(
    s: &mut TcpStream,
    secret: &[u8; 16],
    w: &Wait,
    peer: &str,
) -> Result<(), (bool, Error)> {
    let mut hello = [0u8; 40];
    read_exact(s, &mut hello[..1], w, peer).map_err(|e| (matches!(e, Error::Remote(_)), e))?;
    read_exact(s, &mut hello[1..], w, peer).map_err(|e| (false, e))?;
    client_rest(s, secret, w, peer, &hello).map_err(|e| (false, e))
}

fn client_rest(
    s: &mut TcpStream,
    secret: &[u8; 16],
    w: &Wait,
    peer: &str,
    hello: &[u8; 40],
) -> Result<(), Error> {
    if hello[..8] == NO_FDS {
        return Err(Error::System(format!(
            "{peer} has run out of file descriptors and cannot accept connections: raise `ulimit -n` (RLIMIT_NOFILE) for that process"
        )));
    }
    if hello[..8] != MAGIC {
        return Err(Error::Protocol(format!(
            "{peer} is not a ferroccl bootstrap endpoint of this version"
        )));
    }
    let sn = &hello[8..];
    let cn: [u8; 32] = random_bytes()?;
    let mut resp = [0u8; 64];
    resp[..32].copy_from_slice(&cn);
    resp[32..].copy_from_slice(&mac(secret, b"client", sn, &cn).finalize().into_bytes());
    write_all(s, &resp, w, peer)?;
    let mut answer = [0u8; 32];
    match read_exact(s, &mut answer, w, peer) {
        Ok(()) => {}
        // The server drops us without a word when our proof is wrong.
        Err(Error::Remote(m)) => {
            return Err(Error::Protocol(format!(
                "{peer} rejected our authentication (wrong job secret?): {m}"
            )))
        }
        Err(e) => return Err(e),
    }
    mac(secret, b"server", &cn, sn)
        .verify_slice(&answer)
        .map_err(|_| Error::Protocol(format!("{peer} could not prove it knows the job secret")))
}
