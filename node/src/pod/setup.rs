//! `mlx-node pod setup`: the Macs of a pod find each other, check their
//! cables, agree on one MLX hostfile and measure each link, the way
//! `mlx.distributed_config --auto-setup` does, without ssh.
//!
//! Every member runs `mlx-node pod setup --members N` at the same time.
//! 1. It reads its Thunderbolt ports: `system_profiler SPThunderboltDataType
//!    -json` gives each port's domain UUID and the UUID of the port at the
//!    other end of its cable; `networksetup -listallhardwareports` maps
//!    "Thunderbolt <n>" to its interface (`en2`); `ibv_devices` says
//!    whether RDMA is enabled (`rdma_en2`, ...). All three are parsed by pure
//!    functions tested on recorded output ([`parse_thunderbolt`],
//!    [`parse_hardware_ports`], [`super::doctor::parse_ibv_devices`]).
//! 2. It advertises itself over mDNS (`_mlx-pod._tcp.local.`, with the
//!    `mdns-sd` crate; on the Thunderbolt bridge or the LAN) and browses
//!    until it has seen `N` members ([`discover`]).
//! 3. Every member computes the same [`plan`] from the same members: ranks
//!    by node id; who is cabled to whom (a port whose far end is another
//!    member's port); RDMA (`jaccl`) when every pair is cabled and every
//!    member has RDMA, a TCP ring over Thunderbolt when the cables form a
//!    ring, else TCP over the LAN; one /30 subnet per cable, numbered as
//!    MLX numbers them; the hostfile and the `ifconfig` lines that give
//!    each Thunderbolt interface its address.
//! 4. It writes the hostfile, forms the pod's data plane over it, and rank 0
//!    measures each link's latency and bandwidth (`super::links`).
//!
//! # Invariants
//! - [`plan`] is a pure function of the member set (order does not
//!   matter), so every member writes the same file.
//!
//! # Failure
//! [`SetupError`]: a member missing after the timeout, a cable missing for
//! the topology asked for (naming the pair), output the parsers do not
//! understand.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

/// The mDNS service type members advertise.
pub const SERVICE: &str = "_mlx-pod._tcp.local.";

/// Why the pod could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    #[error("unexpected system_profiler output: {0}")]
    Thunderbolt(String),
    #[error("no member may be alone: a pod needs at least 2 members, asked for {0}")]
    TooFew(usize),
    #[error("saw {seen} of {want} members after {waited:?}: {names}")]
    Missing {
        seen: usize,
        want: usize,
        waited: Duration,
        names: String,
    },
    #[error("cabling: {0}")]
    Cabling(String),
    #[error("mdns: {0}")]
    Mdns(String),
    #[error("member advert {0:?} is malformed: {1}")]
    Advert(String, String),
    #[error("this member is not in the plan")]
    NotAMember,
    #[error("cannot write {path}: {source}")]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the hostfile: {0}")]
    Hostfile(#[from] super::hostfile::PodConfigError),
    #[error("measuring the links: {0}")]
    Measure(#[from] crate::collectives::CollectiveError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// One Thunderbolt port as `system_profiler` and `networksetup` see it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Port {
    /// The network interface of the port (`en2`).
    pub iface: String,
    /// This port's domain UUID.
    pub uuid: String,
    /// The domain UUID of the port at the other end of its cable.
    pub connected_to: Option<String>,
}

/// A `SPThunderboltDataType` bus: its receptacle tag, UUID and peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TbBus {
    pub tag: String,
    pub uuid: String,
    pub connected_to: Option<String>,
}

