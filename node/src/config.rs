//! The node's configuration, layered: built-in defaults, then a TOML file,
//! then environment variables `MLX_NODE__KEY` (nested: `MLX_NODE__LOCATION__PLACE`),
//! then command-line flags. Each layer overrides only the keys it sets: the
//! layers are merged as TOML tables and the result is read into a
//! [`NodeConfig`], the way the coordinator reads its own (`mlxnet_proto::env`).
//!
//! The environment is read through [`NodeConfig::load`]'s iterator argument,
//! never with `std::env` here, so tests pass their own variables and never
//! call `set_var`.
//!
//! # Invariants
//! - A loaded config has every field filled (defaults documented on
//!   [`NodeConfig`]); [`NodeConfig::validate`] checks the values the agent
//!   needs to run (pin format, coordinator address, limits).
//! - Models come from exactly one layer: the highest layer that names any
//!   replaces the lower ones (flags `--model id=path` beat the env, which
//!   beats the file), so a model cannot be half-configured from two places.
//!
//! # Failure
//! [`ConfigError`] names the file, variable or key that is wrong and why.
//! Unknown keys in the file and unknown `MLX_NODE__` variables are errors,
//! so a typo never silently falls back to a default.

use std::{
    fmt,
    path::{Path, PathBuf},
    str::FromStr,
};

use mlxnet_proto::env::merge;
use serde::{Deserialize, Serialize};

/// Prefix of the node's environment variables.
pub const ENV_PREFIX: &str = "MLX_NODE__";

/// Everything the node agent needs to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Where the identity key (mode 0600) lives. Default `$HOME/.mlx-node`
    /// (`./.mlx-node` without `HOME`).
    pub data_dir: PathBuf,
    /// `host:port` of the coordinator's QUIC endpoint, or several (a list,
    /// or `a:7071,b:7071` in one string): the replicas of one network. A
    /// name that resolves to several addresses counts as several. The node
    /// links to one at a time and moves to the next when it goes away or
    /// asks the node to move (it drains). Default `127.0.0.1:7071`.
    pub coordinator: AddressList,
    /// Lowercase hex SHA-256 of the coordinator certificate's DER (the
    /// pin), or several (a list, or comma-separated) when the replicas do
    /// not share one certificate: a replica is trusted, at any of the
    /// addresses, when its certificate matches one of them. No default: the
    /// coordinator prints it on start (`mlxnet-coordinator certificate`).
    pub coordinator_fingerprint: AddressList,
    /// Model files this node offers. Default none.
    pub models: Vec<ModelEntry>,
    /// Owner-chosen display name. Empty (default) means `node-<first 8 hex of id>`.
    pub name: String,
    /// Jobs run at once; further assignments are refused as retryable.
    /// Default (none): the batch's slots, so every job the node takes runs
    /// in its model's batch at once.
    pub max_concurrent_jobs: Option<u32>,
    /// Sequences one batched step of a model runs. Default (none): from
    /// the throughput curve `mlx-node bench --batch --save` measured (the
    /// smallest batch within 90% of the best aggregate speed), else 8.
    pub batch_slots: Option<u32>,
    /// Memory for the KV caches of all models together (a fixed pool of
    /// pages, shared by the running jobs and the prefix cache). Default
    /// (none): a quarter of the memory free at start, at most 4 GiB.
    pub kv_cache_bytes: Option<u64>,
    /// Compute threads for the engine (CPU). Default: all cores.
    pub threads: Option<usize>,
    /// Reconnect backoff, first delay. Default 500 ms.
    pub reconnect_min_ms: u64,
    /// Reconnect backoff, largest delay. Default 30 s.
    pub reconnect_max_ms: u64,
    /// Limit on dialing + the QUIC/TLS handshake + registration. Default 10 s.
    pub connect_timeout_ms: u64,
    /// On shutdown (SIGTERM, Ctrl-C) the node drains: it takes no new job,
    /// lets running jobs finish for this long, then hands the rest back at a
    /// token boundary so they resume on another node. Default 30 s.
    pub drain_grace_ms: u64,
    /// Whether the Mac is lent full-time, only while idle, or on a weekly
    /// schedule. Default dedicated.
    pub mode: NodeMode,
    /// The rules lending follows (idle time, power, heat, memory, shares,
    /// schedule, hand-off grace): see [`LendingSettings`].
    #[serde(default)]
    pub lending: LendingSettings,
    /// How the node measures the energy of its jobs and what a kWh costs
    /// its owner: see [`EnergySettings`].
    #[serde(default)]
    pub energy: EnergySettings,
    /// Where the engine computes: `auto` (Metal on a Mac built with it,
    /// else the CPU), `cpu`, `metal` or `cuda`. Default auto.
    #[serde(default)]
    pub device: crate::engine::device::DeviceChoice,
    /// Owner-declared coarse location for the World page. Default none.
    pub location: Option<Location>,
    /// Ledger account id of the owner's operator account, which this node's
    /// pay is credited to (`mlxnet` prints it when the account is created).
    /// Empty (default): the coordinator keeps the node's current link, or
    /// gives a new node an account of its own.
    pub operator_account: String,
    /// Set when this node is a member of a pod (see [`PodSettings`]).
    /// Default none: a single Mac.
    pub pod: Option<PodSettings>,
    /// The folder of pulled catalogue models and the owner's rules for it
    /// (see [`StoreSettings`]).
    pub store: StoreSettings,
    /// Test knob for the audit tests: the node replaces every generated
    /// token with another before signing, as a cheating node would. Only
    /// settable in code (never from a file or the environment).
    #[serde(skip)]
    pub test_cheat: bool,
}

