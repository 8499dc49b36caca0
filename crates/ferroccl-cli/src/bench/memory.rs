//! GPU memory beside NCCL: the driver's free memory read around each library's communicator
//! creation and, at the end, around each one's destruction; and the report of what each held.

use super::cuda as cu;
use super::record::RankMemory;
use ferroccl::mem::Gpu;

/// Free memory of each GPU of this process, as the driver sees it now.
pub fn free_of(gpus: &[Gpu]) -> Result<Vec<u64>, String> {
    gpus.iter()
        .map(|g| cu::mem_info(g).map(|m| m.0).map_err(|e| e.to_string()))
        .collect()
}

/// The readings of one process, one entry per GPU, in the order they are taken.
#[derive(Default)]
pub struct Readings {
    /// Free memory before any communicator, after ferroccl's, after NCCL's.
    pub free_start: Vec<u64>,
    pub free_ferroccl: Vec<u64>,
    pub free_nccl: Vec<u64>,
    /// ferroccl's own count right after its communicators were created, and after the sweep.
    pub accounted_init: Vec<u64>,
    pub accounted_end: Vec<u64>,
    /// Free memory once the benchmark's buffers are freed, then NCCL's communicators
    /// destroyed, then ferroccl's.
    pub free_end: Vec<u64>,
    pub free_nccl_gone: Vec<u64>,
    pub free_gone: Vec<u64>,
}

impl Readings {
    /// Per rank of this process (`ranks` in the order of `gpus`).
    pub fn per_rank(&self, ranks: &[usize], gpus: &[Gpu]) -> Vec<RankMemory> {
        (0..gpus.len())
            .map(|i| RankMemory {
                rank: ranks[i],
                gpu: gpus[i].ordinal(),
                ferroccl_accounted_init: self.accounted_init[i],
                ferroccl_accounted_end: self.accounted_end[i],
                ferroccl_init_delta: self.free_start[i] as i64 - self.free_ferroccl[i] as i64,
                nccl_init_delta: self.free_ferroccl[i] as i64 - self.free_nccl[i] as i64,
                nccl_held_end: self.free_nccl_gone[i] as i64 - self.free_end[i] as i64,
                ferroccl_held_end: self.free_gone[i] as i64 - self.free_nccl_gone[i] as i64,
                gpu_total: cu::mem_info(&gpus[i]).map(|m| m.1).unwrap_or(0),
            })
            .collect()
    }
}

/// Every process prints its own ranks (under a launcher the others' figures cannot reach
/// rank 0 any more: the communicators are gone).
pub fn print(memory: &[RankMemory]) {
    for m in memory {
        println!(
            "# GPU memory, rank {} (GPU {}): ferroccl holds {} by its own count ({} after init); free-memory deltas: init ferroccl {}, NCCL {}; given back at the end by NCCL {}, by ferroccl {}",
            m.rank,
            m.gpu,
            mib(m.ferroccl_accounted_end as i64),
            mib(m.ferroccl_accounted_init as i64),
            mib(m.ferroccl_init_delta),
            mib(m.nccl_init_delta),
            mib(m.nccl_held_end),
            mib(m.ferroccl_held_end)
        );
    }
}

/// Without NCCL: each rank's GPU memory by ferroccl's own count, after init and at the end.
pub fn print_alone(ranks: &[usize], gpus: &[Gpu], init: &[u64], end: &[u64]) {
    for (i, g) in gpus.iter().enumerate() {
        let (Some(r), Some(a), Some(b)) = (ranks.get(i), init.get(i), end.get(i)) else {
            continue;
        };
        println!(
            "# GPU memory, rank {r} (GPU {}): ferroccl holds {} by its own count ({} after init)",
            g.ordinal(),
            mib(*b as i64),
            mib(*a as i64)
        );
    }
}

fn mib(b: i64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}
