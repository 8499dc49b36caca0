//! Test support, compiled into unit tests only.

pub(crate) mod alloc_probe;
pub(crate) mod fault_proxy;