/// Parses `system_profiler SPThunderboltDataType -json`: one entry per
/// bus with `domain_uuid_key`, `receptacle_1_tag.receptacle_id_key` and,
/// when cabled to another Mac, an `_items` entry with its own
/// `domain_uuid_key` (entries without a UUID are not ports and are skipped).
pub fn parse_thunderbolt(json: &str) -> Result<Vec<TbBus>, SetupError> {
    let v: Value =
        serde_json::from_str(json).map_err(|e| SetupError::Thunderbolt(e.to_string()))?;
    let buses = v
        .get("SPThunderboltDataType")
        .and_then(Value::as_array)
        .ok_or_else(|| SetupError::Thunderbolt("no SPThunderboltDataType list".into()))?;
    let mut out = Vec::new();
    for b in buses {
        let Some(uuid) = b.get("domain_uuid_key").and_then(Value::as_str) else {
            continue;
        };
        let tag = b
            .get("receptacle_1_tag")
            .and_then(|t| t.get("receptacle_id_key"))
            .and_then(|t| match t {
                Value::String(s) => Some(s.clone()),
                Value::Number(n) => Some(n.to_string()),
                _ => None,
            })
            .ok_or_else(|| SetupError::Thunderbolt(format!("bus {uuid} has no receptacle tag")))?;
        let connected_to = b
            .get("_items")
            .and_then(Value::as_array)
            .and_then(|items| {
                items
                    .iter()
                    .find_map(|i| i.get("domain_uuid_key").and_then(Value::as_str))
            })
            .map(str::to_owned);
        out.push(TbBus {
            tag,
            uuid: uuid.to_owned(),
            connected_to,
        });
    }
    Ok(out)
}

/// Parses `networksetup -listallhardwareports`: `Hardware Port: <name>`
/// followed by `Device: <iface>`.
pub fn parse_hardware_ports(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut name: Option<String> = None;
    for l in text.lines().map(str::trim) {
        if let Some(n) = l.strip_prefix("Hardware Port:") {
            name = Some(n.trim().to_owned());
        } else if let Some(d) = l.strip_prefix("Device:") {
            if let Some(n) = name.take() {
                out.insert(n, d.trim().to_owned());
            }
        }
    }
    out
}

/// The ports of a Mac: its buses joined to their interfaces ("Thunderbolt
/// <tag>"); a bus without an interface is left out.
pub fn ports(buses: &[TbBus], hardware: &BTreeMap<String, String>) -> Vec<Port> {
    let mut out: Vec<Port> = buses
        .iter()
        .filter_map(|b| {
            Some(Port {
                iface: hardware.get(&format!("Thunderbolt {}", b.tag))?.clone(),
                uuid: b.uuid.clone(),
                connected_to: b.connected_to.clone(),
            })
        })
        .collect();
    out.sort();
    out
}

/// One Mac taking part in the set-up.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    /// Hex node id: ranks follow it.
    pub node_id: String,
    /// Host name (`ssh` in the hostfile).
    pub host: String,
    /// Its address on the LAN (TCP fallback, and the pod's side channel when
    /// there is no Thunderbolt ring).
    pub lan_ip: String,
    /// Whether `ibv_devices` lists RDMA devices (RDMA enabled in recovery).
    pub rdma: bool,
    pub ports: Vec<Port>,
}

impl Member {
    /// The mDNS TXT properties: `id`, `host`, `ip`, `rdma` and one
    /// `p<i>=iface,uuid,peer` per port (each well under 255 bytes).
    pub fn properties(&self) -> Vec<(String, String)> {
        let mut p = vec![
            ("id".to_owned(), self.node_id.clone()),
            ("host".to_owned(), self.host.clone()),
            ("ip".to_owned(), self.lan_ip.clone()),
            (
                "rdma".to_owned(),
                if self.rdma { "1" } else { "0" }.to_owned(),
            ),
        ];
        for (i, port) in self.ports.iter().enumerate() {
            p.push((
                format!("p{i}"),
                format!(
                    "{},{},{}",
                    port.iface,
                    port.uuid,
                    port.connected_to.as_deref().unwrap_or("")
                ),
            ));
        }
        p
    }

    /// Reads a member back from its TXT properties.
    pub fn from_properties(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, SetupError> {
        let need = |k: &str| {
            get(k)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| SetupError::Advert(k.to_owned(), "missing".into()))
        };
        let mut ports = Vec::new();
        for i in 0.. {
            let Some(v) = get(&format!("p{i}")) else {
                break;
            };
            let parts: Vec<&str> = v.split(',').collect();
            let [iface, uuid, peer] = parts[..] else {
                return Err(SetupError::Advert(format!("p{i}"), v.clone()));
            };
            if iface.is_empty() || uuid.is_empty() {
                return Err(SetupError::Advert(format!("p{i}"), v.clone()));
            }
            ports.push(Port {
                iface: iface.to_owned(),
                uuid: uuid.to_owned(),
                connected_to: (!peer.is_empty()).then(|| peer.to_owned()),
            });
            if i >= 64 {
                break;
            }
        }
        Ok(Self {
            node_id: need("id")?,
            host: need("host")?,
            lan_ip: need("ip")?,
            rdma: get("rdma").as_deref() == Some("1"),
            ports,
        })
    }
}

