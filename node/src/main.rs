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
    service,
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
        /// Coordinator QUIC endpoint, host:port. Repeat it (or separate
        /// with commas) for the replicas of one coordinator: the node links
        /// to one and moves to another when it goes away or drains.
        #[arg(long, value_name = "HOST:PORT")]
        coordinator: Vec<String>,
        /// SHA-256 (hex) of the coordinator's certificate, as it prints on
        /// start (`mlxnet-coordinator certificate`). Repeat it (or separate
        /// with commas) when the replicas do not share one certificate.
        #[arg(long, value_name = "HEX")]
        fingerprint: Vec<String>,
        /// A model this node serves, as catalogue-id=path (repeatable).
        #[arg(long = "model", value_name = "ID=PATH")]
        models: Vec<ModelEntry>,
        /// Display name on the network.
        #[arg(long)]
        name: Option<String>,
        /// Jobs run at once (default: the batch's slots).
        #[arg(long)]
        max_concurrent_jobs: Option<u32>,
        /// Sequences one batched step runs (default: from `bench --batch --save`, else 8).
        #[arg(long)]
        batch_slots: Option<u32>,
        /// Bytes of KV cache for all models (default: a quarter of free memory, at most 4 GiB).
        #[arg(long)]
        kv_cache_bytes: Option<u64>,
        /// Compute threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Where the engine computes: auto, cpu, metal or cuda.
        #[arg(long)]
        device: Option<mlx_node::engine::device::DeviceChoice>,
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
    /// A live view of the running node: state and why, the job running and
    /// its tokens/s, models held, work and energy, earnings (Ctrl-C quits).
    Status {
        #[command(flatten)]
        config: ConfigArgs,
        /// The coordinator's gRPC address (the client API), for earnings.
        #[arg(
            long,
            env = "MLXNET_COORDINATOR",
            default_value = "http://127.0.0.1:7070"
        )]
        grpc: String,
        /// An API key of the operator account (read scope), for earnings.
        #[arg(long, env = "MLXNET_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Print one frame and exit.
        #[arg(long)]
        once: bool,
    },
    /// Run the node as a service of your session (launchd on macOS, systemd
    /// on Linux), written from its config.
    Service {
        #[command(subcommand)]
        action: ServiceCommand,
    },
    /// Say what this machine lacks to lend well (macOS version, RDMA,
    /// Thunderbolt 5, GPU build, energy meter, lending signals), and with
    /// --pod its RDMA devices and cabling against a pod config.
    Doctor {
        #[command(flatten)]
        config: ConfigArgs,
        /// The pod config (MLX hostfile).
        #[arg(long)]
        pod: Option<PathBuf>,
        /// This machine's rank in it.
        #[arg(long, default_value_t = 0)]
        rank: usize,
    },
    /// Pods of Macs cabled together.
    Pod {
        #[command(subcommand)]
        action: PodCommand,
    },
}

#[derive(Subcommand)]
enum PodCommand {
    /// Run on every Mac of the pod at once: they find each other (mDNS),
    /// check the cabling, write the same MLX hostfile, measure each link.
    Setup {
        #[command(flatten)]
        config: ConfigArgs,
        /// How many Macs the pod has (this one included).
        #[arg(long)]
        members: usize,
        /// Where to write the hostfile.
        #[arg(long, default_value = "hostfile.json")]
        output: PathBuf,
        /// Rank r's data plane listens on this port + r.
        #[arg(long, default_value_t = 32323)]
        port: u16,
        /// Give up after this many seconds without all members.
        #[arg(long, default_value_t = 120)]
        timeout_s: u64,
        /// Refuse a pod that cannot use RDMA (every pair cabled, RDMA on).
        #[arg(long)]
        rdma: bool,
        /// Configure this Mac's Thunderbolt interfaces (sudo -n).
        #[arg(long)]
        apply: bool,
        /// Skip the link measurement.
        #[arg(long)]
        no_measure: bool,
        /// This Mac's LAN address (default: the one its default route uses).
        #[arg(long)]
        ip: Option<String>,
    },
}

#[derive(Subcommand)]
enum ServiceCommand {
    /// Write the unit and (unless --no-activate) load and start it.
    Install {
        #[command(flatten)]
        config: ConfigArgs,
        /// Only write the unit file.
        #[arg(long)]
        no_activate: bool,
    },
    /// Stop the service and remove its unit.
    Uninstall {
        #[command(flatten)]
        config: ConfigArgs,
        /// Only remove the unit file.
        #[arg(long)]
        no_activate: bool,
    },
    /// Start the installed service.
    Start,
    /// Stop it (it drains: running jobs hand off).
    Stop,
    /// What the service manager says about it.
    Status,
    /// Print the unit `install` would write; `--deploy DIR` writes the
    /// repository's example units into DIR instead.
    Print {
        #[command(flatten)]
        config: ConfigArgs,
        #[arg(long)]
        deploy: Option<PathBuf>,
        /// Print the launchd agent (what `install` writes on a Mac) on any system.
        #[arg(long)]
        launchd: bool,
    },
}

/// `file` made absolute, or the error that says the service needs it.
fn existing_config(file: &std::path::Path) -> anyhow::Result<PathBuf> {
    std::fs::canonicalize(file).with_context(|| {
        format!(
            "the service runs `mlx-node run --config {}`: write that config first (or pass --config)",
            file.display()
        )
    })
}

