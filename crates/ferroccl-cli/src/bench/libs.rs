//! The libraries a sweep runs: ferroccl, and NVIDIA's NCCL beside it (`--vs-nccl`). Each one's
//! calls for one iteration of a row, and what NCCL needs settled before anything is created.

use super::op::{BenchOp, Layout, Regions};
use super::rank::RankCtx;
use super::spec::{RowSpec, Spec};
use super::BenchArgs;
use crate::api::{CollKind, Error, Group, OpArgs, ReduceOp};
use crate::nccl::{Nccl, NcclComm};
use ferroccl_core::numeric::expected::RankCase;
use std::ffi::c_void;
use std::path::Path;

/// One library of the sweep; the timing loops match on it (no dynamic dispatch there).
#[derive(Clone, Copy)]
pub enum Lib<'a> {
    Ferroccl,
    Nccl(&'a Nccl),
}

impl Lib<'_> {
    pub fn name(self) -> &'static str {
        match self {
            Lib::Ferroccl => "ferroccl",
            Lib::Nccl(_) => "NCCL",
        }
    }

    pub fn has_in_place(self, op: BenchOp) -> bool {
        match self {
            Lib::Ferroccl => op.has_in_place(),
            Lib::Nccl(_) => nccl_has_in_place(op),
        }
    }

    /// One iteration of the row on every rank of `ranks` (one group over them all).
    pub fn launch(self, call: &Call, ranks: &[RankCtx], regs: &[Regions]) -> Result<(), Error> {
        match self {
            Lib::Ferroccl => {
                let mut g = Group::new();
                for (r, reg) in ranks.iter().zip(regs) {
                    let (s, d) = r.ferroccl.at(reg);
                    for a in call.ops(r.comm.rank(), s, d) {
                        // SAFETY: the rank's buffers hold every row's regions (RankCtx::regions)
                        // and live until after the last synchronisation.
                        unsafe { g.push_raw(r.comm, a)? };
                    }
                }
                g.launch()
            }
            Lib::Nccl(lib) => {
                let grouped = ranks.len() > 1
                    || matches!(
                        call.rs.op,
                        BenchOp::AllToAll | BenchOp::Gather | BenchOp::Scatter | BenchOp::SendRecv
                    );
                if grouped {
                    lib.group_start()?;
                }
                let res = ranks.iter().zip(regs).try_for_each(|(r, reg)| {
                    let (nc, side) = r.nccl()?;
                    let (s, d) = side.at(reg);
                    let me = r.comm.rank();
                    // SAFETY: as above.
                    call.ops(me, s, d).try_for_each(|a| unsafe {
                        nccl_call(lib, &a, me, call.nranks, nc, r.stream())
                    })
                });
                // The group is closed even after a failed call, so NCCL's state stays sane.
                let end = if grouped { lib.group_end() } else { Ok(()) };
                res.and(end)
            }
        }
    }

    /// Errors the library recorded while running (ferroccl's kernels' error word, NCCL's
    /// asynchronous error).
    pub fn errors(self, ranks: &[RankCtx]) -> Result<(), Error> {
        for r in ranks {
            match self {
                Lib::Ferroccl => r.comm.synchronize()?,
                Lib::Nccl(lib) => lib.async_error(r.nccl()?.0)?,
            }
        }
        Ok(())
    }
}

/// NCCL defines no in-place all-to-all (its send/receive pairs would overwrite data not yet
/// sent); the sendrecv ring has no in-place form for either library.
fn nccl_has_in_place(op: BenchOp) -> bool {
    op.has_in_place() && op != BenchOp::AllToAll
}

/// A row as the libraries are called for it.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub rs: RowSpec,
    pub lay: Layout,
    pub root: usize,
    pub nranks: usize,
}

impl Call {
    /// The operations of one iteration on rank `me` with its input at `send` and its output at
    /// `recv`: ferroccl's, and NCCL is called with the same (two for the sendrecv ring: to the
    /// next rank, from the previous one).
    pub fn ops(&self, me: usize, send: u64, recv: u64) -> impl Iterator<Item = OpArgs> {
        let (rs, n) = (&self.rs, self.nranks);
        let args = OpArgs {
            kind: rs.op.kind(),
            send: send as usize as *const u8,
            recv: recv as usize as *mut u8,
            count: self.lay.count,
            dtype: rs.dtype,
            op: rs.redop.unwrap_or(ReduceOp::Sum),
            root: self.root,
            device_scalar: None,
        };
        // An array, not a Vec: this runs in the timing loops.
        let (ops, len) = match rs.op {
            BenchOp::SendRecv => (
                [
                    OpArgs {
                        kind: CollKind::Send,
                        recv: std::ptr::null_mut(),
                        root: (me + 1) % n,
                        ..args
                    },
                    OpArgs {
                        kind: CollKind::Recv,
                        send: std::ptr::null(),
                        root: (me + n - 1) % n,
                        ..args
                    },
                ],
                2,
            ),
            _ => ([args, args], 1),
        };
        ops.into_iter().take(len)
    }