/// Pod membership: the MLX hostfile, this node's rank in it, and how the
/// pod splits its model. A pod node serves exactly one model (its only
/// `models` entry), across the pod; it takes no job of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodSettings {
    /// The MLX hostfile (JSON), the same file on every member. Required
    /// ([`NodeConfig::validate`] refuses a pod without one).
    #[serde(default)]
    pub hostfile: PathBuf,
    /// This node's rank (0 = leader, which speaks for the pod).
    #[serde(default)]
    pub rank: usize,
    /// Rank `r` listens on `port + r` at its hostfile address. Default 32323.
    #[serde(default = "default_pod_port")]
    pub port: u16,
    /// `auto` (tensor over RDMA, pipeline over TCP), `tensor` or `pipeline`.
    #[serde(default)]
    pub parallelism: crate::pod::runtime::Parallelism,
    /// Memory this member may use for its share (weights + KV cache).
    /// Default: the machine's free memory at start.
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    /// Longest sequence (prompt + generated) the pod accepts; the KV cache
    /// is budgeted for it. Default: the model's context length.
    #[serde(default)]
    pub max_context: Option<usize>,
    /// This member's speed for its tensor-parallel share (GB/s of the
    /// formation probe, see `pod::speed`). Default: measured at formation.
    #[serde(default)]
    pub speed: Option<f64>,
}

fn default_pod_port() -> u16 {
    32323
}

/// Where pulled models live and what the owner allows there. Every model
/// installed in the folder is served, beside the `models` entries.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSettings {
    /// The model folder. Default `<data_dir>/models`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Disk the pulled models may take together; the models used longest
    /// ago are removed to make room. Default: no limit.
    #[serde(default)]
    pub quota_bytes: Option<u64>,
    /// Larger models are refused. Default: no limit.
    #[serde(default)]
    pub max_model_bytes: Option<u64>,
    /// Licenses (as the catalogue names them: "gemma", "llama3.1", ...)
    /// the owner refuses. Default none. From the environment,
    /// `gemma,llama3.1`.
    #[serde(
        default,
        deserialize_with = "list_or_text",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub refuse_licenses: Vec<String>,
    /// A catalogue file (TOML) to pull from instead of the built-in one.
    #[serde(default)]
    pub catalogue: Option<PathBuf>,
}

/// A list of names as the file writes it, or as one string `a,b` (empty:
/// none), the form of an environment variable.
fn list_or_text<'de, D>(d: D) -> Result<Vec<String>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        List(Vec<String>),
        Text(String),
    }
    Ok(match Names::deserialize(d)? {
        Names::List(list) => list,
        Names::Text(text) => text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

impl StoreSettings {
    /// The model folder for a node whose data directory is `data_dir`.
    pub fn dir_in(&self, data_dir: &Path) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| data_dir.join("models"))
    }

    /// The owner's rules.
    pub fn policy(&self) -> crate::models::store::StorePolicy {
        crate::models::store::StorePolicy {
            quota_bytes: self.quota_bytes,
            max_model_bytes: self.max_model_bytes,
            refuse_licenses: self.refuse_licenses.clone(),
        }
    }
}

/// When and how much of the machine is lent (`[lending]`). Which rules
/// apply depends on [`NodeMode`]: the power, heat and memory rules apply in
/// every mode; `min_idle_s` in `idle` mode; `schedule` in `schedule` mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LendingSettings {
    /// Idle mode: the owner counts as away after this long without input.
    /// Default 300 s.
    pub min_idle_s: u64,
    /// Lend only on mains (AC) power; a machine without a battery always is.
    /// Default true.
    pub ac_only: bool,
    /// Pause while the thermal state is serious or critical. Default true.
    pub thermal_pause: bool,
    /// At most this much memory is offered to jobs (the free memory the
    /// node reports is capped to it). Default: no cap.
    pub memory_cap_bytes: Option<u64>,
    /// Share of the CPU cores the engine uses, in (0, 1] (when `threads` is
    /// not set). Default: all cores.
    pub cpu_share: Option<f64>,
    /// Share of the time the GPU (device path) computes, in (0, 1]: after
    /// each token the engine rests so that compute / wall time stays under
    /// it. Default: no limit.
    pub gpu_share: Option<f64>,
    /// Schedule mode: weekly windows in local time, e.g. `"mon-fri 22:00-07:00"`,
    /// `"sat,sun 00:00-24:00"`, `"daily 12:00-13:00"`. Default none.
    pub schedule: Vec<String>,
    /// When the owner returns (or a rule pauses lending) running jobs may
    /// go on this long, then hand off to another node. Default 5 s.
    pub grace_ms: u64,
    /// How often the signals (idle time, power, heat) are read. Default 2 s.
    pub poll_ms: u64,
}

impl Default for LendingSettings {
    fn default() -> Self {
        Self {
            min_idle_s: 300,
            ac_only: true,
            thermal_pause: true,
            memory_cap_bytes: None,
            cpu_share: None,
            gpu_share: None,
            schedule: Vec::new(),
            grace_ms: 5_000,
            poll_ms: 2_000,
        }
    }
}

