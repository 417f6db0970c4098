//! `mlx-node doctor`: what RDMA devices this machine has, whether their ports
//! are up, and whether that matches the pod config's cabling.
//!
//! The parsers are pure functions over the text of `ibv_devices` and
//! `ibv_devinfo` (rdma-core's tools; macOS 26.2+ ships the same commands for
//! RDMA over Thunderbolt), so they are tested on recorded output.
//!
//! # Failure
//! [`DoctorError`] for output that is not what the tools print; cabling
//! problems are findings ([`Finding`]), not errors.

use std::collections::BTreeSet;

use super::hostfile::{DeviceMatrix, PodConfigError};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DoctorError {
    #[error("ibv_devices output has no device table header")]
    NoDeviceTable,
    #[error("ibv_devinfo output line {line}: {reason}")]
    DevInfo { line: usize, reason: String },
}

/// One device from `ibv_devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub node_guid: String,
}

/// Parses `ibv_devices`: a header (`device  node GUID`), a dashed rule, then
/// one `name guid` line per device. No devices is an empty list.
pub fn parse_ibv_devices(text: &str) -> Result<Vec<Device>, DoctorError> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let header = lines.next().ok_or(DoctorError::NoDeviceTable)?;
    if !header.starts_with("device") {
        return Err(DoctorError::NoDeviceTable);
    }
    Ok(lines
        .filter(|l| !l.starts_with('-'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            Some(Device {
                name: parts.next()?.to_string(),
                node_guid: parts.next().unwrap_or("").to_string(),
            })
        })
        .collect())
}

/// One port of a device from `ibv_devinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    pub number: u32,
    /// `PORT_ACTIVE`, `PORT_DOWN`, ...
    pub state: String,
    pub active_mtu: Option<u32>,
    pub link_layer: Option<String>,
}

/// One device from `ibv_devinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevInfo {
    pub name: String,
    pub transport: Option<String>,
    pub ports: Vec<Port>,
}

impl DevInfo {
    pub fn is_active(&self) -> bool {
        self.ports.iter().any(|p| p.state == "PORT_ACTIVE")
    }
}

/// Parses `ibv_devinfo`: blocks starting `hca_id: <name>`, `key: value`
/// lines, and per port `port: <n>` followed by its own keys.
pub fn parse_ibv_devinfo(text: &str) -> Result<Vec<DevInfo>, DoctorError> {
    let mut out: Vec<DevInfo> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        let first_word = |v: &str| v.split_whitespace().next().unwrap_or("").to_string();
        let err = |reason: &str| DoctorError::DevInfo {
            line: i + 1,
            reason: reason.to_string(),
        };
        match key {
            "hca_id" => out.push(DevInfo {
                name: value.to_string(),
                transport: None,
                ports: Vec::new(),
            }),
            "transport" => {
                out.last_mut()
                    .ok_or_else(|| err("transport before any hca_id"))?
                    .transport = Some(value.to_string());
            }
            "port" => {
                let number = value
                    .parse()
                    .map_err(|_| err("port number is not a number"))?;
                out.last_mut()
                    .ok_or_else(|| err("port before any hca_id"))?
                    .ports
                    .push(Port {
                        number,
                        state: String::new(),
                        active_mtu: None,
                        link_layer: None,
                    });
            }
            "state" | "active_mtu" | "link_layer" => {
                let port = out
                    .last_mut()
                    .and_then(|d| d.ports.last_mut())
                    .ok_or_else(|| err("port attribute before any port"))?;
                match key {
                    "state" => port.state = first_word(value),
                    "active_mtu" => port.active_mtu = first_word(value).parse().ok(),
                    _ => port.link_layer = Some(value.to_string()),
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// One observation about this rank's links.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// The device towards `peer` exists and its port is up.
    LinkUp { peer: usize, device: String },
    /// The device exists but no port is active (cable out, or peer off).
    LinkDown { peer: usize, device: String },
    /// This machine has RDMA devices the config does not use.
    Unused { device: String },
}

/// Checks rank `rank`'s row of the device matrix against this machine's
/// devices: every named device must exist ([`PodConfigError::UnknownDevice`]
/// otherwise); each link is up or down by its port state.
pub fn check_cabling(
    devices: &DeviceMatrix,
    rank: usize,
    info: &[DevInfo],
) -> Result<Vec<Finding>, PodConfigError> {
    let names: BTreeSet<String> = info.iter().map(|d| d.name.clone()).collect();
    devices.check_devices(rank, &names)?;
    let mut used = BTreeSet::new();
    let mut findings = Vec::new();
    for (peer, devs) in devices.rows[rank].iter().enumerate() {
        for device in devs {
            used.insert(device.clone());
            let up = info.iter().any(|d| &d.name == device && d.is_active());
            findings.push(if up {
                Finding::LinkUp {
                    peer,
                    device: device.clone(),
                }
            } else {
                Finding::LinkDown {
                    peer,
                    device: device.clone(),
                }
            });
        }
    }
    findings.extend(
        names
            .difference(&used)
            .map(|d| Finding::Unused { device: d.clone() }),
    );
    Ok(findings)
}

/// The doctor's report for rank `rank` of the pod config `config` (JSON
/// text), given `ibv_devinfo`'s output (`None`: the tool is absent), as lines
/// to print. Errors are the config's own problems.
pub fn report(
    config: &str,
    rank: usize,
    devinfo: Option<&str>,
) -> Result<Vec<String>, DoctorReportError> {
    let cfg = super::hostfile::PodConfig::parse(config)?;
    if rank >= cfg.size() {
        return Err(PodConfigError::RankOutOfRange {
            rank,
            hosts: cfg.size(),
        }
        .into());
    }
    let mut lines = vec![format!(
        "pod of {} (this is rank {rank}, {}), backend {:?}",
        cfg.size(),
        cfg.hosts[rank].ssh,
        cfg.backend
    )];
    match cfg.validate() {
        Ok(()) => lines.push("config: valid".into()),
        Err(e) => lines.push(format!("config: {e}")),
    }
    if !cfg.has_rdma() {
        lines.push("no rdma matrix: the pod uses TCP (pipeline parallel)".into());
        return Ok(lines);
    }
    let Some(text) = devinfo else {
        lines.push("ibv_devinfo is not available: no RDMA on this machine, TCP only".into());
        return Ok(lines);
    };
    let info = parse_ibv_devinfo(text)?;
    for f in check_cabling(&cfg.devices(), rank, &info)? {
        lines.push(match f {
            Finding::LinkUp { peer, device } => format!("link to rank {peer} via {device}: up"),
            Finding::LinkDown { peer, device } => {
                format!("link to rank {peer} via {device}: DOWN (cable or peer)")
            }
            Finding::Unused { device } => format!("{device}: present, not in the pod config"),
        });
    }
    Ok(lines)
}

/// Why the doctor could not judge.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DoctorReportError {
    #[error(transparent)]
    Config(#[from] PodConfigError),
    #[error(transparent)]
    Tools(#[from] DoctorError),
}

#[cfg(test)]
mod tests;