    /// The verifiable input of rank `me` and the output it must get: those of its first and
    /// last operation (the send and the receive of the sendrecv ring).
    pub fn check_cases(&self, me: usize, seed: u64) -> (RankCase, RankCase) {
        let case = |a: &OpArgs| RankCase {
            kind: a.kind,
            dtype: a.dtype,
            op: a.op,
            nranks: self.nranks,
            rank: me,
            count: a.count,
            // A send's or a receive's root is its peer.
            root: if matches!(
                a.kind,
                CollKind::AllReduce
                    | CollKind::AllGather
                    | CollKind::ReduceScatter
                    | CollKind::AllToAll
            ) {
                0
            } else {
                a.root
            },
            seed,
        };
        let mut ops = self.ops(me, 0, 0);
        let first = ops.next().expect("every row has an operation");
        (case(&first), case(&ops.last().unwrap_or(first)))
    }
}

/// NCCL's call for one of the row's operations on rank `me` of `n`. All-to-all, gather and
/// scatter are NCCL collectives from 2.28 on; before that they are composed of sends and
/// receives in a group, as nccl-tests does.
///
/// # Safety
/// The operation's buffers are device memory of the rank's GPU holding the row's regions.
unsafe fn nccl_call(
    lib: &Nccl,
    a: &OpArgs,
    me: usize,
    n: usize,
    nc: NcclComm,
    st: *mut c_void,
) -> Result<(), Error> {
    let (c, dt, op, root) = (a.count, a.dtype.nccl_id(), a.op.nccl_id(), a.root);
    let blk = c * a.dtype.size();
    let sp = |p: usize| a.send.wrapping_add(p * blk) as *const c_void;
    let dp = |p: usize| a.recv.wrapping_add(p * blk) as *mut c_void;
    unsafe {
        match a.kind {
            CollKind::AllReduce => lib.all_reduce(sp(0), dp(0), c, dt, op, nc, st),
            CollKind::AllGather => lib.all_gather(sp(0), dp(0), c, dt, nc, st),
            CollKind::ReduceScatter => lib.reduce_scatter(sp(0), dp(0), c, dt, op, nc, st),
            CollKind::Broadcast => lib.broadcast(sp(0), dp(0), c, dt, root, nc, st),
            CollKind::Reduce => lib.reduce(sp(0), dp(0), c, dt, op, root, nc, st),
            CollKind::AllToAll => {
                if !lib.all_to_all(sp(0), dp(0), c, dt, nc, st)? {
                    for p in 0..n {
                        lib.send(sp(p), c, dt, p, nc, st)?;
                        lib.recv(dp(p), c, dt, p, nc, st)?;
                    }
                }
                Ok(())
            }
            CollKind::Gather => {
                if !lib.gather(sp(0), dp(0), c, dt, root, nc, st)? {
                    lib.send(sp(0), c, dt, root, nc, st)?;
                    if me == root {
                        for p in 0..n {
                            lib.recv(dp(p), c, dt, p, nc, st)?;
                        }
                    }
                }
                Ok(())
            }
            CollKind::Scatter => {
                if !lib.scatter(sp(0), dp(0), c, dt, root, nc, st)? {
                    if me == root {
                        for p in 0..n {
                            lib.send(sp(p), c, dt, p, nc, st)?;
                        }
                    }
                    lib.recv(dp(0), c, dt, root, nc, st)?;
                }
                Ok(())
            }
            CollKind::Send => lib.send(sp(0), c, dt, root, nc, st),
            CollKind::Recv => lib.recv(dp(0), c, dt, root, nc, st),
        }
    }
}

/// How NCCL's buffers are registered (`--register`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Register {
    Off,
    Local,
    Symmetric,
}

