//! The host backend: "device memory" is host memory; plans run on the calling thread, over
//! shared-memory FIFOs between ranks of one host and TCP sockets between hosts.

pub(crate) mod conns;
pub(crate) mod exec;
