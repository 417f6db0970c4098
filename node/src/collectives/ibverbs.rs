//! The RDMA device: ibverbs on Linux (InfiniBand/RoCE), the system verbs
//! library on macOS (RDMA over Thunderbolt 5, loaded at run time as MLX's
//! JACCL does).
//!
//! Not bound in this build: neither the `ibverbs` crate nor a run-time
//! loader of `libibverbs` / `librdma` is compiled in yet, so [`open`] always
//! fails with [`CollectiveError::RdmaUnavailable`] naming what is missing, and
//! a pod falls back to TCP (pipeline parallel). The transport that will run
//! on it ([`super::verbs::VerbsTransport`]) is complete and tested over the
//! emulated fabric ([`super::fabric`]).

use super::CollectiveError;

/// The verbs library a build would load on this platform.
pub fn library_name() -> &'static str {
    if cfg!(target_os = "macos") {
        "/usr/lib/librdma.dylib"
    } else {
        "libibverbs.so.1"
    }
}

/// Opens RDMA device `device` (e.g. `rdma_en3` on macOS, `mlx5_0` on Linux).
pub fn open(device: &str) -> Result<std::convert::Infallible, CollectiveError> {
    Err(CollectiveError::RdmaUnavailable(format!(
        "cannot open {device}: this build of mlx-node has no verbs binding \
         ({} is not loaded); use the TCP data plane",
        library_name()
    )))
}
