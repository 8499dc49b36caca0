//! One rank as the sweep sees it: its communicators, the GPU stream both libraries share, where
//! each library's buffers lie, and how their contents are filled and checked (on the host, or
//! by the GPU verifier without staging anything through the host).

use super::cuda::Stream;
use super::libs::Lib;
use super::op::Regions;
use crate::api::{Comm, Error};
use crate::nccl::NcclComm;
use ferroccl::mem::Gpu;
use ferroccl::verify::{GpuVerifier, Wrong};
use ferroccl_core::numeric::expected::RankCase;

/// Poison byte for outputs: 0xA5A5... is a large or NaN-free odd value in every type, unlikely
/// to be a right answer by chance.
const POISON: u8 = 0xA5;

/// Base addresses of a rank's two buffers for one library: host memory on the host backend,
/// device memory on GPUs.
#[derive(Clone, Copy, Debug)]
pub struct Side {
    pub send: u64,
    pub recv: u64,
}

impl Side {
    /// The addresses of the input and the output of `g` (in place both in the send buffer).
    pub fn at(self, g: &Regions) -> (u64, u64) {
        let recv_base = if g.in_place { self.send } else { self.recv };
        (self.send + g.send_off as u64, recv_base + g.recv_off as u64)
    }
}

pub struct RankCtx<'a> {
    pub comm: &'a Comm,
    /// GPU ranks: the GPU and the communicator's stream, which NCCL is given too.
    pub gpu: Option<(Gpu, Stream)>,
    /// GPU ranks under --check: the verifier, taken once (it loads a module on the GPU).
    pub check: Option<GpuVerifier<'a>>,
    pub ferroccl: Side,
    /// Beside NCCL: this rank's NCCL communicator and NCCL's buffers (ferroccl's own unless
    /// they are registered).
    pub nccl: Option<(NcclComm, Side)>,
    /// The size of each buffer, which every row must fit in.
    pub bytes: usize,
}

// SAFETY: the stream, the NCCL handles and the verifier are used by one thread at a time (the
// one driving this rank, or the one driving all of them); host buffers likewise.
unsafe impl Send for RankCtx<'_> {}
unsafe impl Sync for RankCtx<'_> {}

impl RankCtx<'_> {
    pub fn stream(&self) -> Stream {
        self.gpu.as_ref().map_or(std::ptr::null_mut(), |g| g.1)
    }

    pub fn on_gpu(&self) -> Result<(&Gpu, Stream), Error> {
        self.gpu
            .as_ref()
            .map(|(g, s)| (g, *s))
            .ok_or_else(|| Error::InvalidArgument("CUDA graphs need GPU ranks".into()))
    }

    pub fn nccl(&self) -> Result<(NcclComm, Side), Error> {
        self.nccl
            .ok_or_else(|| Error::Internal("this rank has no NCCL communicator".into()))
    }

    pub fn side(&self, lib: Lib) -> Result<Side, Error> {
        match lib {
            Lib::Ferroccl => Ok(self.ferroccl),
            Lib::Nccl(_) => self.nccl().map(|n| n.1),
        }
    }

    /// This rank's regions of a row, which must fit in its buffers: the operations and the
    /// checks write through raw addresses.
    pub fn regions(&self, g: Regions) -> Result<Regions, Error> {
        if g.send_buffer_len().max(g.recv_len) > self.bytes {
            return Err(Error::Internal(format!(
                "a row needs {} bytes, more than the {} of a buffer",
                g.send_buffer_len().max(g.recv_len),
                self.bytes
            )));
        }
        Ok(g)
    }

    /// Fills the input with `case`'s data after poisoning the output (first: in place the input
    /// lies inside the output); returns once done.
    pub fn fill(&self, lib: Lib, g: &Regions, case: &RankCase) -> Result<(), Error> {
        let (s, d) = self.side(lib)?.at(g);
        if self.gpu.is_none() {
            // SAFETY: host regions of this rank's buffers (RankCtx::regions); no operation is
            // in flight.
            unsafe {
                std::slice::from_raw_parts_mut(d as usize as *mut u8, g.recv_len).fill(POISON);
                case.fill_input(std::slice::from_raw_parts_mut(
                    s as usize as *mut u8,
                    g.send_len,
                ));
            }
            return Ok(());
        }
        let chk = self.verifier()?;
        // SAFETY: device regions of this rank's buffers; no operation is in flight.
        unsafe {
            chk.poison(d as usize as *mut u8, g.recv_len, POISON)?;
            chk.fill(case, s as usize as *mut u8, g.send_len / case.dtype.size())?;
        }
        self.comm.synchronize()
    }

    /// The wrong elements of the output for `case`, and the first of them.
    pub fn count_wrong(&self, lib: Lib, g: &Regions, case: &RankCase) -> Result<Wrong, Error> {
        let (_, d) = self.side(lib)?.at(g);
        if self.gpu.is_none() {
            let mut first = None;
            // SAFETY: as in fill; the operation completed.
            let out = unsafe { std::slice::from_raw_parts(d as usize as *const u8, g.recv_len) };
            return Ok(Wrong {
                count: case.count_wrong(out, &mut first) as u64,
                first,
            });
        }
        // SAFETY: the output region of this rank, on its GPU.
        unsafe {
            self.verifier()?.count_wrong(
                case,
                d as usize as *const u8,
                g.recv_len / case.dtype.size(),
            )
        }
    }

    fn verifier(&self) -> Result<&GpuVerifier<'_>, Error> {
        self.check
            .as_ref()
            .ok_or_else(|| Error::Internal("checking a GPU rank without its verifier".into()))
    }
}
