//! The backends: what executes a communicator's plans. Each has one launch path, which borrows
//! the communicator's immutable [`CommInfo`](crate::info::CommInfo) and its own state.

pub(crate) mod cuda;
pub(crate) mod host;

/// A communicator's backend.
pub(crate) enum Backend {
    /// Host memory: plans run on the calling thread over shared-memory FIFOs and sockets.
    Host(host::HostComm),
    /// A GPU: plans run in the plan kernel over FIFOs in peer-mapped GPU memory.
    Cuda(Box<cuda::CudaComm>),
}

impl Backend {
    pub fn cuda(&self) -> Option<&cuda::CudaComm> {
        match self {
            Backend::Cuda(c) => Some(c),
            Backend::Host(_) => None,
        }
    }
}