/// The service spec for this binary and config: the config file is
/// `--config`, else `<data dir>/node.toml`, and must exist.
fn service_spec(args: &ConfigArgs) -> anyhow::Result<(service::ServiceSpec, service::Paths)> {
    // An explicit --config that is missing is named as such, before
    // loading it reports a bare read error.
    let explicit = args.config.as_deref().map(existing_config).transpose()?;
    let config = load_config(args, ConfigLayer::default())?;
    let file = match explicit {
        Some(file) => file,
        None => existing_config(&config.data_dir.join("node.toml"))?,
    };
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating {}", config.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&config.data_dir)?;
    let binary = std::fs::canonicalize(std::env::current_exe()?)?;
    let spec = service::ServiceSpec::new(binary, file, data_dir, config.mode)?;
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .ok_or(service::ServiceError::NoHome)?;
    let xdg = std::env::var_os("XDG_CONFIG_HOME").map(PathBuf::from);
    Ok((spec, service::paths(&home, xdg.as_deref())))
}

fn service_command(cmd: ServiceCommand) -> anyhow::Result<()> {
    use service::Action;
    let (action, args, activate) = match cmd {
        ServiceCommand::Install {
            config,
            no_activate,
        } => (Action::Install, Some(config), !no_activate),
        ServiceCommand::Uninstall {
            config,
            no_activate,
        } => (Action::Uninstall, Some(config), !no_activate),
        ServiceCommand::Start => (Action::Start, None, true),
        ServiceCommand::Stop => (Action::Stop, None, true),
        ServiceCommand::Status => (Action::Status, None, true),
        ServiceCommand::Print {
            deploy: Some(dir), ..
        } => {
            for (rel, text) in service::deploy_units()? {
                let rel = rel.strip_prefix("deploy/").unwrap_or(rel);
                let path = dir.join(rel);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
            return Ok(());
        }
        ServiceCommand::Print {
            config,
            deploy: None,
            launchd,
        } => {
            let (spec, mut paths) = service_spec(&config)?;
            if launchd && paths.logs.is_none() {
                let home = std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .ok_or(service::ServiceError::NoHome)?;
                paths.logs = Some(home.join("Library/Logs/mlx-node"));
            }
            print!("{}", service::unit_text(&spec, &paths)?);
            return Ok(());
        }
    };
    let (spec, paths) = match &args {
        Some(a) => service_spec(a)?,
        // start/stop/status need no config: a placeholder spec.
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .ok_or(service::ServiceError::NoHome)?;
            let xdg = std::env::var_os("XDG_CONFIG_HOME").map(PathBuf::from);
            let spec = service::ServiceSpec::new(
                std::fs::canonicalize(std::env::current_exe()?)?,
                home.join(".mlx-node/node.toml"),
                home.join(".mlx-node"),
                mlx_node::config::NodeMode::Dedicated,
            )?;
            (spec, service::paths(&home, xdg.as_deref()))
        }
    };
    print!("{}", service::apply(action, &spec, &paths, activate)?);
    Ok(())
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
            batch_slots,
            kv_cache_bytes,
            threads,
            device,
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
                coordinator: (!coordinator.is_empty()).then(|| coordinator.into()),
                coordinator_fingerprint: (!fingerprint.is_empty()).then(|| fingerprint.into()),
                models: (!models.is_empty()).then_some(models),
                name,
                max_concurrent_jobs,
                batch_slots,
                kv_cache_bytes,
                threads,
                device,
                ..ConfigLayer::default()
            };
            let config = load_config(&config, flags)?;
            init_tracing();
            // Before any thread exists: sets candle's compute thread count.
            engine_cli::set_threads(config.effective_threads())?;
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(async {
                let node = Node::build(config).await.context("starting the node")?;
                println!("node {}", node.node_id());
                // Once registered: what this machine serves, how fast, and
                // what it could earn at the network's prices and demand
                // (the coordinator's Welcome).
                let mut link = node.link_status();
                let board = node.board();
                let hardware = node.hardware().clone();
                tokio::spawn(async move {
                    if link
                        .wait_for(|s| matches!(s, mlx_node::link::LinkStatus::Registered { .. }))
                        .await
                        .is_ok()
                    {
                        let summary =
                            mlx_node::status::first_run_summary(&board.snapshot(), &hardware);
                        println!("{summary}");
                    }
                });
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
        Command::Status {
            config,
            grpc,
            api_key,
            once,
        } => {
            let config = load_config(&config, ConfigLayer::default())?;
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(mlx_node::status::run_view(mlx_node::status::ViewArgs {
                data_dir: config.data_dir,
                grpc,
                api_key,
                price_micro_per_kwh: config.energy.price_micro_mlx_per_kwh,
                once,
            }))?;
            Ok(())
        }
        Command::Service { action } => service_command(action),
        Command::Generate(args) => engine_cli::generate(args),
        Command::Bench(args) => engine_cli::bench(args),
        Command::Pod {
            action:
                PodCommand::Setup {
                    config,
                    members,
                    output,
                    port,
                    timeout_s,
                    rdma,
                    apply,
                    no_measure,
                    ip,
                },
        } => {
            use mlx_node::pod::setup;
            let config = load_config(&config, ConfigLayer::default())?;
            let id = Identity::load_or_create(&config.data_dir)?.node_id();
            let me = setup::this_member(
                &id.to_string(),
                &setup::host_name(),
                &ip.unwrap_or_else(setup::lan_ip),
            );
            let lines = setup::run(&setup::SetupArgs {
                me,
                members,
                timeout: std::time::Duration::from_secs(timeout_s),
                port,
                output,
                require_rdma: rdma,
                apply,
                measure: !no_measure,
            })?;
            for l in lines {
                println!("{l}");
            }
            Ok(())
        }
        Command::Doctor { config, pod, rank } => {
            let node_config = load_config(&config, ConfigLayer::default())?;
            for line in mlx_node::doctor::report(&mlx_node::doctor::gather(&node_config)) {
                println!("{line}");
            }
            let Some(pod) = pod else { return Ok(()) };
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
