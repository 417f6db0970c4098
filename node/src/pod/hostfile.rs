//! The pod's membership file: MLX's hostfile JSON, and JACCL's bare device file.
//!
//! MLX (`mlx.launch --hostfile`, written by `mlx.distributed_config`) accepts
//! either a list of hosts or an object with `backend`, `envs` and `hosts`:
//! ```json
//! {"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"],
//!  "hosts": [{"ssh": "m1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3"]},
//!            {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", null]}]}
//! ```
//! Host `i`'s `rdma[j]` names the device on host `i` whose cable reaches
//! host `j`: a string, a list of strings (several cables between the same
//! pair), or `null` (no cable; always on the diagonal). JACCL's own device
//! file (`MLX_IBV_DEVICES`) is that matrix alone. An existing MLX cluster
//! config works here unchanged; unknown keys are ignored as MLX ignores them.
//!
//! A host may name its member's node id (`"node_id": "<64 hex digits>"`,
//! what `mlx-node` logs at start as `node_id`). When every host does, the
//! members prove their node keys on the data plane ([`PodConfig::peer_auth`],
//! `collectives::tcp`); when none does, the data plane is not authenticated.
//!
//! # Invariants
//! - After [`PodConfig::parse`]: at least one host; every host has an `ssh`
//!   name; a host's `rdma` row is either empty (TCP-only pod) or has exactly
//!   one entry per host, `null` on the diagonal, no empty device names.
//!
//! # Failure
//! Every rejection is a [`PodConfigError`] naming the rank(s) or device.

use std::collections::BTreeSet;
use std::sync::Arc;

use ed25519_dalek::VerifyingKey;
use serde::Deserialize;

use crate::collectives::tcp::PeerAuth;
use crate::identity::Identity;

/// A node id as the hostfile writes it: 64 hex digits of a valid key.
fn parse_node_id(text: &str) -> Option<VerifyingKey> {
    let bytes: [u8; 32] = hex::decode(text.trim()).ok()?.try_into().ok()?;
    VerifyingKey::from_bytes(&bytes).ok()
}

/// Why a pod config is rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PodConfigError {
    #[error("pod config is not valid JSON of the expected shape: {0}")]
    Json(String),
    #[error("pod config lists no hosts")]
    NoHosts,
    #[error("host {rank} has an empty ssh name")]
    EmptyHostName { rank: usize },
    #[error("rdma row of rank {rank} has {len} entries, the pod has {hosts} hosts")]
    MatrixSize {
        rank: usize,
        len: usize,
        hosts: usize,
    },
    #[error("rank {rank} lists an rdma device to itself (the diagonal must be null)")]
    SelfLink { rank: usize },
    #[error("rank {rank} lists an empty rdma device name")]
    EmptyDevice { rank: usize },
    #[error("rdma mesh incomplete: no device links rank {from} to rank {to}")]
    MeshIncomplete { from: usize, to: usize },
    #[error("rdma ring broken: no device links rank {from} to its ring neighbour {to}")]
    RingBroken { from: usize, to: usize },
    #[error(
        "rdma matrix asymmetric: rank {from} has {forward} cable(s) to rank {to}, \
         rank {to} has {backward} back"
    )]
    Asymmetric {
        from: usize,
        to: usize,
        forward: usize,
        backward: usize,
    },
    #[error("rank {rank} names rdma device {device:?}, which this machine does not have")]
    UnknownDevice { rank: usize, device: String },
    #[error("rank {rank} has no ip address (the {backend} backend needs one)")]
    NoIp { rank: usize, backend: &'static str },
    #[error("rank {rank} is out of range for a pod of {hosts}")]
    RankOutOfRange { rank: usize, hosts: usize },
    #[error("host {rank}'s node_id is not a node id (64 hex digits of an ed25519 public key)")]
    BadNodeId { rank: usize },
    #[error("host {rank} has no node_id while others do: name every member's node id, or none")]
    MissingNodeId { rank: usize },
    #[error("host {rank}'s node_id is {named}, but this node is {actual}")]
    NotThisNode {
        rank: usize,
        named: String,
        actual: String,
    },
}

/// The backend MLX's hostfile asks for (`backend` key); empty means unspecified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodBackend {
    /// TCP ring (MLX `ring`).
    Ring,
    /// RDMA full mesh (MLX `jaccl`).
    Jaccl,
    /// RDMA ring (MLX `jaccl-ring`).
    JacclRing,
    /// Another MLX backend (`mpi`, `nccl`): read, but pods use TCP for it.
    Other,
}

/// One member of the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodHost {
    /// Host name to reach the member by (`ssh` in MLX's file).
    pub ssh: String,
    /// Addresses the member listens on for the pod link.
    pub ips: Vec<String>,
    /// `rdma[j]`: this host's devices whose cables reach rank `j` (empty:
    /// no cable). Empty vector: the file has no RDMA matrix for this host.
    pub rdma: Vec<Vec<String>>,
    /// The member's node key, when the file names it.
    pub node_id: Option<VerifyingKey>,
}

