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
}

#[derive(Subcommand)]
enum CatalogueAction {
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
    if let Some(Command::Catalogue { file, action }) = args.command {
        return catalogue_command(&config, file, action);
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

/// `mlxnet-coordinator catalogue ...`: edits the catalogue file (a running
/// coordinator reads it at its next start).
fn catalogue_command(
    config: &CoordinatorConfig,
    path_flag: Option<PathBuf>,
    action: CatalogueAction,
) -> anyhow::Result<()> {
    use mlxnet_coordinator::catalogue::file;
    let (path, named) = match path_flag {
        Some(p) => (p, true),
        None => config.catalogue_path(),
    };
    match action {
        CatalogueAction::List => {
            let models = config.catalogue_models()?;
            mlxnet_coordinator::catalogue::Catalogue::new(&models)?;
            let from_file = file::read(&path, !named)?;
            for m in &models {
                let from = if from_file.get(&m.id).is_some() {
                    "file"
                } else {
                    "config"
                };
                println!(
                    "{:<28} {:<10} {:>10} bytes  sha256 {}  ({from})",
                    m.id, m.architecture, m.size_bytes, m.sha256
                );
            }
            eprintln!("catalogue file: {}", path.display());
        }
        CatalogueAction::Add { entries, replace } => {
            let text = std::fs::read_to_string(&entries)
                .with_context(|| format!("reading {}", entries.display()))?;
            let new = mlxnet_proto::catalogue::Catalogue::parse(&text)
                .with_context(|| format!("{} is not a valid catalogue", entries.display()))?;
            anyhow::ensure!(
                !new.models.is_empty(),
                "{} holds no [[model]] entry",
                entries.display()
            );
            let ids = file::add(&path, &new, replace)?;
            println!("added {} to {}", ids.join(", "), path.display());
            eprintln!("(the coordinator serves them from its next start)");
        }
        CatalogueAction::Remove { id } => {
            file::remove(&path, &id)?;
            println!("removed {id} from {}", path.display());
            eprintln!("(the coordinator stops offering it at its next start)");
        }
    }
    Ok(())
}
