//! Coordinator configuration: defaults, then a TOML file, then environment
//! variables `MLXNET__SECTION__KEY`, then command-line flags (applied by `main`).
//!
//! This module only gathers: each section's type lives with the module it
//! configures ([`crate::catalogue::CatalogueModel`], [`Limits`] in
//! `api::limits`, `ledger::LedgerConfig`, `audit::AuditConfig`), and the
//! top-level keys are handed to their modules as
//! [`crate::dispatch::DispatchConfig`], [`crate::link::LinkConfig`] and
//! [`crate::http::HttpConfig`].
//!
//! # Invariants
//! - Every field has a default, so an empty file (or none) is a valid config.
//! - The environment is read only through [`CoordinatorConfig::load`]'s
//!   iterator argument, so tests pass a fixed list and never touch the process
//!   environment.
//! - `database_url` may hold a password; `Debug` redacts it.
//!
//! # Failure
//! A malformed file, an env value of the wrong type or an unknown model digest
//! format fails `load` with a message naming the source.

use std::{
    fmt,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
};

use anyhow::Context;
use serde::Deserialize;

pub use crate::api::limits::Limits;
pub use crate::catalogue::{smollm2_135m_instruct, CatalogueModel};

/// Prefix of the environment variables that override the config.
pub const ENV_PREFIX: &str = "MLXNET__";

/// Everything the coordinator needs to start.
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// SQLite file and TLS certificate/key live here.
    pub data_dir: PathBuf,
    pub grpc_addr: SocketAddr,
    /// UDP address of the QUIC node link.
    pub quic_addr: SocketAddr,
    /// `/healthz`, `/readyz`, `/metrics`.
    pub http_addr: SocketAddr,
    /// Default: `[store] url`, else `sqlite://<data_dir>/coordinator.db`.
    pub database_url: Option<String>,
    /// The database and its pool (see [`crate::store::StoreConfig`]).
    pub store: crate::store::StoreConfig,
    pub catalogue: Vec<CatalogueModel>,
    /// The catalogue file (`mlxnet-coordinator catalogue add|list|remove`);
    /// its models join `catalogue`, replacing entries of the same id.
    /// Default `<data_dir>/catalogue.toml` when that file exists.
    pub catalogue_file: Option<PathBuf>,
    pub limits: Limits,
    /// How often nodes are told to heartbeat.
    pub heartbeat_interval_ms: u64,
    /// A node silent for longer is offline and its jobs are requeued.
    pub heartbeat_timeout_ms: u64,
    /// How long a node has to answer the challenge with its Hello.
    pub handshake_timeout_ms: u64,
    /// Per-source handshake rate and new-identity cap on the node link
    /// (see [`crate::link::sources`]).
    pub node_sources: crate::link::sources::SourceLimitsConfig,
    /// An identity offline for longer, with no verified work, drops out of
    /// the World map (a Sybil's keys do not stay there forever).
    pub world_stale_ttl_ms: u64,
    /// Longest a single job attempt may run before it is failed and requeued.
    pub job_timeout_ms: u64,
    /// Fees and hold lifetimes (see [`crate::ledger`]).
    pub ledger: crate::ledger::LedgerConfig,
    /// An attempt's lease: the node must show progress (started, tokens)
    /// at least this often, or the attempt is failed and the job requeued.
    pub job_lease_ms: u64,
    /// Audits of completed jobs and the pay window (see [`crate::audit`]).
    pub audit: crate::audit::AuditConfig,
    /// This replica's name among those sharing the database: the holder
    /// of the leases it takes, and the `replica` label of its metrics.
    /// Default: a random `replica-<12 hex>` made once per data directory
    /// and kept there (`app::REPLICA_ID_FILE`).
    pub replica_id: Option<String>,
    /// On SIGTERM the replica drains: it claims no more queued jobs, tells
    /// its nodes to move to another replica, and waits this long at most
    /// for them to leave and for its attempts' ends to be recorded before
    /// it stops (nodes get half of it to finish running jobs before they
    /// hand them off). Default 20 s.
    pub drain_timeout_ms: u64,
}