/// One layer's `[lending]` keys: each optional, so a layer overrides only
/// the keys it sets (the layers merge key by key).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LendingLayer {
    pub min_idle_s: Option<u64>,
    pub ac_only: Option<bool>,
    pub thermal_pause: Option<bool>,
    pub memory_cap_bytes: Option<u64>,
    pub cpu_share: Option<f64>,
    pub gpu_share: Option<f64>,
    /// A list of windows; from the environment, windows separated by `;`
    /// (a window itself may hold commas: `sat,sun 10:00-18:00`).
    #[serde(default, deserialize_with = "windows_or_list")]
    pub schedule: Option<Vec<String>>,
    pub grace_ms: Option<u64>,
    pub poll_ms: Option<u64>,
}

/// Schedule windows as the file lists them, or as one string of windows
/// separated by `;`, the form of `MLX_NODE__LENDING__SCHEDULE`.
fn windows_or_list<'de, D>(d: D) -> Result<Option<Vec<String>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Windows {
        List(Vec<String>),
        Text(String),
    }
    Ok(Some(match Windows::deserialize(d)? {
        Windows::List(list) => list,
        Windows::Text(text) => text
            .split(';')
            .map(str::trim)
            .filter(|w| !w.is_empty())
            .map(str::to_owned)
            .collect(),
    }))
}

/// Which energy counters the node reads (`[energy] meter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MeterKind {
    /// RAPL on Linux when readable, `powermetrics` on macOS when permitted,
    /// else none.
    #[default]
    Auto,
    /// Linux RAPL counters under `rapl_root`.
    Rapl,
    /// macOS `powermetrics` (needs root).
    Powermetrics,
    /// Measure nothing: claims carry no energy.
    None,
}

/// Energy measurement and the owner's electricity price (`[energy]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnergySettings {
    /// Default auto.
    pub meter: MeterKind,
    /// Where the RAPL counters live. Default `/sys/class/powercap`.
    pub rapl_root: PathBuf,
    /// What one kWh costs the owner, in micro-MLX (1 MLX = 1,000,000): the
    /// owner's view shows earnings net of the energy the jobs used at this
    /// price. Default 0 (no price set: the net figure is not shown).
    pub price_micro_mlx_per_kwh: u64,
}

impl Default for EnergySettings {
    fn default() -> Self {
        Self {
            meter: MeterKind::Auto,
            rapl_root: PathBuf::from("/sys/class/powercap"),
            price_micro_mlx_per_kwh: 0,
        }
    }
}

/// One layer's `[energy]` keys (each optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnergyLayer {
    pub meter: Option<MeterKind>,
    pub rapl_root: Option<PathBuf>,
    pub price_micro_mlx_per_kwh: Option<u64>,
}

/// One model file the node holds: catalogue id and local path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub id: String,
    pub path: PathBuf,
}

impl FromStr for ModelEntry {
    type Err = ConfigError;

    /// Parses `id=path`, the form of `--model` and of `MLX_NODE__MODELS`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((id, path)) if !id.trim().is_empty() && !path.trim().is_empty() => Ok(Self {
                id: id.trim().to_owned(),
                path: PathBuf::from(path.trim()),
            }),
            _ => Err(ConfigError::ModelEntry(s.to_owned())),
        }
    }
}

/// How the owner lends the Mac.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum NodeMode {
    /// Lent full-time: takes any job it can hold.
    #[default]
    Dedicated,
    /// Lent only while the owner is away.
    Idle,
    /// Lent during the weekly windows of `lending.schedule`.
    Schedule,
}

impl FromStr for NodeMode {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "dedicated" => Ok(Self::Dedicated),
            "idle" => Ok(Self::Idle),
            "schedule" => Ok(Self::Schedule),
            _ => Err(ConfigError::Mode(s.to_owned())),
        }
    }
}

impl TryFrom<String> for NodeMode {
    type Error = ConfigError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl fmt::Display for NodeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Dedicated => "dedicated",
            Self::Idle => "idle",
            Self::Schedule => "schedule",
        })
    }
}

/// A coarse, owner-declared location for the World page: coordinates (both
/// required once a location is given) and an optional place name. Never
/// derived from the IP address; the coordinator snaps it to a coarse grid.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Location {
    /// City or region, e.g. "Lyon, France".
    pub place: Option<String>,
    pub lat: Option<f64>,
    pub lon: Option<f64>,
    /// Counted in totals but not drawn on the map.
    pub hidden: Option<bool>,
}

impl Location {
    /// As sent in `Hello` (after [`NodeConfig::validate`], so both coordinates are set).
    pub fn to_wire(&self) -> mlxnet_proto::v1::Location {
        mlxnet_proto::v1::Location {
            label: self.place.clone().unwrap_or_default(),
            latitude: self.lat.unwrap_or_default(),
            longitude: self.lon.unwrap_or_default(),
            hidden: self.hidden.unwrap_or(false),
        }
    }
}

