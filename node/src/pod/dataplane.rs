//! Opening the pod's data plane: RDMA when the hostfile cables every pair of
//! members and the verbs library opens those devices, TCP otherwise.
//!
//! Every member first connects the TCP mesh ([`TcpTransport`]). Then, when
//! the hostfile has an `rdma` matrix, the members try RDMA together over it
//! ([`ibverbs::connect`]: each opens its device per peer, they exchange
//! queue-pair records and connect); the TCP connections stay open as the
//! RDMA side channel (queue-pair exchange, peer liveness).
//!
//! Policy:
//! - no `rdma` matrix: TCP;
//! - `backend: "jaccl"` or `"jaccl-ring"` (RDMA asked for explicitly): RDMA or
//!   fail with the typed reason ([`CollectiveError::Rdma`]): a pod its owner
//!   cabled for RDMA should not quietly run at TCP speed;
//! - a matrix without such a backend: RDMA if it works, else TCP with a
//!   warning that says why;
//! - a pair with several cables (a list of devices in its matrix entry):
//!   one lane per cable, frames striped over them
//!   ([`crate::collectives::stripe`]); a further cable that does not open
//!   leaves the pod on the lanes that did, with a warning.
//!
//! # Invariants
//! - Every member reaches the same decision: the matrix is the same file
//!   everywhere, and [`ibverbs::connect`] fails on every rank when it fails
//!   on one.
//!
//! # Failure
//! A side-channel error (a member lost while setting up) fails forming the
//! pod; the runtime forms it again.

use std::time::Duration;

use super::hostfile::{PodBackend, PodConfig};
use crate::collectives::ibverbs;
use crate::collectives::stripe::{Striped, MAX_LANES};
use crate::collectives::tcp::{TcpOptions, TcpTransport};
use crate::collectives::verbs::{VerbsOptions, VerbsTransport};
use crate::collectives::{Collective, CollectiveError, Group, GroupOptions};

/// Which transport the data plane runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Tcp,
    Rdma,
}

/// The pod's collectives over RDMA when possible (see the module policy),
/// with the system verbs library.
pub fn open(
    config: &PodConfig,
    rank: usize,
    tcp: TcpTransport,
    opts: &TcpOptions,
) -> Result<(Box<dyn Collective>, Backend), CollectiveError> {
    open_with(config, rank, tcp, opts, ibverbs::system())
}

