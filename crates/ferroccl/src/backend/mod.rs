pub(crate) mod cuda;
pub(crate) mod host;