/// Why the configuration could not be loaded or is not usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {source}")]
    ParseFile {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error(
        "unknown environment variable {0}: it names no setting (the keys are the config file's)"
    )]
    UnknownEnv(String),
    #[error("environment variable {var}={value:?}: {reason}")]
    BadEnv {
        var: String,
        value: String,
        reason: String,
    },
    #[error("model entry {0:?} must be `id=path`")]
    ModelEntry(String),
    #[error("mode {0:?} must be `dedicated`, `idle` or `schedule`")]
    Mode(String),
    #[error("coordinator_fingerprint is not set: pass --fingerprint <hex> (the coordinator prints it on start)")]
    MissingFingerprint,
    #[error("coordinator_fingerprint {0:?} must be 64 lowercase hex digits (SHA-256 of the certificate DER)")]
    BadFingerprint(String),
    #[error("coordinator address {0:?} must be host:port")]
    BadCoordinator(String),
    #[error("{key} must be {expected}, got {value}")]
    OutOfRange {
        key: &'static str,
        expected: &'static str,
        value: String,
    },
    #[error("model id {0:?} is configured twice")]
    DuplicateModel(String),
    #[error("configuration is not valid: {0}")]
    Invalid(Box<toml::de::Error>),
    #[error("a configuration value cannot be written as TOML: {0}")]
    Encode(Box<toml::ser::Error>),
}

impl From<mlxnet_proto::env::EnvError> for ConfigError {
    fn from(e: mlxnet_proto::env::EnvError) -> Self {
        use mlxnet_proto::env::EnvError;
        match e {
            EnvError::Unknown { var, .. } => ConfigError::UnknownEnv(var),
            EnvError::Invalid {
                var,
                key,
                value,
                reason,
            } => ConfigError::BadEnv {
                var,
                value,
                reason: format!("setting `{key}`: {reason}"),
            },
            EnvError::EmptySection { var } => ConfigError::BadEnv {
                var,
                value: String::new(),
                reason: "a section name is empty".into(),
            },
            other => ConfigError::BadEnv {
                var: String::new(),
                value: String::new(),
                reason: other.to_string(),
            },
        }
    }
}

/// One layer of configuration: every key optional. The TOML file and the
/// `MLX_NODE__*` variables are read into one each; `main` fills one from
/// flags. Layers are merged as TOML tables over the defaults (a later
/// layer's keys win, sections merge key by key, a list replaces the lower
/// one), then read into a [`NodeConfig`]: the coordinator reads its own
/// configuration the same way (`mlxnet_proto::env`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigLayer {
    pub data_dir: Option<PathBuf>,
    pub coordinator: Option<AddressList>,
    pub coordinator_fingerprint: Option<AddressList>,
    /// A list of `{ id, path }`; from the environment, `id=path,id=path`.
    #[serde(default, deserialize_with = "models_or_list")]
    pub models: Option<Vec<ModelEntry>>,
    pub name: Option<String>,
    pub max_concurrent_jobs: Option<u32>,
    pub batch_slots: Option<u32>,
    pub kv_cache_bytes: Option<u64>,
    pub threads: Option<usize>,
    pub reconnect_min_ms: Option<u64>,
    pub reconnect_max_ms: Option<u64>,
    pub connect_timeout_ms: Option<u64>,
    pub drain_grace_ms: Option<u64>,
    pub mode: Option<NodeMode>,
    pub lending: Option<LendingLayer>,
    pub energy: Option<EnergyLayer>,
    pub device: Option<crate::engine::device::DeviceChoice>,
    pub location: Option<Location>,
    pub operator_account: Option<String>,
    pub pod: Option<PodSettings>,
    pub store: Option<StoreSettings>,
}

/// Models as the file lists them, or as one string `id=path,id=path`
/// (empty: none), the form of `MLX_NODE__MODELS`.
fn models_or_list<'de, D>(d: D) -> Result<Option<Vec<ModelEntry>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Models {
        List(Vec<ModelEntry>),
        Text(String),
    }
    match Models::deserialize(d)? {
        Models::List(list) => Ok(Some(list)),
        Models::Text(text) => text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(ModelEntry::from_str)
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
            .map_err(|_| {
                serde::de::Error::custom("expected `id=path` entries separated by commas")
            }),
    }
}

impl ConfigLayer {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text).map_err(|source| ConfigError::ParseFile {
            path: path.to_owned(),
            source: Box::new(source),
        })
    }

    fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// Collects the `MLX_NODE__*` variables among `vars` (nested sections
    /// by `__`: `MLX_NODE__LOCATION__PLACE`); others are ignored.
    pub fn from_env<I, K, V>(vars: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let table = mlxnet_proto::env::overrides::<Self, _, _, _>(ENV_PREFIX, vars)?;
        toml::Value::Table(table)
            .try_into()
            .map_err(|e| ConfigError::Invalid(Box::new(e)))
    }

    /// This layer as a TOML table (keys it does not set are absent).
    fn table(&self) -> Result<toml::Table, ConfigError> {
        toml::Table::try_from(self).map_err(|e| ConfigError::Encode(Box::new(e)))
    }
}

impl NodeConfig {
    /// Defaults, with the three things a node cannot guess (the address
    /// and the pin each one, or several separated by commas).
    pub fn new(
        data_dir: PathBuf,
        coordinator: impl Into<AddressList>,
        fingerprint: impl Into<AddressList>,
    ) -> Self {
        Self {
            data_dir,
            coordinator: coordinator.into(),
            coordinator_fingerprint: fingerprint.into(),
            models: Vec::new(),
            name: String::new(),
            max_concurrent_jobs: None,
            batch_slots: None,
            kv_cache_bytes: None,
            threads: None,
            reconnect_min_ms: 500,
            reconnect_max_ms: 30_000,
            connect_timeout_ms: 10_000,
            drain_grace_ms: 30_000,
            mode: NodeMode::Dedicated,
            lending: LendingSettings::default(),
            energy: EnergySettings::default(),
            device: crate::engine::device::DeviceChoice::Auto,
            location: None,
            operator_account: String::new(),
            pod: None,
            store: StoreSettings::default(),
            test_cheat: false,
        }
    }

