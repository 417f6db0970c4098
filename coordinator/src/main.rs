//! `mlxnet-coordinator`: parse flags, load config, build, run; or, with
//! `admin-key`, create an admin account and print its first API key.
use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use mlxnet_coordinator::{app::Application, config::CoordinatorConfig};

/// The mlx-network coordinator.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// TOML config file (then MLXNET__SECTION__KEY env vars, then these flags).
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long)]
    grpc_addr: Option<SocketAddr>,
    #[arg(long)]
    quic_addr: Option<SocketAddr>,
    #[arg(long)]
    http_addr: Option<SocketAddr>,
    /// `sqlite://PATH` or `postgres://USER:PASSWORD@HOST:PORT/DB` (default:
    /// the SQLite file in the data directory).
    #[arg(long)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Create an admin account in the coordinator's database and print its
    /// API key (once). How a new network gets its first key; works while the
    /// coordinator runs.
    AdminKey {
        /// Name of the new admin account.
        #[arg(long, default_value = "admin")]
        name: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut config = CoordinatorConfig::load(args.config.as_deref(), std::env::vars())?;
    if let Some(d) = args.data_dir {
        config.data_dir = d;
    }
    if let Some(a) = args.grpc_addr {
        config.grpc_addr = a;
    }
    if let Some(a) = args.quic_addr {
        config.quic_addr = a;
    }
    if let Some(a) = args.http_addr {
        config.http_addr = a;
    }
    if let Some(url) = args.database_url {
        config.database_url = Some(url);
    }
    if let Some(Command::AdminKey { name }) = args.command {
        let key = mlxnet_coordinator::app::bootstrap_admin_key(&config, &name)
            .await
            .context("creating the admin key")?;
        println!("account {}", key.account_id);
        println!("key id  {}", key.id);
        println!("api key {}", key.secret());
        eprintln!("(the key is shown this once; only its hash is kept)");
        return Ok(());
    }
    let app = Application::build(config)
        .await
        .context("starting the coordinator")?;
    println!("grpc {}", app.grpc_addr());
    println!(
        "quic {} fingerprint {}",
        app.quic_addr(),
        app.cert_fingerprint()
    );
    println!("http {}", app.http_addr());
    app.run_until_stopped()
        .await
        .context("coordinator stopped with an error")?;
    Ok(())
}
