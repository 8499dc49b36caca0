//! What this machine is, for `ferroccl info` and for the records `bench --json` writes: a
//! figure is worthless without the hardware and the commit that produced it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub hostname: String,
    pub cpu_model: String,
    /// CPUs this process may run on (affinity and cgroup quota respected).
    pub cores: usize,
    /// Logical CPUs the kernel lists.
    pub cpus_online: usize,
    pub mem_total_bytes: Option<u64>,
    pub shm_bytes: Option<u64>,
    pub os: String,
}

pub const GIT_COMMIT: &str = match option_env!("FERROCCL_GIT_COMMIT") {
    Some(c) => c,
    None => "unknown",
};

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname NUL-terminates on success
    // when the name fits, and we cut at the first NUL either way.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| {
            l.starts_with("model name") || l.starts_with("Model") || l.starts_with("cpu model")
        })
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn mem_total(meminfo: &str) -> Option<u64> {
    let l = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn fs_size(path: &str) -> Option<u64> {
    let c = std::ffi::CString::new(path).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and st a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_blocks as u64 * st.f_frsize as u64)
}

impl Machine {
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Machine {
            hostname: hostname(),
            cpu_model: cpu_model(&cpuinfo).unwrap_or_else(|| "unknown".into()),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpus_online: cpuinfo
                .lines()
                .filter(|l| l.starts_with("processor"))
                .count(),
            mem_total_bytes: mem_total(&meminfo),
            shm_bytes: fs_size("/dev/shm"),
            os: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| format!("{} {}", std::env::consts::OS, s.trim()))
                .unwrap_or_else(|_| std::env::consts::OS.into()),
        }
    }
}

/// The GPU side of a machine, for records that compare GPU libraries.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuMachine {
    /// Model of each visible GPU, by CUDA ordinal.
    pub gpus: Vec<String>,
    pub driver: Option<String>,
    /// The CUDA version the driver implements (cuDriverGetVersion), e.g. "13.0".
    pub cuda: Option<String>,
    /// `nvidia-smi topo -m` as printed (the NVLink matrix), when nvidia-smi is there.
    pub topology: Option<String>,
}

fn nvidia_smi(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim_end().to_string())
}

/// The first line of `nvidia-smi --query-gpu=driver_version` output.
fn first_line(s: &str) -> Option<String> {
    s.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

impl GpuMachine {
    /// What nvidia-smi and the driver say; fields stay empty where they cannot be asked.
    pub fn probe(cuda_version: Option<String>) -> GpuMachine {
        let names = nvidia_smi(&["--query-gpu=name", "--format=csv,noheader"]).unwrap_or_default();
        GpuMachine {
            gpus: names
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect(),
            driver: nvidia_smi(&["--query-gpu=driver_version", "--format=csv,noheader"])
                .as_deref()
                .and_then(first_line),
            cuda: cuda_version,
            topology: nvidia_smi(&["topo", "-m"]),
        }
    }
}

pub fn gib(b: Option<u64>) -> String {
    b.map_or("unknown".into(), |b| {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse() {
        assert_eq!(
            cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n").unwrap(),
            "AMD EPYC 9654 96-Core Processor"
        );
        assert_eq!(
            mem_total("MemTotal:       131072 kB\nMemFree: 1 kB\n"),
            Some(131072 * 1024)
        );
        assert_eq!(mem_total("nothing"), None);
        assert_eq!(
            first_line("\n 580.65.06\n580.65.06\n").as_deref(),
            Some("580.65.06")
        );
    }
}
