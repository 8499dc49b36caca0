//! Choosing a network interface by name, as NCCL_SOCKET_IFNAME does: a comma-separated list
//! of name prefixes (`eth,ib`), exact names after `=` (`=eth0`), and either form negated by a
//! leading `^` (`^docker,lo`: any interface but those).

use crate::Error;
use std::net::IpAddr;

/// A parsed interface list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfSpec {
    /// Matching names are excluded instead of chosen.
    pub exclude: bool,
    /// Names must match exactly instead of by prefix.
    pub exact: bool,
    /// The names or prefixes listed.
    pub names: Vec<String>,
}

impl IfSpec {
    /// Reads NCCL_SOCKET_IFNAME's syntax; an empty list (not excluded) is an error.
    pub fn parse(spec: &str) -> Result<IfSpec, Error> {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() && !exclude {
            return Err(Error::InvalidArgument(format!(
                "interface list '{spec}' names no interface"
            )));
        }
        Ok(IfSpec {
            exclude,
            exact,
            names,
        })
    }

    /// Whether an interface of that name is chosen.
    pub fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        hit != self.exclude
    }

    /// The address to use among `interfaces` (name, address), in their order: the first IPv4
    /// address of a matching interface, else the first IPv6 one.
    pub fn pick(&self, interfaces: &[(String, IpAddr)]) -> Option<IpAddr> {
        let ok = |(n, _): &&(String, IpAddr)| self.matches(n);
        let v4 = interfaces.iter().filter(ok).find(|(_, a)| a.is_ipv4());
        v4.or_else(|| interfaces.iter().filter(ok).find(|(_, a)| a.is_ipv6()))
            .map(|(_, a)| *a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifs() -> Vec<(String, IpAddr)> {
        [
            ("lo", "127.0.0.1"),
            ("docker0", "172.17.0.1"),
            ("eth0", "fe80::1"),
            ("eth0", "10.0.0.5"),
            ("eth10", "10.1.0.5"),
            ("ib0", "fe80::2"),
        ]
        .iter()
        .map(|(n, a)| (n.to_string(), a.parse().unwrap()))
        .collect()
    }

    fn pick(spec: &str) -> Option<String> {
        IfSpec::parse(spec)
            .unwrap()
            .pick(&ifs())
            .map(|a| a.to_string())
    }

    #[test]
    fn prefixes_exact_names_and_exclusions_as_nccl_reads_them() {
        assert_eq!(
            pick("eth").as_deref(),
            Some("10.0.0.5"),
            "prefix; IPv4 before IPv6"
        );
        assert_eq!(pick("=eth1"), None, "exact: eth10 is not eth1");
        assert_eq!(pick("=eth10").as_deref(), Some("10.1.0.5"));
        assert_eq!(
            pick("ib").as_deref(),
            Some("fe80::2"),
            "IPv6 when there is no IPv4"
        );
        assert_eq!(pick("^lo,docker").as_deref(), Some("10.0.0.5"));
        assert_eq!(pick("^=lo").as_deref(), Some("172.17.0.1"));
        assert_eq!(
            pick("ib, eth").as_deref(),
            Some("10.0.0.5"),
            "spaces ignored; interface order decides"
        );
        assert_eq!(
            pick("lo").as_deref(),
            Some("127.0.0.1"),
            "loopback when named"
        );
        assert_eq!(pick("wlan"), None);
        assert!(IfSpec::parse("").is_err() && IfSpec::parse(" , ").is_err());
        assert_eq!(
            IfSpec::parse("^")
                .unwrap()
                .pick(&ifs())
                .unwrap()
                .to_string(),
            "127.0.0.1",
            "exclude nothing"
        );
    }
}
