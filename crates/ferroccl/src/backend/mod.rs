pub(crate) mod cuda;
pub(crate) mod host;
// TEMPORARY (cuda-kern branch): until backend/cuda/mod.rs lands, these two files hang here.
#[path = "cuda/devplan.rs"]
#[allow(dead_code)]
pub(crate) mod devplan;
#[path = "cuda/kernels.rs"]
#[allow(dead_code)]
pub(crate) mod kernels;
