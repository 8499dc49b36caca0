//! Facts about this host: its name, an identity that tells containers apart, and an address
//! other hosts can probably reach.

use sha2::{Digest, Sha256};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Longest hostname carried in the rendezvous (POSIX HOST_NAME_MAX is 255).
pub(crate) const MAX_HOSTNAME: usize = 255;

pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for buf.len() bytes; gethostname NUL-terminates or truncates.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return String::from("unknown");
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let mut s = String::from_utf8_lossy(&buf[..end]).into_owned();
    s.truncate(MAX_HOSTNAME.min(s.len()));
    s
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Hostnames alone collide across containers (same image, same name); the kernel boot id
/// differs between machines, so ranks only count as co-located when both match.
pub(crate) fn host_id_of(hostname: &str, boot_id: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(b"ferroccl host\0");
    h.update(hostname.as_bytes());
    h.update([0u8]);
    h.update(boot_id.as_bytes());
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

pub(crate) fn host_id() -> u64 {
    host_id_of(&hostname(), &boot_id())
}

/// The first non-loopback IPv4 address of an interface that is up.
pub(crate) fn first_ipv4() -> Option<Ipv4Addr> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap with a list we free below and only read in between.
    unsafe {
        if libc::getifaddrs(&mut ifap) != 0 {
            return None;
        }
        let mut found = None;
        let mut cur = ifap;
        while !cur.is_null() {
            let ifa = &*cur;
            let up = ifa.ifa_flags & libc::IFF_UP as libc::c_uint != 0;
            let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as libc::c_uint != 0;
            if up
                && !lo
                && !ifa.ifa_addr.is_null()
                && (*ifa.ifa_addr).sa_family as libc::c_int == libc::AF_INET
            {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() && !ip.is_unspecified() {
                    found = Some(ip);
                    break;
                }
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(ifap);
        found
    }
}

/// The addresses of the interfaces that are up, in the kernel's order: (name, address).
pub(crate) fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap with a list we free below and only read in between.
    unsafe {
        if libc::getifaddrs(&mut ifap) != 0 {
            return out;
        }
        let mut cur = ifap;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_flags & libc::IFF_UP as libc::c_uint == 0
                || ifa.ifa_addr.is_null()
                || ifa.ifa_name.is_null()
            {
                continue;
            }
            let name = std::ffi::CStr::from_ptr(ifa.ifa_name)
                .to_string_lossy()
                .into_owned();
            let ip = match (*ifa.ifa_addr).sa_family as libc::c_int {
                libc::AF_INET => IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    (*(ifa.ifa_addr as *const libc::sockaddr_in))
                        .sin_addr
                        .s_addr,
                ))),
                libc::AF_INET6 => IpAddr::V6(Ipv6Addr::from(
                    (*(ifa.ifa_addr as *const libc::sockaddr_in6))
                        .sin6_addr
                        .s6_addr,
                )),
                _ => continue,
            };
            out.push((name, ip));
        }
        libc::freeifaddrs(ifap);
    }
    out
}

/// The address of the first interface `spec` chooses (NCCL_SOCKET_IFNAME's syntax: see
/// `ferroccl_core::ifname`), for the bootstrap to listen on and advertise.
pub fn interface_ip(spec: &str) -> Result<IpAddr, ferroccl_core::Error> {
    let s = ferroccl_core::ifname::IfSpec::parse(spec)?;
    let all = interfaces();
    s.pick(&all).ok_or_else(|| {
        let mut names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        names.dedup();
        ferroccl_core::Error::InvalidArgument(format!(
            "no interface that is up matches '{spec}' (interfaces: {})",
            names.join(", ")
        ))
    })
}
