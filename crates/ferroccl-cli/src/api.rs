//! TEMPORARY stand-in for the communicator API until `host backend` lands on main; replaced by
//! re-exports from `ferroccl` at the merge. Signatures follow the agreed contract exactly.
#![allow(dead_code, unused_variables)]

pub use ferroccl::{CollKind, Config, DataType, Error, ReduceOp};
use ferroccl_core::topo::{Topology, TransportKind};

pub enum Device {
    Host,
}

pub struct UniqueId;

pub struct Comm;

impl Comm {
    pub fn init_rank(id: &UniqueId, nranks: usize, rank: usize, device: Device, config: &Config) -> Result<Comm, Error> {
        unimplemented!()
    }
    pub fn init_all(ndev: usize, config: &Config) -> Result<Vec<Comm>, Error> {
        unimplemented!()
    }
    pub fn from_env(config: &Config) -> Result<Comm, Error> {
        unimplemented!()
    }
    pub fn rank(&self) -> usize {
        unimplemented!()
    }
    pub fn nranks(&self) -> usize {
        unimplemented!()
    }
    pub fn topology(&self) -> &Topology {
        unimplemented!()
    }
    pub fn transport_to(&self, peer: usize) -> Result<TransportKind, Error> {
        unimplemented!()
    }
    pub fn barrier(&self) -> Result<(), Error> {
        unimplemented!()
    }
    /// # Safety
    /// Pointers valid for the operation's buffer sizes.
    pub unsafe fn run_raw(&self, args: &OpArgs) -> Result<(), Error> {
        unimplemented!()
    }
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Comm>, Error> {
        unimplemented!()
    }
    pub fn abort(&self) {}
}

#[derive(Clone, Copy, Debug)]
pub struct OpArgs {
    pub kind: CollKind,
    pub send: *const u8,
    pub recv: *mut u8,
    pub count: usize,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub root: usize,
}

pub struct Group<'a> {
    comms: Vec<&'a Comm>,
}

impl<'a> Group<'a> {
    pub fn new() -> Self {
        Group { comms: Vec::new() }
    }
    /// # Safety
    /// As `Comm::run_raw`.
    pub unsafe fn push_raw(&mut self, comm: &'a Comm, args: OpArgs) -> Result<(), Error> {
        unimplemented!()
    }
    pub fn launch(self) -> Result<(), Error> {
        unimplemented!()
    }
}
