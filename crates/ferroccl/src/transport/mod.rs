//! Connections between ranks of the host backend: single-producer single-consumer FIFOs of
//! fixed-size slots.
//!
//! One FIFO implementation serves every case, so the executor has a single code path:
//! - ranks that are threads of one process share a heap FIFO (`FifoMem::heap`);
//! - ranks that are processes of one host share a FIFO in POSIX shared memory
//!   (`FifoMem::shm_create` on the receiver, `FifoMem::shm_open` on the sender);
//! - ranks on different hosts each hold a heap FIFO that a thread bridges to a TCP socket
//!   (`tcp_sender`, `tcp_receiver`).
//!
//! All `try_*` calls are non-blocking, because one executor thread polls many FIFOs; `wait`
//! is only for when nothing anywhere made progress. Failures travel as poison: either end
//! can mark the FIFO failed with a reason, which the other end reports instead of waiting
//! for its deadline.

mod crc32c;
mod fifo;
mod shm;
mod tcp;

pub(crate) use fifo::{pid_alive, Consumer, FifoLayout, FifoMem, Producer};
pub(crate) use tcp::{tcp_receiver_joinable, tcp_sender_joinable, FrameCheck};

#[cfg(test)]
mod tests;