fn any_addr(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port))
}

fn local_any_port() -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("mlxnet-data"),
            grpc_addr: any_addr(7070),
            quic_addr: any_addr(7071),
            http_addr: any_addr(7080),
            database_url: None,
            store: crate::store::StoreConfig::default(),
            catalogue: vec![smollm2_135m_instruct()],
            catalogue_file: None,
            limits: Limits::default(),
            heartbeat_interval_ms: 5_000,
            heartbeat_timeout_ms: 15_000,
            handshake_timeout_ms: 10_000,
            node_sources: crate::link::sources::SourceLimitsConfig::default(),
            world_stale_ttl_ms: crate::world::DEFAULT_STALE_TTL.as_millis() as u64,
            job_timeout_ms: 10 * 60 * 1000,
            ledger: crate::ledger::LedgerConfig::default(),
            job_lease_ms: 60_000,
            audit: crate::audit::AuditConfig::default(),
            replica_id: None,
            drain_timeout_ms: 20_000,
        }
    }
}

impl fmt::Debug for CoordinatorConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoordinatorConfig")
            .field("data_dir", &self.data_dir)
            .field("grpc_addr", &self.grpc_addr)
            .field("quic_addr", &self.quic_addr)
            .field("http_addr", &self.http_addr)
            .field(
                "database_url",
                &self.database_url.as_ref().map(|_| "<redacted>"),
            )
            .field("store.url", &self.store.url.as_ref().map(|_| "<redacted>"))
            .field("store.max_connections", &self.store.max_connections)
            .field(
                "store.statement_timeout_ms",
                &self.store.statement_timeout_ms,
            )
            .field("store.acquire_timeout_ms", &self.store.acquire_timeout_ms)
            .field("catalogue", &self.catalogue)
            .field("catalogue_file", &self.catalogue_file)
            .field("limits", &self.limits)
            .field("heartbeat_interval_ms", &self.heartbeat_interval_ms)
            .field("heartbeat_timeout_ms", &self.heartbeat_timeout_ms)
            .field("handshake_timeout_ms", &self.handshake_timeout_ms)
            .field("node_sources", &self.node_sources)
            .field("world_stale_ttl_ms", &self.world_stale_ttl_ms)
            .field("job_timeout_ms", &self.job_timeout_ms)
            .field("ledger", &self.ledger)
            .field("job_lease_ms", &self.job_lease_ms)
            .field("audit", &self.audit)
            .field("replica_id", &self.replica_id)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .finish()
    }
}

impl CoordinatorConfig {
    /// Defaults with `data_dir` set and every listener on `127.0.0.1:0`,
    /// audits off (no pay window) and a 2 s drain: what tests and the
    /// devnet use.
    pub fn for_data_dir(data_dir: PathBuf) -> Self {
        Self {
            data_dir,
            grpc_addr: local_any_port(),
            quic_addr: local_any_port(),
            http_addr: local_any_port(),
            audit: crate::audit::AuditConfig::off(),
            // A stop drains for at most 2 s: hand-made test nodes never
            // answer the reconnect hint, and a test stopping a coordinator
            // must not wait the production default for them.
            drain_timeout_ms: 2_000,
            ..Self::default()
        }
    }

    /// The catalogue file, and whether it was named (a named file must
    /// exist; the default one may be absent).
    pub fn catalogue_path(&self) -> (PathBuf, bool) {
        match &self.catalogue_file {
            Some(p) => (p.clone(), true),
            None => (self.data_dir.join("catalogue.toml"), false),
        }
    }

    /// Every model jobs may name: `catalogue` with the catalogue file's.
    pub fn catalogue_models(
        &self,
    ) -> Result<Vec<CatalogueModel>, crate::catalogue::file::CatalogueFileError> {
        let (path, named) = self.catalogue_path();
        let file = crate::catalogue::file::read(&path, !named)?;
        Ok(crate::catalogue::file::merged(&self.catalogue, &file))
    }