/// How the pod's members talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Topology {
    /// Every pair cabled, RDMA everywhere: MLX's `jaccl` backend.
    RdmaMesh,
    /// The cables form a ring: MLX's `ring` backend over Thunderbolt.
    ThunderboltRing,
    /// No usable Thunderbolt topology: a TCP ring over the LAN.
    Lan,
}

/// What every member writes: the hostfile, and per rank the interface
/// addresses to configure.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub members: Vec<Member>,
    pub topology: Topology,
    /// `links[i][j]`: the cables from rank i to rank j.
    pub links: Vec<Vec<usize>>,
    /// MLX hostfile JSON.
    pub hostfile: Value,
    /// Per rank: `(iface, ip)` to set with netmask 255.255.255.252, and the
    /// peer address routed over it.
    pub interfaces: Vec<Vec<(String, String, String)>>,
}

/// Finds a ring through every member in `links`, starting at rank 0.
fn find_ring(links: &[Vec<usize>]) -> Option<Vec<usize>> {
    let n = links.len();
    fn go(links: &[Vec<usize>], path: &mut Vec<usize>, used: &mut Vec<bool>) -> bool {
        let n = links.len();
        let last = path[path.len() - 1];
        if path.len() == n {
            return links[last][path[0]] > 0;
        }
        for j in 0..n {
            if !used[j] && links[last][j] > 0 {
                used[j] = true;
                path.push(j);
                if go(links, path, used) {
                    return true;
                }
                path.pop();
                used[j] = false;
            }
        }
        false
    }
    if n < 2 {
        return None;
    }
    let mut path = vec![0];
    let mut used = vec![false; n];
    used[0] = true;
    go(links, &mut path, &mut used).then_some(path)
}

