pub(crate) mod host;
