//! The 128-byte handle that one process creates and ships (by MPI, a file, a store) to all
//! ranks of a job: where the root rendezvous listens and the secret that admits a rank.
//!
//! Layout (version 1):
//!   0..8    magic "FERROCID"
//!   8..10   version, u16 little-endian
//!   10..29  root address: family (4|6), 16 address bytes (IPv4 in the first 4), port big-endian
//!   29..45  job secret
//!   45      flags: 1 = rank 0 starts the root at the address (an id made by `at`)
//!   46..128 zero

use super::auth::random_bytes;
use super::{host, root, wire};
use ferroccl_core::{Config, Error};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};

const MAGIC: [u8; 8] = *b"FERROCID";
const VERSION: u16 = 1;
const ADDR_AT: usize = 10;
const SECRET_AT: usize = ADDR_AT + wire::ADDR_LEN;
const END: usize = SECRET_AT + 16;
const FLAGS_AT: usize = END;
const ROOT_BY_RANK0: u8 = 1;

/// What the ranks of a job share to find each other (NCCL's `ncclUniqueId`, 128 bytes): the
/// address of the rendezvous and the job's secret, which admits a rank. One process makes it
/// with [`UniqueId::new`] (which starts the rendezvous in that process, for the job's life)
/// and ships [`UniqueId::as_bytes`] to the others by any means; each rank passes it to
/// [`crate::Comm::init_rank`]. Keep it as private as a password: anyone holding it may join.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; 128],
}

// The secret must not end up in logs, so Debug shows only the address.
impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniqueId")
            .field("root", &self.root_addr())
            .finish_non_exhaustive()
    }
}

/// The IP this process listens on and advertises when nothing says otherwise.
pub(crate) fn local_ip(config: &Config) -> Result<IpAddr, Error> {
    match &config.bootstrap_addr {
        Some(a) => a.trim().parse::<IpAddr>().map_err(|_| {
            Error::InvalidArgument(format!("bootstrap address '{a}' is not an IP address"))
        }),
        None => Ok(IpAddr::V4(
            host::first_ipv4().unwrap_or(Ipv4Addr::LOCALHOST),
        )),
    }
}

impl UniqueId {
    /// A new id with a random secret, its rendezvous listening on this host (on
    /// `config.bootstrap_addr`, else the first non-loopback IPv4 address) on a free port.
    pub fn new(config: &Config) -> Result<UniqueId, Error> {
        let ip = local_ip(config)?;
        let l = TcpListener::bind((ip, 0)).map_err(|e| {
            Error::System(format!(
                "binding the bootstrap root on {ip}: {e}{}",
                wire::fd_hint(&e)
            ))
        })?;
        let addr = l.local_addr().map_err(|e| {
            Error::System(format!(
                "bootstrap root socket: {e}{}",
                super::wire::fd_hint(&e)
            ))
        })?;
        let secret: [u8; 16] = random_bytes()?;
        root::spawn(l, secret, config.clone())?;
        Ok(UniqueId::compose(addr, &secret))
    }

    /// An id for a root at an address agreed in advance (NCCL_COMM_ID, a launcher's
    /// MASTER_ADDR and MASTER_PORT), which every rank can make on its own: rank 0 starts the
    /// root there when it joins. Nothing listens until then.
    pub fn at(addr: SocketAddr, secret: [u8; 16]) -> UniqueId {
        let mut id = UniqueId::compose(addr, &secret);
        id.bytes[FLAGS_AT] = ROOT_BY_RANK0;
        id
    }

    /// Whether rank 0 starts the root (an id made by [`UniqueId::at`]).
    pub fn root_by_rank0(&self) -> bool {
        self.bytes[FLAGS_AT] & ROOT_BY_RANK0 != 0
    }

    pub(crate) fn compose(addr: SocketAddr, secret: &[u8; 16]) -> UniqueId {
        let mut b = [0u8; 128];
        b[..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[ADDR_AT..SECRET_AT].copy_from_slice(&wire::encode_addr(addr));
        b[SECRET_AT..END].copy_from_slice(secret);
        UniqueId { bytes: b }
    }

    /// The 128 bytes to ship to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.bytes
    }

    /// The id from its bytes, checked (length, magic, version, address, padding).
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId, Error> {
        let bytes: [u8; 128] = b.try_into().map_err(|_| {
            Error::InvalidArgument(format!("a unique id is 128 bytes, got {}", b.len()))
        })?;
        if bytes[..8] != MAGIC {
            return Err(Error::InvalidArgument(
                "not a ferroccl unique id (bad magic)".into(),
            ));
        }
        let v = u16::from_le_bytes([bytes[8], bytes[9]]);
        if v != VERSION {
            return Err(Error::InvalidArgument(format!(
                "unique id version {v}, this build understands {VERSION}"
            )));
        }
        let a: &[u8; wire::ADDR_LEN] = bytes[ADDR_AT..SECRET_AT].try_into().expect("ADDR_LEN");
        let addr = wire::decode_addr(a).ok_or_else(|| {
            Error::InvalidArgument("unique id holds no valid root address".into())
        })?;
        if addr.port() == 0 {
            return Err(Error::InvalidArgument("unique id holds root port 0".into()));
        }
        if bytes[FLAGS_AT] & !ROOT_BY_RANK0 != 0 {
            return Err(Error::InvalidArgument(format!(
                "unique id flags {:#x} unknown (corrupted?)",
                bytes[FLAGS_AT]
            )));
        }
        if bytes[FLAGS_AT + 1..].iter().any(|&x| x != 0) {
            return Err(Error::InvalidArgument(
                "unique id padding is not zero (corrupted?)".into(),
            ));
        }
        Ok(UniqueId { bytes })
    }

    /// Where the rendezvous listens.
    pub fn root_addr(&self) -> SocketAddr {
        let a: &[u8; wire::ADDR_LEN] = self.bytes[ADDR_AT..SECRET_AT].try_into().expect("ADDR_LEN");
        wire::decode_addr(a).expect("validated on construction")
    }

    pub(crate) fn secret(&self) -> [u8; 16] {
        self.bytes[SECRET_AT..END].try_into().expect("16 bytes")
    }
}