/// The plan for `members` (see the module header). `want_rdma`: fail
/// unless the pod can use RDMA (every pair cabled, RDMA on every member).
pub fn plan(members: &[Member], want_rdma: bool) -> Result<Plan, SetupError> {
    let mut members = members.to_vec();
    members.sort();
    members.dedup_by(|a, b| a.node_id == b.node_id);
    let n = members.len();
    if n < 2 {
        return Err(SetupError::TooFew(n));
    }
    // Which member and port every UUID belongs to.
    let mut owner = BTreeMap::new();
    for (i, m) in members.iter().enumerate() {
        for (p, port) in m.ports.iter().enumerate() {
            owner.insert(port.uuid.clone(), (i, p));
        }
    }
    // One subnet per cable, in MLX's order: ranks, then ports.
    let mut links = vec![vec![0usize; n]; n];
    let mut cable_ips: BTreeMap<(usize, usize), Vec<(String, String)>> = BTreeMap::new();
    let mut assigned = BTreeSet::new();
    let (mut ip0, mut ip1) = (0u32, 0u32);
    for (i, m) in members.iter().enumerate() {
        for (p, port) in m.ports.iter().enumerate() {
            let Some(&(j, q)) = port.connected_to.as_ref().and_then(|u| owner.get(u)) else {
                continue;
            };
            if j == i || assigned.contains(&(i, p)) {
                continue;
            }
            links[i][j] += 1;
            links[j][i] += 1;
            let (a, b) = (
                format!("192.168.{ip0}.{}", ip1 + 1),
                format!("192.168.{ip0}.{}", ip1 + 2),
            );
            cable_ips
                .entry((i, j))
                .or_default()
                .push((port.iface.clone(), a));
            cable_ips
                .entry((j, i))
                .or_default()
                .push((members[j].ports[q].iface.clone(), b));
            assigned.insert((i, p));
            assigned.insert((j, q));
            ip1 += 4;
            if ip1 > 252 {
                ip1 = 0;
                ip0 += 1;
            }
        }
    }
    let mesh = (0..n).all(|i| (0..n).all(|j| i == j || links[i][j] > 0));
    let all_rdma = members.iter().all(|m| m.rdma);
    let ring = find_ring(&links);
    let topology = if mesh && all_rdma {
        Topology::RdmaMesh
    } else if want_rdma {
        let why = if !mesh {
            let (i, j) = (0..n)
                .flat_map(|i| (0..n).map(move |j| (i, j)))
                .find(|&(i, j)| i != j && links[i][j] == 0)
                .unwrap_or((0, 1));
            format!(
                "RDMA needs a cable between every pair: {} and {} are not cabled",
                members[i].host, members[j].host
            )
        } else {
            let off: Vec<&str> = members
                .iter()
                .filter(|m| !m.rdma)
                .map(|m| m.host.as_str())
                .collect();
            format!(
                "RDMA is not enabled on {} (run `rdma_ctl enable` in macOS Recovery)",
                off.join(", ")
            )
        };
        return Err(SetupError::Cabling(why));
    } else if ring.is_some() {
        Topology::ThunderboltRing
    } else {
        Topology::Lan
    };
    let mut interfaces = vec![Vec::new(); n];
    for (&(i, j), ends) in &cable_ips {
        for (k, (iface, ip)) in ends.iter().enumerate() {
            let peer = &cable_ips[&(j, i)][k].1;
            interfaces[i].push((iface.clone(), ip.clone(), peer.clone()));
        }
    }
    let hosts: Vec<Value> = match topology {
        Topology::RdmaMesh => members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let rdma: Vec<Value> = (0..n)
                    .map(|j| {
                        if i == j {
                            Value::Null
                        } else {
                            Value::String(format!("rdma_{}", cable_ips[&(i, j)][0].0))
                        }
                    })
                    .collect();
                serde_json::json!({"ssh": m.host, "ips": [m.lan_ip], "rdma": rdma})
            })
            .collect(),
        Topology::ThunderboltRing => {
            // Ranks follow the ring; a rank listens on the address of its
            // cable from the previous rank (as MLX's ring hostfile).
            let ring = ring.unwrap_or_default();
            let order: Vec<Member> = ring.iter().map(|&r| members[r].clone()).collect();
            let mut hosts = Vec::new();
            for (k, &node) in ring.iter().enumerate() {
                let prev = ring[(k + n - 1) % n];
                let ips: Vec<&str> = cable_ips[&(node, prev)]
                    .iter()
                    .map(|(_, ip)| ip.as_str())
                    .collect();
                hosts.push(serde_json::json!({"ssh": members[node].host, "ips": ips, "rdma": []}));
            }
            let interfaces = ring.iter().map(|&r| interfaces[r].clone()).collect();
            let links = ring
                .iter()
                .map(|&a| ring.iter().map(|&b| links[a][b]).collect())
                .collect();
            return Ok(Plan {
                members: order,
                topology,
                links,
                hostfile: serde_json::json!({"backend": "ring", "hosts": hosts}),
                interfaces,
            });
        }
        Topology::Lan => members
            .iter()
            .map(|m| serde_json::json!({"ssh": m.host, "ips": [m.lan_ip]}))
            .collect(),
    };
    let backend = match topology {
        Topology::RdmaMesh => "jaccl",
        _ => "ring",
    };
    Ok(Plan {
        members,
        topology,
        links,
        hostfile: serde_json::json!({"backend": backend, "hosts": hosts}),
        interfaces,
    })
}

impl Plan {
    /// This member's rank.
    pub fn rank_of(&self, node_id: &str) -> Option<usize> {
        self.members.iter().position(|m| m.node_id == node_id)
    }

    /// The commands that give rank `rank`'s Thunderbolt interfaces their
    /// addresses (as `mlx.distributed_config` prints them; run with sudo).
    pub fn commands(&self, rank: usize) -> Vec<String> {
        let mut out = Vec::new();
        if self.topology == Topology::Lan {
            return out;
        }
        out.push("ifconfig bridge0 down".to_owned());
        for (iface, ip, peer) in &self.interfaces[rank] {
            out.push(format!(
                "ifconfig {iface} inet {ip} netmask 255.255.255.252"
            ));
            out.push(format!("route change {peer} -interface {iface}"));
        }
        out
    }
}

/// The mDNS daemon advertising this member; dropping it stops the advert.
/// A member keeps advertising after it has seen everyone, until the others
/// have seen it too (see [`run`]).
pub struct Advert(mdns_sd::ServiceDaemon);