/// [`open`] with a given verbs library.
pub fn open_with(
    config: &PodConfig,
    rank: usize,
    tcp: TcpTransport,
    opts: &TcpOptions,
    lib: Result<&'static ibverbs::Library, ibverbs::RdmaError>,
) -> Result<(Box<dyn Collective>, Backend), CollectiveError> {
    let mut group = Group::new(tcp, GroupOptions::default());
    if !config.has_rdma() {
        return Ok((Box::new(group), Backend::Tcp));
    }
    let required = matches!(
        config.backend,
        Some(PodBackend::Jaccl | PodBackend::JacclRing)
    );
    let attempt = match config.devices().peer_devices(rank) {
        Ok(devices) => ibverbs::connect(&mut group, lib.clone(), &devices),
        Err(e) => Err(CollectiveError::RdmaUnavailable(format!(
            "{e} (the rdma data plane needs a cable between every pair of members)"
        ))),
    };
    let pending = match attempt {
        Ok(p) => p,
        Err(e @ (CollectiveError::Rdma(_) | CollectiveError::RdmaUnavailable(_))) => {
            if required {
                return Err(e);
            }
            tracing::warn!(rank, reason = %e, "rdma unavailable: the pod's data plane is TCP");
            return Ok((Box::new(group), Backend::Tcp));
        }
        Err(e) => return Err(e),
    };
    // More cables per pair: one more lane each, over the devices the rows
    // list next (every rank connects the same lanes: the file is the same).
    let matrix = config.devices();
    let cables = matrix
        .rows
        .iter()
        .flatten()
        .map(Vec::len)
        .max()
        .unwrap_or(1)
        .min(MAX_LANES);
    let mut pendings = vec![pending];
    for lane in 1..cables {
        let devices: Vec<Option<String>> = matrix.rows[rank]
            .iter()
            .enumerate()
            .map(|(p, d)| d.get(lane).filter(|_| p != rank).cloned())
            .collect();
        match ibverbs::connect(&mut group, lib.clone(), &devices) {
            Ok(p) => pendings.push(p),
            Err(e @ CollectiveError::Rdma(_)) => {
                tracing::warn!(rank, lane, reason = %e, "a second rdma cable is unusable: one lane per pair");
                break;
            }
            Err(e) => return Err(e),
        }
    }
    let side = ibverbs::SideChannel::new(group.into_transport().into_streams())?;
    let mut lanes = Vec::with_capacity(pendings.len());
    for p in pendings {
        lanes.push(p.finish(side.try_clone()?));
    }
    let n_lanes = lanes.len();
    let mut transport = VerbsTransport::new(
        Striped::new(lanes)?,
        VerbsOptions {
            timeout: opts.timeout,
            ..VerbsOptions::default()
        },
    )?;
    // Every member's receives are posted before anyone sends.
    transport.verbs_mut().lanes_mut()[0]
        .barrier(opts.connect_timeout.max(Duration::from_secs(1)))?;
    drop(side);
    tracing::info!(rank, lanes = n_lanes, "the pod's data plane is RDMA");
    Ok((
        Box::new(Group::new(transport, GroupOptions::default())),
        Backend::Rdma,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::tests::tcp_mesh;

    const CABLED: &str = r#"[
        {"ssh": "a", "ips": ["127.0.0.1"], "rdma": [null, "mlxnode_test_dev"]},
        {"ssh": "b", "ips": ["127.0.0.1"], "rdma": ["mlxnode_test_dev", null]}]"#;

    /// Runs `open` (or `open_with(lib)`) on every rank of `config`; each
    /// rank's backend, or error; its collectives must work (an all-reduce).
    fn open_all(
        config: &str,
        lib: Option<&'static ibverbs::Library>,
    ) -> Vec<Result<Backend, CollectiveError>> {
        let config = PodConfig::parse(config).unwrap();
        let n = config.size();
        let handles: Vec<_> = tcp_mesh(n, TcpOptions::default())
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let config = config.clone();
                std::thread::spawn(move || {
                    let opts = TcpOptions::default();
                    let (mut comm, backend) = match lib {
                        Some(lib) => open_with(&config, rank, t, &opts, Ok(lib))?,
                        None => open(&config, rank, t, &opts)?,
                    };
                    let mut v = [rank as f32 + 1.0; 3];
                    crate::collectives::all_reduce(comm.as_mut(), &mut v)?;
                    assert_eq!(v, [(n * (n + 1) / 2) as f32; 3]);
                    Ok(backend)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// No RDMA here (no library, or no device): a matrix alone falls back
    /// to TCP on every rank and the pod works; `backend: "jaccl"` fails on
    /// every rank with the typed reason; no matrix is plain TCP.
    #[test]
    fn rdma_falls_back_to_tcp_unless_the_hostfile_requires_it() {
        let plain = r#"[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]"#;
        for r in open_all(plain, None) {
            assert_eq!(r.unwrap(), Backend::Tcp);
        }
        for r in open_all(CABLED, None) {
            assert_eq!(r.unwrap(), Backend::Tcp);
        }
        let required = format!(r#"{{"backend": "jaccl", "hosts": {CABLED}}}"#);
        for r in open_all(&required, None) {
            let err = r.unwrap_err();
            assert!(
                matches!(
                    &err,
                    CollectiveError::Rdma(
                        ibverbs::RdmaError::LibraryNotFound { .. }
                            | ibverbs::RdmaError::NoSuchDevice { .. }
                    )
                ),
                "{err}"
            );
        }
    }

    /// With a device that opens (the in-process fake provider), a cabled
    /// pod's data plane is RDMA on every rank and its collectives work.
    #[test]
    fn a_cabled_pod_runs_on_rdma() {
        let config = r#"[{"ssh": "a", "ips": ["127.0.0.1"], "rdma": [null, "fake0", "fake0"]},
            {"ssh": "b", "ips": ["127.0.0.1"], "rdma": ["fake0", null, "fake0"]},
            {"ssh": "c", "ips": ["127.0.0.1"], "rdma": ["fake0", "fake0", null]}]"#;
        for r in open_all(config, Some(ibverbs::fake::library())) {
            assert_eq!(r.unwrap(), Backend::Rdma);
        }
        // Two cables per pair (a list of devices): striped, still RDMA; a
        // second cable whose port is down leaves one lane, still RDMA.
        for second in ["fake1", "fake_down"] {
            let config = format!(
                r#"[{{"ssh": "a", "ips": ["127.0.0.1"], "rdma": [null, ["fake0", "{second}"]]}},
                {{"ssh": "b", "ips": ["127.0.0.1"], "rdma": [["fake0", "{second}"], null]}}]"#
            );
            for r in open_all(&config, Some(ibverbs::fake::library())) {
                assert_eq!(r.unwrap(), Backend::Rdma, "second cable {second}");
            }
        }
    }
}
