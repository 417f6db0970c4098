//! `mlx-node`: the node agent (`run`) and its tools (`id`, `hardware`,
//! `generate`, `bench`, `earnings`). Parses flags, loads the layered config, calls the
//! library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use mlx_node::{
    app::Node,
    config::{ConfigLayer, ModelEntry, NodeConfig, PodSettings},
    engine::cli::{self as engine_cli, BenchArgs, GenerateArgs},
    hardware,
    identity::Identity,
    models::cli::{self as models_cli, ModelsCommand},
    pod::runtime::Parallelism,
};

#[derive(Parser)]
#[command(
    name = "mlx-node",
    version,
    about = "Lend this Mac to mlx-network and run inference jobs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Flags shared by the commands that read the node's configuration.
#[derive(clap::Args)]
struct ConfigArgs {
    /// TOML config file (keys as in `NodeConfig`; env `MLX_NODE__KEY` overrides it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where the node's identity key lives.
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: connect to the coordinator and serve jobs until Ctrl-C.
    Run {
        #[command(flatten)]
        config: ConfigArgs,
        /// Coordinator QUIC endpoint, host:port.
        #[arg(long)]
        coordinator: Option<String>,
        /// SHA-256 (hex) of the coordinator's certificate, as it prints on start.
        #[arg(long)]
        fingerprint: Option<String>,
        /// A model this node serves, as catalogue-id=path (repeatable).
        #[arg(long = "model", value_name = "ID=PATH")]
        models: Vec<ModelEntry>,
        /// Display name on the network.
        #[arg(long)]
        name: Option<String>,
        /// Jobs run at once.
        #[arg(long)]
        max_concurrent_jobs: Option<u32>,
        /// Compute threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Join a pod: its MLX hostfile (JSON); the node serves its one
        /// model across the pod.
        #[arg(long, value_name = "HOSTFILE")]
        pod: Option<PathBuf>,
        /// This node's rank in the pod (0 = leader).
        #[arg(long, requires = "pod", default_value_t = 0)]
        rank: usize,
        /// Rank r listens on this port + r.
        #[arg(long, requires = "pod", default_value_t = 32323)]
        pod_port: u16,
        /// auto (tensor over RDMA, pipeline over TCP), tensor or pipeline.
        #[arg(long, requires = "pod", default_value = "auto")]
        parallelism: Parallelism,
    },
    /// Print this node's id (creating its key on first use).
    Id {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Print this machine's hardware profile as JSON.
    Hardware,
    /// The node's model folder: pull catalogue models, list, remove, verify.
    Models {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(subcommand)]
        command: ModelsCommand,
    },
    /// Generate text from a model file (no network).
    Generate(GenerateArgs),
    /// Measure prefill and decode speed of a model file.
    Bench(BenchArgs),
    /// Show what the operator account earned: today, this week, all time,
    /// per node (jobs served, tokens produced).
    Earnings {
        #[command(flatten)]
        config: ConfigArgs,
        /// The coordinator's gRPC address (the client API).
        #[arg(
            long,
            env = "MLXNET_COORDINATOR",
            default_value = "http://127.0.0.1:7070"
        )]
        grpc: String,
        /// An API key of the operator account (read scope).
        #[arg(long, env = "MLXNET_API_KEY", hide_env_values = true)]
        api_key: String,
    },
    /// Check this machine's RDMA devices and cabling against a pod config
    /// (MLX hostfile JSON).
    Doctor {
        /// The pod config (MLX hostfile).
        #[arg(long)]
        pod: PathBuf,
        /// This machine's rank in it.
        #[arg(long, default_value_t = 0)]
        rank: usize,
    },
}

fn load_config(args: &ConfigArgs, mut flags: ConfigLayer) -> anyhow::Result<NodeConfig> {
    flags.data_dir = args.data_dir.clone().or(flags.data_dir);
    NodeConfig::load(args.config.as_deref(), std::env::vars(), flags)
        .context("loading the node configuration")
}

fn init_tracing() {
    init_tracing_at("info");
}

/// Logs to stderr at `level` unless `RUST_LOG` says otherwise.
fn init_tracing_at(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            config,
            coordinator,
            fingerprint,
            models,
            name,
            max_concurrent_jobs,
            threads,
            pod,
            rank,
            pod_port,
            parallelism,
        } => {
            let flags = ConfigLayer {
                pod: pod.map(|hostfile| PodSettings {
                    hostfile,
                    rank,
                    port: pod_port,
                    parallelism,
                    memory_limit_bytes: None,
                    max_context: None,
                    speed: None,
                }),
                coordinator,
                coordinator_fingerprint: fingerprint,
                models: (!models.is_empty()).then_some(models),
                name,
                max_concurrent_jobs,
                threads,
                ..ConfigLayer::default()
            };
            let config = load_config(&config, flags)?;
            init_tracing();
            // Before any thread exists: sets candle's compute thread count.
            engine_cli::set_threads(config.threads)?;
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(async {
                let node = Node::build(config).await.context("starting the node")?;
                println!("node {}", node.node_id());
                node.run_until_stopped().await?;
                anyhow::Ok(())
            })
        }
        Command::Id { config } => {
            let config = load_config(&config, ConfigLayer::default())?;
            let identity = Identity::load_or_create(&config.data_dir)?;
            println!("{}", identity.node_id());
            Ok(())
        }
        Command::Hardware => {
            let profile = hardware::detect().context("profiling the hardware")?;
            println!(
                "{}",
                serde_json::to_string_pretty(&hardware::to_json(&profile))?
            );
            Ok(())
        }
        Command::Earnings {
            config,
            grpc,
            api_key,
        } => {
            let config = load_config(&config, ConfigLayer::default())?;
            let this = Identity::load_or_create(&config.data_dir)?
                .node_id()
                .to_string();
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let report = runtime.block_on(mlx_node::earnings::fetch(&grpc, &api_key))?;
            print!("{}", mlx_node::earnings::render(&report, &this));
            Ok(())
        }
        Command::Models { config, command } => {
            let config = load_config(&config, ConfigLayer::default())?;
            // On a terminal the progress bar speaks; logs would draw over it.
            use std::io::IsTerminal;
            init_tracing_at(if std::io::stderr().is_terminal() {
                "warn"
            } else {
                "info"
            });
            models_cli::run(&config, command)
        }
        Command::Generate(args) => engine_cli::generate(args),
        Command::Bench(args) => engine_cli::bench(args),
        Command::Doctor { pod, rank } => {
            let config = std::fs::read_to_string(&pod)
                .with_context(|| format!("reading {}", pod.display()))?;
            let devinfo = std::process::Command::new("ibv_devinfo")
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            for line in mlx_node::pod::doctor::report(&config, rank, devinfo.as_deref())? {
                println!("{line}");
            }
            // What the run-time verbs binding itself sees.
            println!("{}", mlx_node::collectives::ibverbs::probe());
            Ok(())
        }
    }
}
