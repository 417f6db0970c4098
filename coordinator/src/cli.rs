//! The `mlxnet-coordinator` command line: its flags and subcommands, and how
//! the flags override the loaded configuration.
//!
//! It lives in the library (not in `main.rs`) so that what deploys pass to
//! the binary can be checked against the real parser: the deploy manifests'
//! test parses every command line they give the coordinator with [`Cli`].
//!
//! # Invariants
//! - Flags are the last layer: defaults, then the file, then `MLXNET__*`
//!   environment variables ([`crate::config::CoordinatorConfig::load`]), then
//!   [`Cli::apply`].
//! - The process reads two kinds of environment variables: `MLXNET__*` (the
//!   configuration) and [`LOG_ENV`] (the log filter). Nothing else.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Parser, Subcommand};

use crate::config::CoordinatorConfig;

/// The environment variable holding the log filter (`tracing`'s
/// `EnvFilter` syntax, e.g. `info` or `mlxnet_coordinator=debug`).
pub const LOG_ENV: &str = "RUST_LOG";

/// The mlx-network coordinator.
#[derive(Debug, Parser)]
#[command(name = "mlxnet-coordinator", version, about)]
pub struct Cli {
    /// TOML config file (then MLXNET__SECTION__KEY env vars, then these flags).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The data directory: the node-link certificate (`cert.der`,
    /// `key.der`), the SQLite file when no database URL is given, the
    /// catalogue file.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[arg(long)]
    pub grpc_addr: Option<SocketAddr>,
    #[arg(long)]
    pub quic_addr: Option<SocketAddr>,
    #[arg(long)]
    pub http_addr: Option<SocketAddr>,
    /// `sqlite://PATH` or `postgres://USER:PASSWORD@HOST:PORT/DB` (default:
    /// the SQLite file in the data directory).
    #[arg(long)]
    pub database_url: Option<String>,
    /// This replica's name among those sharing the database (default: a
    /// random one kept in the data directory's `replica-id` file).
    #[arg(long)]
    pub replica_id: Option<String>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create an admin account in the coordinator's database and print its
    /// API key (once). How a new network gets its first key; works while the
    /// coordinator runs.
    AdminKey {
        /// Name of the new admin account.
        #[arg(long, default_value = "admin")]
        name: String,
    },
    /// The catalogue file (the models the coordinator adds to its configured
    /// ones at start; format of `proto/catalogue.toml`).
    Catalogue {
        /// The file. Default: `catalogue_file` of the config, else
        /// `<data dir>/catalogue.toml`.
        #[arg(long)]
        file: Option<PathBuf>,
        #[command(subcommand)]
        action: CatalogueAction,
    },
    /// Create the node-link certificate in the data directory if it is
    /// absent, and print its fingerprint (what nodes pin). Replicas that
    /// share one certificate (copied or mounted into each data directory)
    /// are pinned by the same fingerprint.
    Certificate {
        /// Also write the fingerprint (one line) to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum CatalogueAction {
    /// Every model jobs may name: the configured ones and the file's.
    List,
    /// Adds the models of a catalogue TOML (what `mlx-node models describe`
    /// prints) to the file; all or none.
    Add {
        /// A catalogue TOML with one or more `[[model]]` entries.
        entries: PathBuf,
        /// Replace an entry of the same id.
        #[arg(long)]
        replace: bool,
    },
    /// Removes a model from the file.
    Remove { id: String },
}

impl Cli {
    /// Overrides `config` with the flags given.
    pub fn apply(&self, config: &mut CoordinatorConfig) {
        if let Some(d) = &self.data_dir {
            config.data_dir = d.clone();
        }
        if let Some(a) = self.grpc_addr {
            config.grpc_addr = a;
        }
        if let Some(a) = self.quic_addr {
            config.quic_addr = a;
        }
        if let Some(a) = self.http_addr {
            config.http_addr = a;
        }
        if let Some(url) = &self.database_url {
            config.database_url = Some(url.clone());
        }
        if let Some(id) = &self.replica_id {
            config.replica_id = Some(id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_loaded_config() {
        let cli = Cli::try_parse_from([
            "mlxnet-coordinator",
            "--data-dir",
            "/srv/mlx",
            "--quic-addr",
            "0.0.0.0:9071",
            "certificate",
            "--out",
            "/srv/mlx/fingerprint",
        ])
        .unwrap();
        let mut config =
            CoordinatorConfig::load(None, [("MLXNET__QUIC_ADDR", "0.0.0.0:8071")]).unwrap();
        cli.apply(&mut config);
        assert_eq!(config.data_dir, PathBuf::from("/srv/mlx"));
        assert_eq!(config.quic_addr.port(), 9071, "the flag wins over env");
        assert_eq!(config.grpc_addr.port(), 7070, "default kept");
        assert!(matches!(
            cli.command,
            Some(Command::Certificate { out: Some(_) })
        ));
        assert!(Cli::try_parse_from(["mlxnet-coordinator", "--no-such-flag"]).is_err());
    }
}
