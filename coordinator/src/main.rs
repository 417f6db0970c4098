//! `mlxnet-coordinator`: parse flags, load config, build, run; or, with
//! `admin-key`, create an admin account and print its first API key; with
//! `certificate`, create the node-link certificate and print its fingerprint.
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use mlxnet_coordinator::{
    app::Application,
    cli::{CatalogueAction, Cli, Command, LOG_ENV},
    config::CoordinatorConfig,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Cli::parse();
    let mut config = CoordinatorConfig::load(args.config.as_deref(), std::env::vars())?;
    args.apply(&mut config);
    if let Some(Command::Certificate { out }) = &args.command {
        let fingerprint = mlxnet_coordinator::app::certificate(&config)
            .context("loading or creating the node-link certificate")?;
        if let Some(path) = out {
            std::fs::write(path, format!("{fingerprint}\n"))
                .with_context(|| format!("writing {}", path.display()))?;
        }
        println!("{fingerprint}");
        return Ok(());
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