    /// Defaults for this machine: `HOME` is taken from `env`.
    pub fn defaults<I, K, V>(env: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let home = env
            .into_iter()
            .find(|(k, _)| k.as_ref() == "HOME")
            .map(|(_, v)| PathBuf::from(v.as_ref()))
            .filter(|p| !p.as_os_str().is_empty());
        let data_dir = home.unwrap_or_else(|| PathBuf::from(".")).join(".mlx-node");
        Self::new(data_dir, "127.0.0.1:7071", "")
    }

    /// Layers defaults, the TOML file (if any), the `MLX_NODE__*` variables
    /// among `env`, and `flags`. Does not [`validate`](Self::validate).
    pub fn load<I, K, V>(
        file: Option<&Path>,
        env: I,
        flags: ConfigLayer,
    ) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let env: Vec<(String, String)> = env
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
            .collect();
        let defaults = Self::defaults(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut table =
            toml::Table::try_from(&defaults).map_err(|e| ConfigError::Encode(Box::new(e)))?;
        if let Some(path) = file {
            merge(&mut table, ConfigLayer::from_file(path)?.table()?);
        }
        merge(&mut table, ConfigLayer::from_env(env)?.table()?);
        merge(&mut table, flags.table()?);
        toml::Value::Table(table)
            .try_into()
            .map_err(|e| ConfigError::Invalid(Box::new(e)))
    }

    /// Compute threads for the engine: `threads`, else `lending.cpu_share`
    /// of the machine's cores (at least one), else `None` (all cores).
    pub fn effective_threads(&self) -> Option<usize> {
        self.threads.or_else(|| {
            let share = self.lending.cpu_share?;
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Some(((cores as f64 * share).floor() as usize).max(1))
        })
    }

    /// Checks the values the agent needs: the pin, the coordinator address,
    /// limits and model ids.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.coordinator_fingerprint.is_empty() {
            return Err(ConfigError::MissingFingerprint);
        }
        for pin in self.coordinator_fingerprint.iter() {
            parse_fingerprint(pin)?;
        }
        if self.coordinator.is_empty() {
            return Err(ConfigError::BadCoordinator(String::new()));
        }
        for addr in self.coordinator.iter() {
            split_host_port(addr)?;
        }
        for (key, v) in [
            ("max_concurrent_jobs", self.max_concurrent_jobs),
            ("batch_slots", self.batch_slots),
        ] {
            if v == Some(0) {
                return Err(ConfigError::OutOfRange {
                    key,
                    expected: "at least 1",
                    value: "0".into(),
                });
            }
        }
        if self.kv_cache_bytes == Some(0) {
            return Err(ConfigError::OutOfRange {
                key: "kv_cache_bytes",
                expected: "at least one page of every model's cache",
                value: "0".into(),
            });
        }
        if self.threads == Some(0) {
            return Err(ConfigError::OutOfRange {
                key: "threads",
                expected: "at least 1",
                value: "0".into(),
            });
        }
        if self.reconnect_min_ms == 0 || self.reconnect_min_ms > self.reconnect_max_ms {
            return Err(ConfigError::OutOfRange {
                key: "reconnect_min_ms",
                expected: "between 1 and reconnect_max_ms",
                value: format!("{} (max {})", self.reconnect_min_ms, self.reconnect_max_ms),
            });
        }
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::OutOfRange {
                key: "connect_timeout_ms",
                expected: "at least 1",
                value: "0".into(),
            });
        }
        if let Some(pod) = &self.pod {
            if pod.hostfile.as_os_str().is_empty() {
                return Err(ConfigError::OutOfRange {
                    key: "pod.hostfile",
                    expected: "the path of the pod's MLX hostfile",
                    value: String::new(),
                });
            }
            if let Some(speed) = pod.speed.filter(|s| !(s.is_finite() && *s > 0.0)) {
                return Err(ConfigError::OutOfRange {
                    key: "pod.speed",
                    expected: "a positive number",
                    value: speed.to_string(),
                });
            }
            if self.models.len() != 1 {
                return Err(ConfigError::OutOfRange {
                    key: "models",
                    expected: "exactly one model on a pod member (the pod serves one model)",
                    value: self.models.len().to_string(),
                });
            }
        }
        let share_ok = |s: Option<f64>| s.is_none_or(|s| s.is_finite() && s > 0.0 && s <= 1.0);
        for (key, share) in [
            ("lending.cpu_share", self.lending.cpu_share),
            ("lending.gpu_share", self.lending.gpu_share),
        ] {
            if !share_ok(share) {
                return Err(ConfigError::OutOfRange {
                    key,
                    expected: "a share in (0, 1]",
                    value: format!("{share:?}"),
                });
            }
        }
        if self.lending.poll_ms == 0 {
            return Err(ConfigError::OutOfRange {
                key: "lending.poll_ms",
                expected: "at least 1",
                value: "0".into(),
            });
        }
        if let Err(e) = crate::policy::Schedule::parse(&self.lending.schedule) {
            return Err(ConfigError::OutOfRange {
                key: "lending.schedule",
                expected: "windows like \"mon-fri 22:00-07:00\"",
                value: e.to_string(),
            });
        }
        if self.mode == NodeMode::Schedule && self.lending.schedule.is_empty() {
            return Err(ConfigError::OutOfRange {
                key: "lending.schedule",
                expected: "at least one window in schedule mode",
                value: "none".into(),
            });
        }
        if let Some(loc) = &self.location {
            if loc.lat.is_none() || loc.lon.is_none() {
                return Err(ConfigError::OutOfRange {
                    key: "location",
                    expected: "both lat and lon (degrees) when a location is given",
                    value: format!("lat {:?}, lon {:?}", loc.lat, loc.lon),
                });
            }
            if loc.lat.is_some_and(|v| !(-90.0..=90.0).contains(&v)) {
                return Err(ConfigError::OutOfRange {
                    key: "location.lat",
                    expected: "between -90 and 90",
                    value: format!("{:?}", loc.lat),
                });
            }
            if loc.lon.is_some_and(|v| !(-180.0..=180.0).contains(&v)) {
                return Err(ConfigError::OutOfRange {
                    key: "location.lon",
                    expected: "between -180 and 180",
                    value: format!("{:?}", loc.lon),
                });
            }
        }
        let mut seen = std::collections::HashSet::new();
        for m in &self.models {
            if !seen.insert(m.id.as_str()) {
                return Err(ConfigError::DuplicateModel(m.id.clone()));
            }
        }
        Ok(())
    }
}