/// A parsed pod config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodConfig {
    pub backend: Option<PodBackend>,
    pub envs: Vec<String>,
    pub hosts: Vec<PodHost>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawFile {
    List(Vec<RawHost>),
    Object {
        #[serde(default)]
        backend: String,
        #[serde(default)]
        envs: Vec<String>,
        hosts: Vec<RawHost>,
    },
}

#[derive(Deserialize)]
struct RawHost {
    ssh: String,
    #[serde(default)]
    ips: Vec<String>,
    #[serde(default)]
    rdma: Vec<RawDevices>,
    #[serde(default)]
    node_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawDevices {
    One(String),
    Many(Vec<String>),
    None(()),
}

impl RawDevices {
    fn into_vec(self) -> Vec<String> {
        match self {
            RawDevices::One(d) => vec![d],
            RawDevices::Many(v) => v,
            RawDevices::None(()) => Vec::new(),
        }
    }
}

fn check_rows(rows: &[Vec<Vec<String>>]) -> Result<(), PodConfigError> {
    let n = rows.len();
    for (rank, row) in rows.iter().enumerate() {
        if row.is_empty() {
            continue;
        }
        if row.len() != n {
            return Err(PodConfigError::MatrixSize {
                rank,
                len: row.len(),
                hosts: n,
            });
        }
        if !row[rank].is_empty() {
            return Err(PodConfigError::SelfLink { rank });
        }
        if row.iter().flatten().any(|d| d.trim().is_empty()) {
            return Err(PodConfigError::EmptyDevice { rank });
        }
    }
    Ok(())
}

impl PodConfig {
    /// Parses MLX's hostfile JSON (list or object form).
    pub fn parse(json: &str) -> Result<PodConfig, PodConfigError> {
        let raw: RawFile =
            serde_json::from_str(json).map_err(|e| PodConfigError::Json(e.to_string()))?;
        let (backend, envs, hosts) = match raw {
            RawFile::List(h) => (String::new(), Vec::new(), h),
            RawFile::Object {
                backend,
                envs,
                hosts,
            } => (backend, envs, hosts),
        };
        if hosts.is_empty() {
            return Err(PodConfigError::NoHosts);
        }
        let backend = match backend.as_str() {
            "" => None,
            "ring" => Some(PodBackend::Ring),
            "jaccl" => Some(PodBackend::Jaccl),
            "jaccl-ring" => Some(PodBackend::JacclRing),
            _ => Some(PodBackend::Other),
        };
        let hosts: Vec<PodHost> = hosts
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                let node_id = match h.node_id {
                    None => None,
                    Some(hex_id) => {
                        Some(parse_node_id(&hex_id).ok_or(PodConfigError::BadNodeId { rank })?)
                    }
                };
                Ok(PodHost {
                    ssh: h.ssh,
                    ips: h.ips,
                    rdma: h.rdma.into_iter().map(RawDevices::into_vec).collect(),
                    node_id,
                })
            })
            .collect::<Result<_, PodConfigError>>()?;
        if hosts.iter().any(|h| h.node_id.is_some()) {
            if let Some(rank) = hosts.iter().position(|h| h.node_id.is_none()) {
                return Err(PodConfigError::MissingNodeId { rank });
            }
        }
        if let Some(rank) = hosts.iter().position(|h| h.ssh.trim().is_empty()) {
            return Err(PodConfigError::EmptyHostName { rank });
        }
        let rows: Vec<_> = hosts.iter().map(|h| h.rdma.clone()).collect();
        check_rows(&rows)?;
        Ok(PodConfig {
            backend,
            envs,
            hosts,
        })
    }

    /// How the members prove who they are on the data plane: by their node
    /// keys when the file names every member's ([`PeerAuth::NodeKeys`]; this
    /// node, `identity`, must be the one named for `rank`), else not at all.
    pub fn peer_auth(
        &self,
        rank: usize,
        identity: &Arc<Identity>,
    ) -> Result<PeerAuth, PodConfigError> {
        let Some(keys) = self
            .hosts
            .iter()
            .map(|h| h.node_id)
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(PeerAuth::Open);
        };
        let hosts = self.size();
        let named = keys
            .get(rank)
            .ok_or(PodConfigError::RankOutOfRange { rank, hosts })?;
        let actual = identity.signing_key().verifying_key();
        if *named != actual {
            return Err(PodConfigError::NotThisNode {
                rank,
                named: hex::encode(named.to_bytes()),
                actual: hex::encode(actual.to_bytes()),
            });
        }
        Ok(PeerAuth::NodeKeys {
            identity: Arc::clone(identity),
            keys,
        })
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.hosts.len()
    }

    /// True when every host has an RDMA row.
    pub fn has_rdma(&self) -> bool {
        self.hosts.iter().all(|h| !h.rdma.is_empty())
    }

    /// The device matrix (`[i][j]`: host i's devices towards j).
    pub fn devices(&self) -> DeviceMatrix {
        DeviceMatrix {
            rows: self.hosts.iter().map(|h| h.rdma.clone()).collect(),
        }
    }

    /// The backend's requirements: RDMA mesh for `jaccl`, RDMA ring for
    /// `jaccl-ring`, one ip per host for the TCP ring (and rank 0's ip for
    /// JACCL's side channel).
    pub fn validate(&self) -> Result<(), PodConfigError> {
        match self.backend {
            Some(PodBackend::Jaccl) => {
                self.devices().check_mesh()?;
                self.require_ip(0, "jaccl")
            }
            Some(PodBackend::JacclRing) => {
                self.devices().check_ring()?;
                self.require_ip(0, "jaccl-ring")
            }
            _ => {
                if self.has_rdma() {
                    self.devices().check_symmetric()?;
                }
                (0..self.size()).try_for_each(|r| self.require_ip(r, "ring"))
            }
        }
    }

    fn require_ip(&self, rank: usize, backend: &'static str) -> Result<(), PodConfigError> {
        if self.hosts[rank].ips.is_empty() {
            return Err(PodConfigError::NoIp { rank, backend });
        }
        Ok(())
    }
}

