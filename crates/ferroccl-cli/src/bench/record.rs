//! The records `bench --json FILE` writes and `ferroccl plot` reads. Beside NCCL: every row of
//! both libraries, the memory each held, and everything needed to reproduce or doubt a figure
//! (machine, commit, command, both versions, launch mode, options); ferroccl alone: its rows,
//! the machine, the commit and the command.

use super::cuda as cu;
use super::libs::Register;
use super::setup::Job;
use super::spec::{Buffers, Spec};
use super::table::{self, Measure, Row};
use super::BenchArgs;
use crate::api::Config;
use crate::machine::{GpuMachine, Machine, GIT_COMMIT};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// `bench --json` without --vs-nccl.
#[derive(Serialize)]
struct AloneRecord<'a> {
    tool: &'static str,
    version: &'static str,
    commit: &'static str,
    command: Vec<String>,
    mode: &'a str,
    nranks: usize,
    machine: Machine,
    ops: Vec<&'static str>,
    iters: u64,
    warmup: u64,
    check: bool,
    /// Where unregistered GPU buffers came from (`--buffers`).
    buffers: &'static str,
    wrong: u64,
    /// Per operation: the mean bus bandwidth over its rows (both halves), as in the footer.
    avg_busbw: Vec<(&'static str, f64)>,
    rows: &'a [Row],
}

pub fn write_alone(
    path: &Path,
    spec: &Spec,
    rows: &[Row],
    mode: &str,
    nranks: usize,
) -> Result<(), String> {
    let avg = spec
        .ops
        .iter()
        .map(|&op| {
            (
                op.name(),
                table::avg_busbw(rows.iter().filter(|r| r.op == op.name())),
            )
        })
        .collect();
    let rep = AloneRecord {
        tool: "ferroccl bench",
        version: env!("CARGO_PKG_VERSION"),
        commit: GIT_COMMIT,
        command: std::env::args().collect(),
        mode,
        nranks,
        machine: Machine::probe(),
        ops: spec.ops.iter().map(|o| o.name()).collect(),
        iters: spec.iters,
        warmup: spec.warmup,
        check: spec.check,
        buffers: spec.buffers.name(),
        wrong: table::total_wrong(rows),
        avg_busbw: avg,
        rows,
    };
    let text = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
}

/// One library's half of a row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LibResult {
    pub out_of_place: Measure,
    /// None where the library has no defined in-place form of the operation.
    pub in_place: Option<Measure>,
    /// Thread blocks the operation launched (the most over ranks), out of place; see
    /// `docs/ARCHITECTURE.md` for where each library's figure comes from.
    pub blocks: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VsRow {
    pub op: String,
    pub size: usize,
    pub count: usize,
    pub dtype: String,
    pub redop: String,
    pub root: i64,
    pub ferroccl: LibResult,
    pub nccl: LibResult,
    /// ferroccl busbw / NCCL busbw, out of place and in place.
    pub ratio_out_of_place: Option<f64>,
    pub ratio_in_place: Option<f64>,
}

/// busbw ratio, None where either side moved nothing measurable.
pub fn ratio(f: &Measure, n: &Measure) -> Option<f64> {
    (f.busbw > 0.0 && n.busbw > 0.0).then(|| f.busbw / n.busbw)
}

impl VsRow {
    pub fn fill_ratios(&mut self) {
        self.ratio_out_of_place = ratio(&self.ferroccl.out_of_place, &self.nccl.out_of_place);
        self.ratio_in_place = match (&self.ferroccl.in_place, &self.nccl.in_place) {
            (Some(f), Some(n)) => ratio(f, n),
            _ => None,
        };
    }
}