    /// The dispatcher's settings.
    pub fn dispatch(&self) -> crate::dispatch::DispatchConfig {
        crate::dispatch::DispatchConfig {
            max_attempts: self.limits.max_attempts,
            job_timeout_ms: self.job_timeout_ms,
            job_lease_ms: self.job_lease_ms,
            replica_id: self.replica_id.clone().unwrap_or_default(),
        }
    }

    /// The node link's settings.
    pub fn link(&self) -> crate::link::LinkConfig {
        crate::link::LinkConfig {
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            heartbeat_timeout_ms: self.heartbeat_timeout_ms,
            handshake_timeout_ms: self.handshake_timeout_ms,
            max_node_connections: self.limits.max_node_connections,
            sources: self.node_sources.clone(),
            replica_id: self.replica_id.clone().unwrap_or_default(),
            drain_timeout_ms: self.drain_timeout_ms,
        }
    }

    /// The HTTP listener's limits.
    pub fn http(&self) -> crate::http::HttpConfig {
        crate::http::HttpConfig {
            max_connections: self.limits.max_connections,
            request_timeout_ms: self.limits.request_timeout_ms,
            max_body_bytes: self.limits.max_http_body_bytes,
            max_in_flight: self.limits.max_http_in_flight,
        }
    }

    /// The ledger's settings, with the audit window it holds pay for.
    pub fn ledger_config(&self) -> crate::ledger::LedgerConfig {
        crate::ledger::LedgerConfig {
            audit_window_ms: self.audit.window_ms.max(0),
            ..self.ledger.clone()
        }
    }