/// JACCL's device matrix: `rows[i][j]` are rank i's devices towards rank j.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMatrix {
    pub rows: Vec<Vec<Vec<String>>>,
}

impl DeviceMatrix {
    /// Parses JACCL's bare device file (`MLX_IBV_DEVICES`).
    pub fn parse(json: &str) -> Result<DeviceMatrix, PodConfigError> {
        let raw: Vec<Vec<RawDevices>> =
            serde_json::from_str(json).map_err(|e| PodConfigError::Json(e.to_string()))?;
        if raw.is_empty() {
            return Err(PodConfigError::NoHosts);
        }
        let rows: Vec<Vec<Vec<String>>> = raw
            .into_iter()
            .map(|r| r.into_iter().map(RawDevices::into_vec).collect())
            .collect();
        if let Some((rank, row)) = rows.iter().enumerate().find(|(_, r)| r.is_empty()) {
            return Err(PodConfigError::MatrixSize {
                rank,
                len: row.len(),
                hosts: rows.len(),
            });
        }
        check_rows(&rows)?;
        Ok(DeviceMatrix { rows })
    }

    pub fn size(&self) -> usize {
        self.rows.len()
    }

    fn cables(&self, i: usize, j: usize) -> usize {
        self.rows[i].get(j).map_or(0, Vec::len)
    }

    /// Every link listed in one direction is listed in the other with the
    /// same number of cables.
    pub fn check_symmetric(&self) -> Result<(), PodConfigError> {
        let n = self.size();
        for i in 0..n {
            for j in i + 1..n {
                let (forward, backward) = (self.cables(i, j), self.cables(j, i));
                if forward != backward {
                    return Err(PodConfigError::Asymmetric {
                        from: i,
                        to: j,
                        forward,
                        backward,
                    });
                }
            }
        }
        Ok(())
    }

    /// Every pair of ranks is cabled (JACCL's full mesh).
    pub fn check_mesh(&self) -> Result<(), PodConfigError> {
        let n = self.size();
        for i in 0..n {
            for j in 0..n {
                if i != j && self.cables(i, j) == 0 {
                    return Err(PodConfigError::MeshIncomplete { from: i, to: j });
                }
            }
        }
        self.check_symmetric()
    }

    /// Every rank is cabled to its ring neighbours `i - 1` and `i + 1`.
    pub fn check_ring(&self) -> Result<(), PodConfigError> {
        let n = self.size();
        for i in 0..n {
            for j in [(i + n - 1) % n, (i + 1) % n] {
                if i != j && self.cables(i, j) == 0 {
                    return Err(PodConfigError::RingBroken { from: i, to: j });
                }
            }
        }
        self.check_symmetric()
    }

    /// Rank `rank`'s device towards each member (`None` for itself; the
    /// first cable's device where a pair has several), for the RDMA data
    /// plane, which needs a full mesh.
    pub fn peer_devices(&self, rank: usize) -> Result<Vec<Option<String>>, PodConfigError> {
        let row = self.rows.get(rank).ok_or(PodConfigError::RankOutOfRange {
            rank,
            hosts: self.size(),
        })?;
        self.check_mesh()?;
        Ok((0..self.size())
            .map(|p| {
                if p == rank {
                    None
                } else {
                    row[p].first().cloned()
                }
            })
            .collect())
    }

    /// Every device `rank` names exists on this machine (`available`, e.g.
    /// from `ibv_devices`).
    pub fn check_devices(
        &self,
        rank: usize,
        available: &BTreeSet<String>,
    ) -> Result<(), PodConfigError> {
        let row = self.rows.get(rank).ok_or(PodConfigError::RankOutOfRange {
            rank,
            hosts: self.size(),
        })?;
        for device in row.iter().flatten() {
            if !available.contains(device) {
                return Err(PodConfigError::UnknownDevice {
                    rank,
                    device: device.clone(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