impl Register {
    fn parse(arg: Option<&str>, lib: &Nccl) -> Result<Register, String> {
        let r = match arg {
            None => return Ok(Register::Off),
            Some("auto") if lib.has_window_register() => Register::Symmetric,
            Some("auto") | Some("local") => Register::Local,
            Some("symmetric") | Some("window") => Register::Symmetric,
            Some(x) => {
                return Err(format!(
                    "--register {x}: one of symmetric, local (or no value)"
                ))
            }
        };
        if !lib.has_mem_alloc() {
            return Err(format!(
                "--register needs ncclMemAlloc, which NCCL {} lacks",
                lib.version_string()
            ));
        }
        match r {
            Register::Symmetric if !lib.has_window_register() => Err(format!(
                "--register symmetric needs ncclCommWindowRegister (NCCL 2.27+); NCCL {} lacks it",
                lib.version_string()
            )),
            Register::Local if !lib.has_local_register() => Err(format!(
                "--register local needs ncclCommRegister; NCCL {} lacks it",
                lib.version_string()
            )),
            r => Ok(r),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Register::Off => "off",
            Register::Local => "local",
            Register::Symmetric => "symmetric",
        }
    }
}

/// NCCL beside ferroccl: the loaded library, how its buffers are registered, and what
/// NCCL_NVLS_ENABLE was found or set to.
pub struct NcclSide {
    pub lib: Nccl,
    pub reg: Register,
    pub nvls: String,
}

impl NcclSide {
    /// Loads NCCL for --vs-nccl; without it, refuses the options that only the comparison has.
    pub fn from_args(args: &BenchArgs, spec: &Spec) -> Result<Option<NcclSide>, String> {
        let Some(path) = &args.vs_nccl else {
            if args.graph > 0 && args.gpus == 0 {
                return Err(
                    "--graph captures CUDA graphs: it needs GPU ranks (-g N or --devices)".into(),
                );
            }
            if args.graph > 0 && spec.check {
                // Alone, --check checks every timed iteration, each on its own: nothing to
                // capture back to back.
                return Err("--graph times replays of unchecked iterations: run --check without it (beside NCCL, --vs-nccl checks one iteration first)".into());
            }
            if let Some(r) = args.register.as_deref().filter(|&r| r != "auto") {
                return Err(format!("--register {r}: a kind of NCCL registration; add --vs-nccl (ferroccl itself registers windows)"));
            }
            return Ok(None);
        };
        if args.gpus == 0 {
            return Err("--vs-nccl compares GPU libraries: add -g N (N GPUs in this process, or -g 1 under a launcher)".into());
        }
        if spec
            .redops
            .iter()
            .any(|o| matches!(o, ReduceOp::PreMulSum(_)))
        {
            return Err("--vs-nccl: premulsum is not compared (NCCL needs a per-communicator operator for it)".into());
        }
        let nvls = ensure_nvls_off()?;
        let lib = Nccl::load(Some(path).filter(|p| !p.is_empty()).map(Path::new))?;
        let reg = Register::parse(args.register.as_deref(), &lib)?;
        Ok(Some(NcclSide { lib, reg, nvls }))
    }
}

/// NVLink multicast (NVLS) must stay off on the shared GPU hosts; NCCL reads this variable
/// when a communicator is created, so it is set before any is. A user who asks for NVLS is
/// refused rather than ignored.
fn ensure_nvls_off() -> Result<String, String> {
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(v) if v.trim() == "0" => Ok("0 (already set)".into()),
        Ok(v) if !v.trim().is_empty() => Err(format!(
            "NCCL_NVLS_ENABLE={v}: NVLink multicast must stay off on these machines; unset it or set it to 0"
        )),
        _ => {
            // Set on the main thread before any NCCL or rank thread exists.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
            Ok("0 (set by ferroccl bench)".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_in_place_forms() {
        assert!(!nccl_has_in_place(BenchOp::AllToAll));
        assert!(!nccl_has_in_place(BenchOp::SendRecv));
        assert!(nccl_has_in_place(BenchOp::Gather));
        assert!(nccl_has_in_place(BenchOp::AllReduce));
    }

    #[test]
    fn nvls_request_is_refused() {
        // The variable is process-wide: this test only reads it when it is unset, and
        // restores it.
        let before = std::env::var("NCCL_NVLS_ENABLE").ok();
        std::env::set_var("NCCL_NVLS_ENABLE", "1");
        let e = ensure_nvls_off().unwrap_err();
        assert!(
            e.contains("NCCL_NVLS_ENABLE=1") && e.contains("must stay off"),
            "{e}"
        );
        std::env::remove_var("NCCL_NVLS_ENABLE");
        assert!(ensure_nvls_off().unwrap().contains("set by ferroccl"));
        assert_eq!(std::env::var("NCCL_NVLS_ENABLE").unwrap(), "0");
        match before {
            Some(v) => std::env::set_var("NCCL_NVLS_ENABLE", v),
            None => std::env::remove_var("NCCL_NVLS_ENABLE"),
        }
    }
}