/// Parses a certificate pin: 64 hex digits (either case accepted, compared
/// as bytes).
pub fn parse_fingerprint(hex_str: &str) -> Result<[u8; 32], ConfigError> {
    let s = hex_str.trim();
    if s.is_empty() {
        return Err(ConfigError::MissingFingerprint);
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out)
        .map_err(|_| ConfigError::BadFingerprint(hex_str.to_owned()))?;
    Ok(out)
}

/// One value or several: written as a string (several separated by
/// commas, the form of the environment and of a flag) or as a list. The
/// coordinator's addresses and pins are such lists; empty entries are
/// dropped, so `""` is the empty list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressList(Vec<String>);

impl AddressList {
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl From<&str> for AddressList {
    fn from(text: &str) -> Self {
        Self(
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        )
    }
}

impl From<String> for AddressList {
    fn from(text: String) -> Self {
        Self::from(text.as_str())
    }
}

impl From<Vec<String>> for AddressList {
    fn from(items: Vec<String>) -> Self {
        Self(
            items
                .iter()
                .flat_map(|i| Self::from(i.as_str()).0)
                .collect(),
        )
    }
}

impl PartialEq<&str> for AddressList {
    fn eq(&self, other: &&str) -> bool {
        self.iter()
            .eq(other.split(',').map(str::trim).filter(|s| !s.is_empty()))
    }
}

impl fmt::Display for AddressList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

impl Serialize for AddressList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(one),
            _ => self.0.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for AddressList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            One(String),
            Many(Vec<String>),
        }
        Ok(match Form::deserialize(d)? {
            Form::One(text) => Self::from(text),
            Form::Many(items) => Self::from(items),
        })
    }
}