    /// Defaults, then `file` (if given), then every `MLXNET__SECTION__KEY` in
    /// `env` (e.g. `MLXNET__LIMITS__MAX_TOKENS=512`, `MLXNET__GRPC_ADDR=...`),
    /// read as `mlxnet_proto::env` reads every binary's. Other variables are
    /// ignored.
    pub fn load<I, K, V>(file: Option<&Path>, env: I) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading config file {}", path.display()))?;
                text.parse::<toml::Table>()
                    .with_context(|| format!("parsing config file {}", path.display()))?
            }
            None => toml::Table::new(),
        };
        let env = mlxnet_proto::env::overrides::<CoordinatorConfig, _, _, _>(ENV_PREFIX, env)?;
        mlxnet_proto::env::merge(&mut table, env);
        let config: CoordinatorConfig = toml::Value::Table(table)
            .try_into()
            .context("invalid coordinator configuration")?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: digests are 32 bytes of hex, timeouts sane.
    pub fn validate(&self) -> anyhow::Result<()> {
        for m in &self.catalogue {
            let bytes = hex::decode(&m.sha256)
                .with_context(|| format!("catalogue model {}: sha256 is not hex", m.id))?;
            anyhow::ensure!(
                bytes.len() == 32,
                "catalogue model {}: sha256 must be 32 bytes",
                m.id
            );
        }
        anyhow::ensure!(
            self.heartbeat_interval_ms > 0
                && self.heartbeat_timeout_ms > self.heartbeat_interval_ms,
            "heartbeat_timeout_ms must exceed heartbeat_interval_ms (> 0)"
        );
        anyhow::ensure!(
            self.ledger.fee_bps <= 10_000,
            "ledger.fee_bps must be at most 10000 (100%)"
        );
        anyhow::ensure!(
            self.ledger.hold_ttl_ms > 0 && self.ledger.sweep_interval_ms > 0,
            "ledger.hold_ttl_ms and ledger.sweep_interval_ms must be positive"
        );
        anyhow::ensure!(
            self.replica_id
                .as_deref()
                .is_none_or(|r| !r.is_empty() && r.len() <= 128),
            "replica_id must be 1 to 128 characters"
        );
        anyhow::ensure!(
            self.limits.max_attempts >= 1,
            "limits.max_attempts must be >= 1"
        );
        anyhow::ensure!(
            self.limits.default_max_tokens >= 1
                && self.limits.default_max_tokens <= self.limits.max_tokens,
            "limits.default_max_tokens must be in 1..=limits.max_tokens"
        );
        anyhow::ensure!(
            self.limits.max_in_flight_requests >= 1
                && self.limits.max_public_in_flight >= 1
                && self.limits.max_key_lookups_in_flight >= 1
                && self.limits.max_connections >= 1
                && self.limits.max_http_in_flight >= 1
                && self.limits.max_node_connections >= 1
                && self.limits.request_timeout_ms >= 1,
            "limits.max_in_flight_requests, max_public_in_flight, max_key_lookups_in_flight, \
             max_connections, \
             max_http_in_flight, max_node_connections and request_timeout_ms must be at least 1"
        );
        Ok(())
    }

    /// The database URL in effect: `database_url`, else `[store] url`,
    /// else the SQLite file in the data directory.
    pub fn database_url(&self) -> String {
        self.database_url
            .clone()
            .or_else(|| self.store.url.clone())
            .unwrap_or_else(|| {
                format!(
                    "sqlite://{}",
                    self.data_dir.join("coordinator.db").display()
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_then_file_then_env() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "data_dir = \"/srv/mlx\"\ngrpc_addr = \"127.0.0.1:9000\"\n[limits]\nmax_tokens = 1000\n",
        )
        .unwrap();
        let env = [
            ("MLXNET__LIMITS__MAX_TOKENS", "2000"),
            ("MLXNET__HTTP_ADDR", "127.0.0.1:9080"),
            ("PATH", "/bin"),
        ];
        let c = CoordinatorConfig::load(Some(&file), env).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/srv/mlx"));
        assert_eq!(c.grpc_addr, "127.0.0.1:9000".parse().unwrap());
        assert_eq!(c.http_addr, "127.0.0.1:9080".parse().unwrap());
        assert_eq!(c.limits.max_tokens, 2000, "env overrides file");
        assert_eq!(c.limits.max_attempts, Limits::default().max_attempts);
        assert_eq!(c.catalogue, vec![smollm2_135m_instruct()]);
    }

    #[test]
    fn the_store_section_picks_the_database_and_sizes_the_pool() {
        let env = [
            ("MLXNET__STORE__URL", "postgres://mlx@db:5432/mlx"),
            ("MLXNET__STORE__MAX_CONNECTIONS", "40"),
            ("MLXNET__STORE__STATEMENT_TIMEOUT_MS", "2500"),
        ];
        let c = CoordinatorConfig::load(None, env).unwrap();
        assert_eq!(c.database_url(), "postgres://mlx@db:5432/mlx");
        assert_eq!(
            (c.store.max_connections, c.store.statement_timeout_ms),
            (40, 2500)
        );
        let mut c = CoordinatorConfig::load(None, env).unwrap();
        c.database_url = Some("sqlite:///srv/x.db".into());
        assert_eq!(c.database_url(), "sqlite:///srv/x.db", "database_url wins");
        let c = CoordinatorConfig::for_data_dir("/srv/mlx".into());
        assert_eq!(c.database_url(), "sqlite:///srv/mlx/coordinator.db");
    }

    #[test]
    fn bad_values_are_reported_not_ignored() {
        let err =
            CoordinatorConfig::load(None, [("MLXNET__LIMITS__MAX_TOKENS", "lots")]).unwrap_err();
        assert!(format!("{err:#}").contains("max_tokens"), "{err:#}");
        let err = CoordinatorConfig::load(None, [("MLXNET__NO_SUCH_FIELD", "1")]).unwrap_err();
        assert!(format!("{err:#}").contains("no_such_field"), "{err:#}");
    }

    #[test]
    fn database_url_is_redacted_in_debug() {
        let mut c = CoordinatorConfig::for_data_dir("/tmp/x".into());
        c.database_url = Some("postgres://u:hunter2@db/mlx".into());
        c.store.url = Some("postgres://u:swordfish@db/mlx".into());
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("swordfish"));
        assert_eq!(c.grpc_addr.port(), 0);
    }
}
