//! `ferroccl info`: the machine, and how a communicator on it would connect its ranks.

use crate::api::{Comm, Config};
use crate::machine::{gib, Machine, GIT_COMMIT};

#[derive(clap::Args, Debug, Clone)]
pub struct InfoArgs {
    /// Ranks (threads of this process) of the example communicator when no launcher started us
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
}

fn print_machine(config: &Config) {
    let m = Machine::probe();
    println!(
        "ferroccl {} (commit {GIT_COMMIT})",
        env!("CARGO_PKG_VERSION")
    );
    println!("host:      {}", m.hostname);
    println!("os:        {}", m.os);
    println!("cpu:       {}", m.cpu_model);
    println!("cores:     {} usable ({} online)", m.cores, m.cpus_online);
    println!("memory:    {}", gib(m.mem_total_bytes));
    println!("/dev/shm:  {}", gib(m.shm_bytes));
    print_gpus();
    println!(
        "transport: {:?} (FERROCCL_TRANSPORT), timeout {:?}",
        config.transport, config.timeout
    );
}

/// The GPUs, and how each pair is linked: what a GPU communicator's ranks would use between
/// them (cuMem memory mapped by the peer, over NVLink where the link has native atomics).
fn print_gpus() {
    use ferroccl::cuda::{gpu_count, Gpu};
    let n = match gpu_count() {
        Ok(0) => return println!("GPUs:      none"),
        Ok(n) => n,
        Err(e) => return println!("GPUs:      none ({e})"),
    };
    let gpus: Vec<Result<Gpu, String>> = (0..n)
        .map(|i| Gpu::open(i).map_err(|e| e.to_string()))
        .collect();
    println!("GPUs:      {n}");
    for (i, g) in gpus.iter().enumerate() {
        match g {
            Ok(g) => {
                let (major, minor) = g.compute_capability();
                let fd = g.supports_cumem_fd().unwrap_or(false);
                println!(
                    "  GPU {i}: {}, sm_{major}{minor}, {}, cuMem with fd handles: {}",
                    g.name(),
                    gib(Some(g.total_memory() as u64)),
                    if fd {
                        "yes"
                    } else {
                        "no (other processes cannot map its memory)"
                    }
                );
            }
            Err(e) => println!("  GPU {i}: cannot open: {e}"),
        }
    }
    if n < 2 {
        return;
    }
    println!("links between GPUs (row -> column): NV = NVLink (peer access with native atomics), PCI = peer access");
    println!("without them, no = no peer access (a GPU communicator cannot span that pair); rank = the driver's");
    println!("performance rank of the link, lower is better");
    let cell = |a: usize, b: usize| -> String {
        let Ok(g) = &gpus[a] else { return "?".into() };
        match g.peer_link(b) {
            Ok(l) if !l.access => "no".into(),
            Ok(l) => format!(
                "{}/{}",
                if l.native_atomics { "NV" } else { "PCI" },
                l.perf_rank
            ),
            Err(_) => "?".into(),
        }
    };
    print!("{}", square_table(n, "GPU", cell));
}

/// An n x n table with `label i` rows and columns, "-" on the diagonal.
fn square_table(n: usize, label: &str, pair: impl Fn(usize, usize) -> String) -> String {
    let mut s = format!("{:>8}", "");
    for b in 0..n {
        s += &format!(" {:>6}", b);
    }
    s.push('\n');
    for a in 0..n {
        s += &format!("{:>8}", format!("{label} {a}"));
        for b in 0..n {
            s += &format!(" {:>6}", if a == b { "-".to_string() } else { pair(a, b) });
        }
        s.push('\n');
    }
    s
}

pub fn main(a: &InfoArgs, config: &Config) -> Result<(), String> {
    let launched = crate::launcher_env()?;
    // Under a launcher every rank runs this; one copy of the machine is enough.
    if launched.as_ref().map_or(0, |e| e.rank) == 0 {
        print_machine(config);
    }
    let comms =
        match &launched {
            Some(env) => vec![Comm::from_env(config)
                .map_err(|e| format!("joining the {} job: {e}", env.source))?],
            None => Comm::init_all(a.ranks.max(1), config)
                .map_err(|e| format!("creating {} ranks: {e}", a.ranks))?,
        };
    let c0 = &comms[0];
    if c0.rank() != 0 {
        // Rank 0 prints for the whole job; the others only had to take part in the rendezvous.
        return c0.barrier().map_err(|e| e.to_string());
    }
    let topo = c0.topology();
    println!();
    println!(
        "communicator: {} ranks on {} host(s), {}",
        c0.nranks(),
        topo.hosts(),
        match &launched {
            Some(env) => format!("one process per rank ({} launcher)", env.source),
            None => "threads of this process".into(),
        }
    );
    for (r, loc) in topo.ranks.iter().enumerate() {
        println!("  rank {r:>3}: {} pid {}", loc.hostname, loc.pid);
    }
    println!("transport between ranks (row -> column):");
    // In thread mode every rank's own communicator answers; under a launcher this process
    // holds rank 0 only, and the others follow the same rule over the same topology.
    let table = if comms.len() > 1 {
        square_table(topo.ranks.len(), "rank", |a, b| {
            comms[a]
                .transport_to(b)
                .map_or_else(|e| format!("err: {e}"), |t| t.name().to_string())
        })
    } else {
        square_table(topo.ranks.len(), "rank", |a, b| {
            if a == 0 {
                c0.transport_to(b)
                    .map_or_else(|e| format!("err: {e}"), |t| t.name().to_string())
            } else {
                topo.transport(a, b, config.transport)
                    .map_or_else(|_| "err".into(), |t| t.name().to_string())
            }
        })
    };
    print!("{table}");
    if launched.is_some() {
        c0.barrier().map_err(|e| e.to_string())?;
    }
    Ok(())
}