/// Splits `host:port` (`[v6]:port` too) into host and port.
pub fn split_host_port(addr: &str) -> Result<(&str, u16), ConfigError> {
    let bad = || ConfigError::BadCoordinator(addr.to_owned());
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    let port: u16 = port.parse().map_err(|_| bad())?;
    if port == 0 {
        return Err(bad());
    }
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_use_home_and_documented_values() {
        let c =
            NodeConfig::load(None, env(&[("HOME", "/home/ada")]), ConfigLayer::default()).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/home/ada/.mlx-node"));
        assert_eq!(c.coordinator, "127.0.0.1:7071");
        assert_eq!(c.max_concurrent_jobs, None, "the batch decides");
        assert_eq!((c.batch_slots, c.kv_cache_bytes), (None, None));
        assert_eq!((c.reconnect_min_ms, c.reconnect_max_ms), (500, 30_000));
        assert_eq!(c.mode, NodeMode::Dedicated);
        assert!(c.models.is_empty());
        // No pin yet: running is refused with a message saying what to pass.
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("--fingerprint"), "{err}");
    }

    #[test]
    fn flags_beat_env_which_beats_the_file_which_beats_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(
            &file,
            r#"
            data_dir = "/srv/node"
            coordinator = "coord.example:7071"
            coordinator_fingerprint = "aa"
            name = "from-file"
            max_concurrent_jobs = 2
            mode = "idle"
            models = [{ id = "smollm2-135m-instruct", path = "/m/smol.gguf" }]
            [location]
            place = "Lyon, France"
            lat = 45.76
            lon = 4.84
            "#,
        )
        .unwrap();
        let vars = env(&[
            ("HOME", "/home/ada"),
            ("MLX_NODE__NAME", "from-env"),
            ("MLX_NODE__MAX_CONCURRENT_JOBS", "3"),
            ("MLX_NODE__COORDINATOR_FINGERPRINT", FP),
            ("MLX_NODE__LOCATION__PLACE", "Grenoble, France"),
            ("UNRELATED", "x"),
        ]);
        let flags = ConfigLayer {
            name: Some("from-flag".into()),
            models: Some(vec!["tiny=/m/tiny.gguf".parse().unwrap()]),
            ..ConfigLayer::default()
        };
        let c = NodeConfig::load(Some(&file), vars, flags).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/srv/node")); // file over default
        assert_eq!(c.coordinator, "coord.example:7071");
        assert_eq!(c.coordinator_fingerprint, FP); // env over file
        assert_eq!(c.max_concurrent_jobs, Some(3)); // env over file
        assert_eq!(c.name, "from-flag"); // flag over env over file
        assert_eq!(c.mode, NodeMode::Idle);
        // The flag's models replace the file's instead of merging.
        assert_eq!(
            c.models,
            vec![ModelEntry {
                id: "tiny".into(),
                path: "/m/tiny.gguf".into()
            }]
        );
        let loc = c.location.clone().unwrap();
        assert_eq!(loc.place.as_deref(), Some("Grenoble, France"));
        assert_eq!((loc.lat, loc.lon), (Some(45.76), Some(4.84)));
        c.validate().unwrap();
    }

    #[test]
    fn env_models_list_and_typed_values_parse() {
        let c = NodeConfig::load(
            None,
            env(&[
                ("MLX_NODE__MODELS", "a=/x/a.gguf, b=/x/b.gguf"),
                ("MLX_NODE__RECONNECT_MIN_MS", "10"),
                ("MLX_NODE__THREADS", "4"),
                ("MLX_NODE__BATCH_SLOTS", "12"),
                ("MLX_NODE__KV_CACHE_BYTES", "1048576"),
                ("MLX_NODE__LOCATION__LAT", "-33.9"),
                ("MLX_NODE__LOCATION__LON", "18.4"),
                ("MLX_NODE__LOCATION__HIDDEN", "true"),
            ]),
            ConfigLayer::default(),
        )
        .unwrap();
        assert_eq!(c.models.len(), 2);
        assert_eq!(c.models[1].path, PathBuf::from("/x/b.gguf"));
        assert_eq!(c.reconnect_min_ms, 10);
        assert_eq!(c.threads, Some(4));
        assert_eq!((c.batch_slots, c.kv_cache_bytes), (Some(12), Some(1 << 20)));
        let wire = c.location.as_ref().unwrap().to_wire();
        assert_eq!(
            (wire.latitude, wire.longitude, wire.hidden),
            (-33.9, 18.4, true)
        );
    }

    #[test]
    fn pod_settings_come_from_the_file_or_env_and_need_one_model() {
        let file = ConfigLayer::from_toml(
            "[pod]\nhostfile = \"/etc/pod.json\"\nrank = 2\nparallelism = \"tensor\"\n",
        )
        .unwrap();
        let pod = file.pod.clone().unwrap();
        assert_eq!(
            (pod.rank, pod.port, pod.parallelism),
            (2, 32323, crate::pod::runtime::Parallelism::Tensor)
        );
        let mut c = NodeConfig::load(
            None,
            env(&[
                ("MLX_NODE__MODELS", "a=/x/a.gguf"),
                ("MLX_NODE__POD__HOSTFILE", "/p.json"),
                ("MLX_NODE__POD__RANK", "1"),
                ("MLX_NODE__POD__PORT", "4000"),
                ("MLX_NODE__POD__MEMORY_LIMIT_BYTES", "1000"),
                ("MLX_NODE__POD__MAX_CONTEXT", "512"),
                ("MLX_NODE__POD__SPEED", "2.5"),
                ("MLX_NODE__COORDINATOR_FINGERPRINT", &"ab".repeat(32)),
            ]),
            ConfigLayer::default(),
        )
        .unwrap();
        let pod = c.pod.clone().unwrap();
        assert_eq!(pod.hostfile, PathBuf::from("/p.json"));
        assert_eq!(
            (pod.rank, pod.port, pod.memory_limit_bytes, pod.max_context),
            (1, 4000, Some(1000), Some(512))
        );
        assert_eq!(pod.speed, Some(2.5));
        c.validate().unwrap();
        c.models.push(ModelEntry {
            id: "b".into(),
            path: "/x/b.gguf".into(),
        });
        let mut slow = c.clone();
        slow.pod.as_mut().unwrap().speed = Some(0.0);
        let err = slow.validate().unwrap_err().to_string();
        assert!(err.contains("pod.speed"), "{err}");
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("exactly one model"), "{err}");
        let bad = ConfigLayer::from_env(env(&[("MLX_NODE__POD__PARALLELISM", "ring")]));
        assert!(bad
            .unwrap_err()
            .to_string()
            .contains("MLX_NODE__POD__PARALLELISM"));
    }

    #[test]
    fn store_rules_merge_key_by_key_from_the_file_and_env() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(
            &file,
            "[store]\nquota_bytes = 1000\nrefuse_licenses = [\"gemma\"]\n",
        )
        .unwrap();
        // The env refines the quota and leaves the file's licenses.
        let c = NodeConfig::load(
            Some(&file),
            env(&[("MLX_NODE__STORE__QUOTA_BYTES", "2000")]),
            ConfigLayer::default(),
        )
        .unwrap();
        assert_eq!(c.store.quota_bytes, Some(2000));
        assert_eq!(c.store.refuse_licenses, vec!["gemma".to_string()]);
        assert_eq!(c.store.dir_in(Path::new("/d")), PathBuf::from("/d/models"));
        // Licenses from the env as a comma list replace the file's.
        let c = NodeConfig::load(
            Some(&file),
            env(&[
                ("MLX_NODE__STORE__REFUSE_LICENSES", "llama3.1, gemma"),
                ("MLX_NODE__STORE__DIR", "/m"),
            ]),
            ConfigLayer::default(),
        )
        .unwrap();
        assert_eq!(c.store.quota_bytes, Some(1000));
        assert_eq!(c.store.refuse_licenses, vec!["llama3.1", "gemma"]);
        assert_eq!(c.store.dir_in(Path::new("/d")), PathBuf::from("/m"));
        let bad = ConfigLayer::from_env(env(&[("MLX_NODE__STORE__QUOTA_BYTES", "lots")]));
        assert!(bad
            .unwrap_err()
            .to_string()
            .contains("MLX_NODE__STORE__QUOTA_BYTES"));
    }

    #[test]
    fn bad_values_name_the_culprit() {
        let err = NodeConfig::load(
            None,
            env(&[("MLX_NODE__MAX_CONCURRENT_JOBS", "many")]),
            ConfigLayer::default(),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("MLX_NODE__MAX_CONCURRENT_JOBS"),
            "{err}"
        );

        let err = NodeConfig::load(
            None,
            env(&[("MLX_NODE__COORDINATR", "x:1")]),
            ConfigLayer::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, ConfigError::UnknownEnv(ref v) if v == "MLX_NODE__COORDINATR"),
            "{err}"
        );

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(&file, "max_concurent_jobs = 2\n").unwrap();
        let err = NodeConfig::load(Some(&file), env(&[]), ConfigLayer::default()).unwrap_err();
        assert!(err.to_string().contains("max_concurent_jobs"), "{err}");

        let err = NodeConfig::load(
            Some(&dir.path().join("missing.toml")),
            env(&[]),
            ConfigLayer::default(),
        )
        .unwrap_err();
        assert!(matches!(err, ConfigError::ReadFile { .. }), "{err}");

        assert!("no-equals-sign".parse::<ModelEntry>().is_err());
        assert!("=path".parse::<ModelEntry>().is_err());
    }

    #[test]
    fn several_coordinator_addresses_and_pins_come_as_a_list_or_comma_separated() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        let other = "a".repeat(64);
        std::fs::write(
            &file,
            format!(
                r#"
                coordinator = ["coord-a.example:7071", "coord-b.example:7071"]
                coordinator_fingerprint = ["{FP}", "{other}"]
                "#
            ),
        )
        .unwrap();
        let c = NodeConfig::load(Some(&file), env(&[]), ConfigLayer::default()).unwrap();
        assert_eq!(
            c.coordinator.iter().collect::<Vec<_>>(),
            ["coord-a.example:7071", "coord-b.example:7071"]
        );
        assert_eq!(c.coordinator_fingerprint.len(), 2);
        c.validate().unwrap();
        // The environment's (and a flag's) form: one string, commas between.
        let vars = env(&[("MLX_NODE__COORDINATOR", "x.example:1, y.example:2")]);
        let c = NodeConfig::load(Some(&file), vars, ConfigLayer::default()).unwrap();
        assert_eq!(
            c.coordinator.iter().collect::<Vec<_>>(),
            ["x.example:1", "y.example:2"]
        );
        // One shared pin (what the deploy files use) stays a plain string.
        let c = NodeConfig::new("/d".into(), "a:1,b:2", FP);
        assert_eq!(c.coordinator.len(), 2);
        c.validate().unwrap();
        // Every entry is checked.
        let mut bad = c.clone();
        bad.coordinator = "a:1,no-port".into();
        assert!(matches!(bad.validate(), Err(ConfigError::BadCoordinator(a)) if a == "no-port"));
        let mut bad = c.clone();
        bad.coordinator_fingerprint = format!("{FP},zz").as_str().into();
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::BadFingerprint(_))
        ));
        bad.coordinator_fingerprint = "".into();
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::MissingFingerprint)
        ));
    }

    #[test]
    fn validation_refuses_unusable_values() {
        let ok = NodeConfig::new("/d".into(), "127.0.0.1:7071", FP);
        ok.validate().unwrap();

        let mut c = ok.clone();
        c.coordinator_fingerprint = "zz".into();
        assert!(matches!(c.validate(), Err(ConfigError::BadFingerprint(_))));
        let mut c = ok.clone();
        c.coordinator = "no-port".into();
        assert!(matches!(c.validate(), Err(ConfigError::BadCoordinator(_))));
        let mut c = ok.clone();
        c.max_concurrent_jobs = Some(0);
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.batch_slots = Some(0);
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.kv_cache_bytes = Some(0);
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.reconnect_min_ms = 60_000;
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.location = Some(Location {
            lat: Some(91.0),
            lon: Some(0.0),
            ..Location::default()
        });
        assert!(c.validate().is_err());
        c.location = Some(Location {
            place: Some("Lyon".into()),
            ..Location::default()
        });
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("both lat and lon"), "{err}");
        let mut c = ok.clone();
        c.models = vec!["a=/x".parse().unwrap(), "a=/y".parse().unwrap()];
        assert!(matches!(c.validate(), Err(ConfigError::DuplicateModel(_))));

        assert_eq!(split_host_port("[::1]:7071").unwrap(), ("::1", 7071));
        assert_eq!(
            split_host_port("coord.example:1").unwrap(),
            ("coord.example", 1)
        );
        assert!(split_host_port(":7071").is_err());
    }
}