impl Drop for Advert {
    fn drop(&mut self) {
        let _ = self.0.shutdown();
    }
}

/// Advertises `me` over mDNS and browses until `want` members (`me`
/// included) are known or `timeout` passes; the advert goes on while the
/// returned [`Advert`] lives.
pub fn discover(
    me: &Member,
    port: u16,
    want: usize,
    timeout: Duration,
) -> Result<(Vec<Member>, Advert), SetupError> {
    use mdns_sd::{ServiceDaemon, ServiceEvent, ServiceInfo};
    let mdns = |e: mdns_sd::Error| SetupError::Mdns(e.to_string());
    let daemon = ServiceDaemon::new().map_err(mdns)?;
    let instance = format!("mlx-{}", me.node_id.get(..16).unwrap_or(&me.node_id));
    let host = format!("{instance}.local.");
    let props: Vec<(String, String)> = me.properties();
    let info = ServiceInfo::new(
        SERVICE,
        &instance,
        &host,
        me.lan_ip.as_str(),
        port,
        &props[..],
    )
    .map_err(mdns)?;
    daemon.register(info).map_err(mdns)?;
    let events = daemon.browse(SERVICE).map_err(mdns)?;
    let mut found: BTreeMap<String, Member> = BTreeMap::new();
    found.insert(me.node_id.clone(), me.clone());
    let deadline = Instant::now() + timeout;
    while found.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match events.recv_timeout(left) {
            Ok(ServiceEvent::ServiceResolved(info)) => {
                let get = |k: &str| info.get_property_val_str(k).map(str::to_owned);
                match Member::from_properties(&get) {
                    Ok(m) => {
                        if !found.contains_key(&m.node_id) {
                            tracing::info!(host = %m.host, ip = %m.lan_ip, "pod member found");
                        }
                        found.insert(m.node_id.clone(), m);
                    }
                    Err(e) => tracing::warn!(error = %e, "ignoring a malformed pod advert"),
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = daemon.stop_browse(SERVICE);
    let advert = Advert(daemon);
    let members: Vec<Member> = found.into_values().collect();
    if members.len() < want {
        return Err(SetupError::Missing {
            seen: members.len(),
            want,
            waited: timeout,
            names: members
                .iter()
                .map(|m| m.host.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok((members, advert))
}

/// How long a member that measures nothing keeps advertising after it has
/// seen every member (the others may still be browsing).
const LINGER: Duration = Duration::from_secs(10);

/// What `mlx-node pod setup` does.
#[derive(Debug, Clone)]
pub struct SetupArgs {
    pub me: Member,
    /// Members the pod has (this one included).
    pub members: usize,
    pub timeout: Duration,
    /// Rank r's data plane listens on `port + r` (and the mDNS advert names `port`).
    pub port: u16,
    /// Where the hostfile goes.
    pub output: std::path::PathBuf,
    /// Refuse a pod that cannot use RDMA.
    pub require_rdma: bool,
    /// Run this Mac's `ifconfig` lines (with `sudo -n`).
    pub apply: bool,
    /// Form the data plane over the new hostfile and measure every link
    /// (when its addresses are usable: the LAN, or after `apply`).
    pub measure: bool,
}

/// Discovers, plans, writes the hostfile, applies and measures; returns
/// the lines to show the owner.
pub fn run(args: &SetupArgs) -> Result<Vec<String>, SetupError> {
    let (members, advert) = discover(&args.me, args.port, args.members, args.timeout)?;
    let plan = plan(&members, args.require_rdma)?;
    let rank = plan
        .rank_of(&args.me.node_id)
        .ok_or(SetupError::NotAMember)?;
    let mut lines = vec![format!(
        "pod of {}: {:?}; this Mac ({}) is rank {rank}",
        plan.members.len(),
        plan.topology,
        args.me.host
    )];
    for (i, row) in plan.links.iter().enumerate() {
        for (j, &n) in row.iter().enumerate().skip(i + 1) {
            lines.push(format!(
                "  {} - {}: {}",
                plan.members[i].host,
                plan.members[j].host,
                match n {
                    0 => "no cable".to_owned(),
                    1 => "1 cable".to_owned(),
                    n => format!("{n} cables"),
                }
            ));
        }
    }
    let text = serde_json::to_string_pretty(&plan.hostfile).unwrap_or_default();
    std::fs::write(&args.output, text + "\n").map_err(|source| SetupError::Write {
        path: args.output.clone(),
        source,
    })?;
    lines.push(format!("wrote {}", args.output.display()));
    let commands = plan.commands(rank);
    if !commands.is_empty() {
        if args.apply {
            for c in &commands {
                let mut words = c.split_whitespace();
                let status = std::process::Command::new("sudo")
                    .arg("-n")
                    .args(words.by_ref())
                    .status();
                lines.push(match status {
                    Ok(s) if s.success() => format!("ran: sudo {c}"),
                    Ok(s) => format!("FAILED ({s}): sudo {c}"),
                    Err(e) => format!("FAILED ({e}): sudo {c}"),
                });
            }
        } else {
            lines.push(
                "give this Mac's Thunderbolt interfaces their addresses (or pass --apply):".into(),
            );
            lines.extend(commands.iter().map(|c| format!("  sudo {c}")));
        }
    }
    if !(args.measure && (plan.topology == Topology::Lan || args.apply)) {
        // Nothing synchronises the members after this: keep answering a
        // while for those still browsing.
        std::thread::sleep(LINGER.min(args.timeout));
        drop(advert);
        return Ok(lines);
    }
    let cfg = super::hostfile::PodConfig::parse(&plan.hostfile.to_string())?;
    let addrs = super::links::addresses(&cfg, args.port)?;
    let listener =
        std::net::TcpListener::bind(addrs[rank]).map_err(|source| SetupError::Listen {
            addr: addrs[rank],
            source,
        })?;
    let tcp = crate::collectives::tcp::TcpTransport::connect(
        rank,
        listener,
        &addrs,
        crate::collectives::tcp::TcpOptions {
            // Members finish discovering at different times.
            connect_timeout: args.timeout,
            ..Default::default()
        },
    )?;
    let mut comm = crate::collectives::Group::new(tcp, crate::collectives::GroupOptions::default());
    for f in super::links::measure_links(&mut comm, 20, 8 << 20)? {
        lines.push(format!(
            "link rank 0 - rank {}: latency {:.0} us, bandwidth {:.2} GB/s",
            f.peer,
            f.latency.as_secs_f64() * 1e6,
            f.bandwidth / 1e9
        ));
    }
    // Every member formed the data plane: all have seen each other.
    drop(advert);
    Ok(lines)
}

/// This machine's host name (`hostname`), or "mac" when it cannot be read.
pub fn host_name() -> String {
    std::process::Command::new("hostname")
        .arg("-s")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "mac".into())
}

/// The address this machine reaches the LAN from (the source address of a
/// route to a public address; nothing is sent), else loopback.
pub fn lan_ip() -> String {
    std::net::UdpSocket::bind(("0.0.0.0", 0))
        .and_then(|s| {
            s.connect(("192.0.2.1", 9))?;
            s.local_addr()
        })
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "127.0.0.1".into())
}

/// This Mac as a member: its ports and RDMA devices (macOS; elsewhere no
/// ports and no RDMA), its host name and LAN address.
pub fn this_member(node_id: &str, host: &str, lan_ip: &str) -> Member {
    #[cfg(target_os = "macos")]
    let (ports, rdma) = {
        let out = |cmd: &str, args: &[&str]| {
            std::process::Command::new(cmd)
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        };
        let buses = out("system_profiler", &["SPThunderboltDataType", "-json"])
            .and_then(|t| parse_thunderbolt(&t).ok())
            .unwrap_or_default();
        let hw = out("networksetup", &["-listallhardwareports"])
            .map(|t| parse_hardware_ports(&t))
            .unwrap_or_default();
        let rdma = out("ibv_devices", &[])
            .and_then(|t| super::doctor::parse_ibv_devices(&t).ok())
            .is_some_and(|d| !d.is_empty());
        (ports(&buses, &hw), rdma)
    };
    #[cfg(not(target_os = "macos"))]
    let (ports, rdma) = (Vec::new(), false);
    Member {
        node_id: node_id.to_owned(),
        host: host.to_owned(),
        lan_ip: lan_ip.to_owned(),
        rdma,
        ports,
    }
}

#[cfg(test)]
mod tests;