/// GPU memory of one rank, bytes. Free-memory deltas are the driver's view (cuMemGetInfo on
/// the rank's GPU): they include what a library allocates behind its own back (kernel
/// modules, NCCL's proxy buffers), which its own accounting cannot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankMemory {
    pub rank: usize,
    pub gpu: usize,
    /// ferroccl's own count (`Comm::device_memory_bytes`: its allocations; until session 11
    /// also the peers' memory mapped from other processes) right after init and at the end of
    /// the run.
    pub ferroccl_accounted_init: u64,
    pub ferroccl_accounted_end: u64,
    /// Free memory before minus after creating each communicator.
    pub ferroccl_init_delta: i64,
    pub nccl_init_delta: i64,
    /// Free memory each communicator's destruction gave back at the end of the run, once the
    /// benchmark's own buffers were freed: what it held after every warm-up.
    pub nccl_held_end: i64,
    pub ferroccl_held_end: i64,
    pub gpu_total: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NcclInfo {
    pub path: String,
    pub version: String,
    pub version_code: i32,
    /// 2.28+: all-to-all, gather and scatter are NCCL calls; else composed of send/recv.
    pub native_all_to_all: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VsOptions {
    pub ops: Vec<String>,
    pub dtypes: Vec<String>,
    pub redops: Vec<String>,
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub iters: u64,
    pub warmup: u64,
    pub iter_budget: Option<usize>,
    pub root: usize,
    pub check: bool,
    /// CUDA-graph replays per row (0: no graphs, each op launched by the host).
    pub graph: u64,
    /// "off", "local" (ncclCommRegister) or "symmetric" (ncclCommWindowRegister).
    pub register: String,
    /// What ferroccl's buffers were under --register.
    pub ferroccl_register: String,
    pub max_ctas: Option<usize>,
    pub gpu_channels: usize,
    pub nvls: String,
    /// Where unregistered buffers came from (`--buffers`: "cumem" or "driver"); records from
    /// before the option had cuMem buffers.
    #[serde(default = "cumem")]
    pub buffers: String,
}

/// What records written before `--buffers` used.
fn cumem() -> String {
    Buffers::Cumem.name().into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VsRecord {
    pub tool: String,
    pub version: String,
    pub commit: String,
    pub command: Vec<String>,
    /// Short description for plot legends: launch mode and options.
    pub label: String,
    pub mode: String,
    pub nranks: usize,
    pub machine: Machine,
    pub gpu_machine: GpuMachine,
    pub nccl: NcclInfo,
    pub options: VsOptions,
    pub memory: Vec<RankMemory>,
    pub wrong_ferroccl: u64,
    pub wrong_nccl: u64,
    pub rows: Vec<VsRow>,
}

impl VsRecord {
    /// The record of a run beside NCCL that ended well: `wrong` per library, `memory` from
    /// `Job::close`.
    pub fn new(
        args: &BenchArgs,
        spec: &Spec,
        config: &Config,
        job: &Job,
        memory: Vec<RankMemory>,
        wrong: &[u64],
        rows: Vec<VsRow>,
    ) -> Result<VsRecord, String> {
        let n = job
            .nccl
            .as_ref()
            .ok_or("a record beside NCCL of a run without it")?;
        let lib = &n.lib;
        Ok(VsRecord {
            tool: "ferroccl bench --vs-nccl".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commit: GIT_COMMIT.into(),
            command: std::env::args().collect(),
            label: label(job.short, args.graph, n.reg, spec.buffers, args.max_ctas),
            mode: job.mode.clone(),
            nranks: job.nranks,
            machine: Machine::probe(),
            gpu_machine: GpuMachine::probe(cu::driver_cuda_version()),
            nccl: NcclInfo {
                path: lib.path().into(),
                version: lib.version_string(),
                version_code: lib.version(),
                native_all_to_all: lib.has_native_all_to_all(),
            },
            options: VsOptions {
                ops: spec.ops.iter().map(|o| o.name().to_string()).collect(),
                dtypes: spec.dtypes.iter().map(|d| d.name().to_string()).collect(),
                redops: spec.redops.iter().map(|o| o.name().to_string()).collect(),
                min_bytes: spec.sizes.first().copied().unwrap_or(0),
                max_bytes: spec.sizes.last().copied().unwrap_or(0),
                iters: spec.iters,
                warmup: spec.warmup,
                iter_budget: spec.iter_budget,
                root: spec.root,
                check: spec.check,
                graph: args.graph,
                register: n.reg.name().into(),
                ferroccl_register: if n.reg == Register::Off {
                    "off".into()
                } else {
                    "ferroccl::mem buffers registered as symmetric windows (Comm::register_symmetric_buffer)".into()
                },
                max_ctas: args.max_ctas,
                gpu_channels: config.gpu_channels,
                nvls: n.nvls.clone(),
                buffers: spec.buffers.name().into(),
            },
            memory,
            wrong_ferroccl: wrong[0],
            wrong_nccl: wrong[1],
            rows,
        })
    }
}

/// Short description for plot legends: the launch mode and the options that change figures.
fn label(
    mode_short: &str,
    graph: u64,
    reg: Register,
    buffers: Buffers,
    max_ctas: Option<usize>,
) -> String {
    let mut s = mode_short.to_string();
    if graph > 0 {
        s += ", graph";
    }
    if reg != Register::Off {
        s += &format!(", registered ({})", reg.name());
    }
    if buffers == Buffers::Driver {
        s += ", cuMemAlloc buffers";
    }
    if let Some(n) = max_ctas {
        s += &format!(", max {n} CTAs");
    }
    s
}

pub fn write(path: &Path, rec: &VsRecord) -> Result<(), String> {
    let text = serde_json::to_string_pretty(rec).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
}

/// A record from its text (`path` names it in the error).
pub fn parse(text: &str, path: &Path) -> Result<VsRecord, String> {
    serde_json::from_str(text)
        .map_err(|e| format!("{}: not a `bench --vs-nccl` record: {e}", path.display()))
}

#[cfg(test)]
pub mod tests {
    use super::*;

    fn m(t: f64, bus: f64) -> Measure {
        Measure {
            time_us: t,
            algbw: bus / 1.5,
            busbw: bus,
            wrong: None,
        }
    }

    /// A small record with two ops and two sizes, for the JSON and plot tests.
    pub fn sample() -> VsRecord {
        let mut rows = Vec::new();
        for op in ["all-reduce", "alltoall"] {
            for (size, ft, nt) in [
                (8usize, 40.0, 9.0),
                (1 << 20, 30.0, 20.0),
                (1 << 30, 4000.0, 3000.0),
            ] {
                let mut r = VsRow {
                    op: op.into(),
                    size,
                    count: size / 4,
                    dtype: "float".into(),
                    redop: if op == "all-reduce" {
                        "sum".into()
                    } else {
                        "none".into()
                    },
                    root: -1,
                    ferroccl: LibResult {
                        out_of_place: m(ft, size as f64 / ft / 1e3),
                        in_place: Some(m(ft, 1.0)),
                        blocks: Some(32),
                    },
                    nccl: LibResult {
                        out_of_place: m(nt, size as f64 / nt / 1e3),
                        in_place: if op == "alltoall" {
                            None
                        } else {
                            Some(m(nt, 2.0))
                        },
                        blocks: Some(24),
                    },
                    ratio_out_of_place: None,
                    ratio_in_place: None,
                };
                r.fill_ratios();
                rows.push(r);
            }
        }
        VsRecord {
            tool: "ferroccl bench --vs-nccl".into(),
            version: "0.1.0".into(),
            commit: "abc".into(),
            command: vec!["ferroccl".into(), "bench".into(), "all".into()],
            label: "threads".into(),
            mode: "4 GPUs driven by one process (a thread each)".into(),
            nranks: 4,
            machine: Machine::probe(),
            gpu_machine: GpuMachine {
                gpus: vec!["NVIDIA H200".into(); 4],
                driver: Some("580".into()),
                cuda: Some("13.0".into()),
                topology: Some("\tGPU0\tGPU1\nGPU0\t X \tNV18".into()),
            },
            nccl: NcclInfo {
                path: "/x/libnccl.so.2".into(),
                version: "2.28.9".into(),
                version_code: 22809,
                native_all_to_all: true,
            },
            options: VsOptions {
                ops: vec!["all-reduce".into(), "alltoall".into()],
                dtypes: vec!["float".into()],
                redops: vec!["sum".into()],
                min_bytes: 8,
                max_bytes: 1 << 30,
                iters: 20,
                warmup: 5,
                iter_budget: Some(4 << 30),
                root: 0,
                check: false,
                graph: 0,
                register: "off".into(),
                ferroccl_register: "off".into(),
                max_ctas: None,
                gpu_channels: 32,
                nvls: "0".into(),
                buffers: "driver".into(),
            },
            memory: vec![RankMemory {
                rank: 0,
                gpu: 0,
                ferroccl_accounted_end: 1 << 28,
                nccl_held_end: 800 << 20,
                ..Default::default()
            }],
            wrong_ferroccl: 0,
            wrong_nccl: 0,
            rows,
        }
    }

    #[test]
    fn labels_name_mode_and_options() {
        assert_eq!(
            label("threads", 0, Register::Off, Buffers::Cumem, None),
            "threads"
        );
        assert_eq!(
            label("processes", 4, Register::Symmetric, Buffers::Cumem, Some(8)),
            "processes, graph, registered (symmetric), max 8 CTAs"
        );
        assert_eq!(
            label("processes", 4, Register::Off, Buffers::Driver, None),
            "processes, graph, cuMemAlloc buffers"
        );
    }

    #[test]
    fn record_round_trips_through_json() {
        let rec = sample();
        assert_eq!(rec.rows[1].ratio_out_of_place, Some(20.0 / 30.0));
        assert_eq!(
            rec.rows[3].ratio_in_place, None,
            "NCCL has no in-place all-to-all"
        );
        let p = std::env::temp_dir().join(format!("ferroccl-record-{}.json", std::process::id()));
        write(&p, &rec).unwrap();
        let read = |p: &Path| parse(&std::fs::read_to_string(p).unwrap(), p);
        let back = read(&p).unwrap();
        assert_eq!(back, rec);
        // A record from before --buffers had cuMem buffers.
        let mut old: serde_json::Value = serde_json::to_value(&rec).unwrap();
        old["options"].as_object_mut().unwrap().remove("buffers");
        let older = parse(&old.to_string(), &p).unwrap();
        assert_eq!(older.options.buffers, "cumem");
        assert_eq!(back.options.buffers, "driver");
        // Something else is refused with the file's name.
        std::fs::write(&p, "{\"rows\": 3}").unwrap();
        let e = read(&p).unwrap_err();
        assert!(e.contains("not a `bench --vs-nccl` record"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }
}
