//! The deploy files (`deploy/Dockerfile`, `deploy/compose.yaml`,
//! `deploy/kubernetes/`) checked against the coordinator they deploy.
//!
//! Every port, probe path, environment variable, flag, secret and file they
//! name must be one the coordinator really has: the command lines go through
//! the binary's parser ([`Cli`]), the environment through
//! [`CoordinatorConfig::load`] (which refuses unknown `MLXNET__*` keys), the
//! ports are compared with the config that results, and the probe paths are
//! asked of a running coordinator. Nothing here needs docker or kubectl.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use clap::Parser;
use serde::Deserialize;

use crate::{
    cli::{Cli, Command, LOG_ENV},
    config::{CoordinatorConfig, ENV_PREFIX},
    link::tls::{CERT_FILE, KEY_FILE},
};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

// ---------------------------------------------------------------- Dockerfile

/// The Dockerfile's stages in order, by name, with their instructions (one
/// logical line each, continuations joined).
struct Dockerfile {
    stages: Vec<(String, Vec<String>)>,
}

impl Dockerfile {
    fn parse(text: &str) -> Self {
        let mut logical = Vec::new();
        let mut cur = String::new();
        for line in text.lines() {
            let t = line.trim();
            if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
                continue;
            }
            match t.strip_suffix('\\') {
                Some(head) => {
                    cur.push_str(head);
                    cur.push(' ');
                }
                None => {
                    cur.push_str(t);
                    logical.push(std::mem::take(&mut cur));
                }
            }
        }
        let mut stages: Vec<(String, Vec<String>)> = Vec::new();
        for l in logical {
            let words: Vec<&str> = l.split_whitespace().collect();
            if words[0] == "FROM" {
                assert!(
                    words.len() == 4 && words[2] == "AS",
                    "every stage is named: {l}"
                );
                let name = words[3].to_owned();
                assert!(stages.iter().all(|(n, _)| *n != name), "{name} twice");
                stages.push((name, vec![]));
            } else {
                stages.last_mut().expect("FROM first").1.push(l);
            }
        }
        Self { stages }
    }

    fn stage(&self, name: &str) -> &[String] {
        self.stages
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, lines)| lines.as_slice())
            .unwrap_or_else(|| panic!("the Dockerfile has no stage {name}"))
    }

    /// The JSON-array argument of `instruction` in `stage`.
    fn exec_form(&self, stage: &str, instruction: &str) -> Vec<String> {
        let line = self
            .stage(stage)
            .iter()
            .find_map(|l| l.strip_prefix(instruction))
            .unwrap_or_else(|| panic!("stage {stage} has no {instruction}"));
        serde_json::from_str(line.trim())
            .unwrap_or_else(|e| panic!("{instruction} of {stage} is not an exec-form array: {e}"))
    }
}

/// The binaries of the workspace's published packages (`publish = false`
/// marks the test and simulator crates), as (package, binary).
fn published_binaries() -> Vec<(String, String)> {
    #[derive(Deserialize)]
    struct Workspace {
        workspace: Members,
    }
    #[derive(Deserialize)]
    struct Members {
        members: Vec<String>,
    }
    #[derive(Deserialize)]
    struct Manifest {
        package: Package,
        #[serde(default)]
        bin: Vec<Bin>,
    }
    #[derive(Deserialize)]
    struct Package {
        name: String,
        publish: Option<bool>,
    }
    #[derive(Deserialize)]
    struct Bin {
        name: String,
    }
    let ws: Workspace = toml::from_str(&read("Cargo.toml")).unwrap();
    let mut out = Vec::new();
    for member in ws.workspace.members {
        let m: Manifest = toml::from_str(&read(&format!("{member}/Cargo.toml"))).unwrap();
        if m.package.publish == Some(false) {
            continue;
        }
        for b in m.bin {
            out.push((m.package.name.clone(), b.name));
        }
    }
    out
}

// ---------------------------------------------------------------- the coordinator's side

/// The config a coordinator container ends up with: defaults, then its
/// environment, then its command line. Panics (failing the test) on an
/// environment variable the coordinator does not read or a flag it does not
/// have.
fn coordinator_config(env: &BTreeMap<String, String>, argv: &[String]) -> (CoordinatorConfig, Cli) {
    for name in env.keys() {
        assert!(
            name.starts_with(ENV_PREFIX) || name == LOG_ENV,
            "the coordinator does not read the environment variable {name}"
        );
    }
    let mut config = CoordinatorConfig::load(None, env.iter())
        .unwrap_or_else(|e| panic!("the coordinator refuses this environment: {e:#}"));
    let cli = Cli::try_parse_from(argv)
        .unwrap_or_else(|e| panic!("the coordinator refuses {argv:?}: {e}"));
    cli.apply(&mut config);
    (config, cli)
}

/// (port, protocol) of each listener `config` binds.
fn listeners(config: &CoordinatorConfig) -> BTreeSet<(u16, &'static str)> {
    [
        (config.grpc_addr.port(), "tcp"),
        (config.quic_addr.port(), "udp"),
        (config.http_addr.port(), "tcp"),
    ]
    .into()
}

/// The argv the image's entrypoint makes of a container's arguments.
fn argv(docker: &Dockerfile, stage: &str, args: &[String]) -> Vec<String> {
    let mut v = docker.exec_form(stage, "ENTRYPOINT");
    v.extend(args.iter().cloned());
    v
}

// ---------------------------------------------------------------- compose

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Compose {
    name: String,
    services: BTreeMap<String, ComposeService>,
    volumes: BTreeMap<String, Option<serde_yaml_ng::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ComposeService {
    image: String,
    build: Option<ComposeBuild>,
    entrypoint: Option<Vec<String>>,
    command: Option<Vec<String>>,
    #[serde(default)]
    environment: BTreeMap<String, String>,
    #[serde(default)]
    ports: Vec<String>,
    #[serde(default)]
    volumes: Vec<String>,
    #[serde(default)]
    depends_on: BTreeMap<String, DependsOn>,
    healthcheck: Option<ComposeHealthcheck>,
    restart: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ComposeBuild {
    context: String,
    dockerfile: String,
    target: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ComposeHealthcheck {
    test: Vec<String>,
    interval: String,
    timeout: String,
    retries: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DependsOn {
    condition: String,
}

impl ComposeService {
    /// `volume:/path[:ro]` entries as (volume, path).
    fn mounts(&self) -> Vec<(&str, &str)> {
        self.volumes
            .iter()
            .map(|v| {
                let mut parts = v.split(':');
                let (Some(src), Some(dst)) = (parts.next(), parts.next()) else {
                    panic!("volume entry {v:?} is not SOURCE:PATH");
                };
                (src, dst)
            })
            .collect()
    }

    /// The named volume mounted at `path`, if any.
    fn volume_at(&self, path: &Path) -> Option<&str> {
        self.mounts()
            .into_iter()
            .find(|(_, dst)| Path::new(dst) == path)
            .map(|(src, _)| src)
    }
}

#[test]
fn compose_runs_two_coordinator_replicas_on_postgres_and_a_node_with_what_they_read() {
    let docker = Dockerfile::parse(&read("deploy/Dockerfile"));
    let compose: Compose = serde_yaml_ng::from_str(&read("deploy/compose.yaml")).unwrap();
    assert_eq!(compose.name, "mlxnet");
    let services = &compose.services;
    let service = |name: &str| {
        services
            .get(name)
            .unwrap_or_else(|| panic!("compose has no service {name}"))
    };

    // Each build names a stage of the Dockerfile, from the repository root.
    let mut built = BTreeMap::new();
    for (name, s) in services {
        if let Some(b) = &s.build {
            assert_eq!(
                (b.context.as_str(), b.dockerfile.as_str()),
                ("..", "deploy/Dockerfile"),
                "{name}"
            );
            docker.stage(&b.target);
            built.insert(s.image.clone(), b.target.clone());
        }
        for (v, _) in s.mounts() {
            assert!(
                v.starts_with('.') || compose.volumes.contains_key(v),
                "{name} mounts undeclared volume {v}"
            );
        }
        for dep in s.depends_on.keys() {
            assert!(services.contains_key(dep), "{name} depends on {dep}");
        }
    }
    let coordinator_image = built
        .iter()
        .find(|(_, target)| *target == "coordinator")
        .map(|(image, _)| image.clone())
        .expect("a service builds the coordinator stage");

    // The database.
    let pg = service("postgres");
    assert!(pg.image.starts_with("postgres:"), "{}", pg.image);
    let check = pg
        .healthcheck
        .as_ref()
        .expect("replicas wait for postgres's health");
    assert_eq!(check.test[..2], ["CMD", "pg_isready"]);
    assert!(check.retries > 0 && !check.interval.is_empty() && !check.timeout.is_empty());
    let pg_env = |k: &str| {
        pg.environment
            .get(k)
            .unwrap_or_else(|| panic!("postgres has no {k}"))
            .clone()
    };
    let db_url = format!(
        "postgres://{}:{}@postgres:5432/{}",
        pg_env("POSTGRES_USER"),
        pg_env("POSTGRES_PASSWORD"),
        pg_env("POSTGRES_DB")
    );

    // The certificate, made once into the replicas' shared data directory.
    let cert = service("certificate");
    assert_eq!(cert.image, coordinator_image);
    let (cert_config, cert_cli) = coordinator_config(
        &cert.environment,
        &argv(
            &docker,
            "coordinator",
            cert.command.as_deref().unwrap_or(&[]),
        ),
    );
    let Some(Command::Certificate {
        out: Some(pin_file),
    }) = cert_cli.command
    else {
        panic!("the certificate service runs `certificate --out FILE`");
    };
    let cert_volume = cert
        .volume_at(&cert_config.data_dir)
        .expect("the certificate service's data directory is a volume")
        .to_owned();
    let pin_rel = pin_file
        .strip_prefix(&cert_config.data_dir)
        .expect("the pin file is written into the shared data directory")
        .to_path_buf();

    // The replicas: the server (no subcommand), on PostgreSQL, the shared
    // certificate, every listener published.
    let mut replicas = BTreeMap::new();
    let mut host_ports = BTreeSet::new();
    for (name, s) in services
        .iter()
        .filter(|(_, s)| s.image == coordinator_image)
    {
        if s.command.is_some() {
            continue;
        }
        assert!(
            s.entrypoint.is_none(),
            "{name} keeps the image's entrypoint"
        );
        assert!(s.restart.is_some(), "{name} restarts when it stops");
        let (config, cli) = coordinator_config(&s.environment, &argv(&docker, "coordinator", &[]));
        assert!(cli.command.is_none(), "{name} runs the server");
        let replica_id = config.replica_id.clone().expect("a replica id");
        assert!(
            replicas
                .values()
                .all(|r: &CoordinatorConfig| r.replica_id.as_ref() != Some(&replica_id)),
            "{name}: replica ids are distinct"
        );
        assert_eq!(
            config.database_url(),
            db_url,
            "{name} uses the postgres service"
        );
        assert_eq!(
            s.volume_at(&config.data_dir),
            Some(cert_volume.as_str()),
            "{name}'s data directory is the volume holding the certificate"
        );
        for (dep, condition) in [
            ("postgres", "service_healthy"),
            ("certificate", "service_completed_successfully"),
        ] {
            assert_eq!(
                s.depends_on.get(dep).map(|d| d.condition.as_str()),
                Some(condition),
                "{name} waits for {dep}"
            );
        }
        let mut published = BTreeSet::new();
        for p in &s.ports {
            let (host, rest) = p.split_once(':').expect("HOST:CONTAINER/PROTO");
            let (container, proto) = rest.split_once('/').expect("a protocol");
            assert!(
                host_ports.insert((host.to_owned(), proto.to_owned())),
                "{p} twice"
            );
            published.insert((container.parse::<u16>().unwrap(), proto));
        }
        let want: BTreeSet<(u16, &str)> = listeners(&config);
        assert_eq!(published, want, "{name} publishes exactly its listeners");
        replicas.insert(name.clone(), config);
    }
    assert!(
        replicas.len() >= 2,
        "at least two replicas: {:?}",
        replicas.keys()
    );

    // The node: dials a replica's QUIC port, pins the shared certificate.
    let node = service("node");
    assert_eq!(
        node.entrypoint.as_deref(),
        Some(&["sh".to_owned(), "-c".to_owned()][..])
    );
    let script = node.command.as_ref().expect("a command")[0].clone();
    let words: Vec<&str> = script.split_whitespace().collect();
    let flag = |f: &str| {
        let i = words
            .iter()
            .position(|w| *w == f)
            .unwrap_or_else(|| panic!("the node is run without {f}"));
        words[i + 1]
    };
    assert_eq!(&words[..3], ["exec", "mlx-node", "run"]);
    // Every replica's QUIC address, so the node moves when one goes away.
    let mut dialed = Vec::new();
    for addr in flag("--coordinator").split(',') {
        let (host, port) = addr.rsplit_once(':').unwrap();
        let replica = replicas
            .get(host)
            .unwrap_or_else(|| panic!("--coordinator {host} is not a replica"));
        assert_eq!(port.parse::<u16>().unwrap(), replica.quic_addr.port());
        dialed.push(host);
    }
    dialed.sort_unstable();
    let mut all: Vec<&str> = replicas.keys().map(String::as_str).collect();
    all.sort_unstable();
    assert_eq!(dialed, all, "the node is given every replica");
    let replica = &replicas[dialed[0]];
    let pin = script
        .split_once("--fingerprint \"$$(cat ")
        .and_then(|(_, rest)| rest.split_once(")\""))
        .map(|(file, _)| file)
        .expect("--fingerprint \"$$(cat FILE)\"");
    let (pin_volume, pin_dir) = node
        .mounts()
        .into_iter()
        .find(|(_, dst)| Path::new(pin).parent() == Some(Path::new(dst)))
        .expect("the pin file is on a mounted volume");
    assert_eq!(
        pin_volume, cert_volume,
        "the node reads the certificate's pin"
    );
    assert_eq!(Path::new(pin_dir).join(&pin_rel), Path::new(pin));
    let model = flag("--model").split_once('=').unwrap().0;
    assert!(
        replica.catalogue.iter().any(|m| m.id == model),
        "the node serves {model}, which is not in the coordinator's catalogue"
    );
}

// ---------------------------------------------------------------- Kubernetes

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Object {
    kind: String,
    metadata: Metadata,
    #[serde(default)]
    spec: serde_yaml_ng::Value,
    #[serde(default)]
    string_data: BTreeMap<String, String>,
    #[serde(default)]
    data: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
struct Metadata {
    #[serde(default)]
    name: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Selector {
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct DeploymentSpec {
    replicas: u32,
    selector: Selector,
    template: PodTemplate,
}

#[derive(Deserialize)]
struct PodTemplate {
    metadata: Metadata,
    spec: PodSpec,
}

#[derive(Deserialize)]
struct PodSpec {
    containers: Vec<Container>,
    #[serde(default)]
    volumes: Vec<Volume>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Container {
    name: String,
    command: Option<Vec<String>>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<EnvVar>,
    #[serde(default)]
    ports: Vec<ContainerPort>,
    readiness_probe: Option<Probe>,
    liveness_probe: Option<Probe>,
    #[serde(default)]
    volume_mounts: Vec<VolumeMount>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvVar {
    name: String,
    value: Option<String>,
    value_from: Option<EnvSource>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvSource {
    secret_key_ref: Option<KeyRef>,
    field_ref: Option<FieldRef>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FieldRef {
    field_path: String,
}

#[derive(Deserialize)]
struct KeyRef {
    name: String,
    key: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerPort {
    name: String,
    container_port: u16,
    protocol: String,
}

/// A port by number or by a container port's name.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum PortRef {
    Number(u16),
    Name(String),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    http_get: HttpGet,
}

#[derive(Deserialize)]
struct HttpGet {
    path: String,
    port: PortRef,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct VolumeMount {
    name: String,
    mount_path: PathBuf,
    sub_path: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Volume {
    name: String,
    secret: Option<SecretVolume>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SecretVolume {
    secret_name: String,
    items: Vec<KeyToPath>,
}

#[derive(Deserialize)]
struct KeyToPath {
    key: String,
    path: String,
}

#[derive(Deserialize)]
struct ServiceSpec {
    selector: BTreeMap<String, String>,
    ports: Vec<ServicePort>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServicePort {
    port: u16,
    target_port: PortRef,
    protocol: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PdbSpec {
    min_available: u32,
    selector: Selector,
}

#[derive(Deserialize)]
struct Kustomization {
    resources: Vec<String>,
}

impl Container {
    /// The container port `p` names, as (number, protocol).
    fn port(&self, p: &PortRef) -> (u16, String) {
        let found = self.ports.iter().find(|c| match p {
            PortRef::Number(n) => c.container_port == *n,
            PortRef::Name(n) => &c.name == n,
        });
        let c = found.unwrap_or_else(|| panic!("{} has no such port", self.name));
        (c.container_port, c.protocol.to_lowercase())
    }
}

fn contains_all(labels: &BTreeMap<String, String>, selector: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The probe paths the manifests use, checked against a live coordinator.
async fn assert_served(paths: &BTreeSet<String>) {
    let app = crate::test_utils::spawn_app(|_| {}).await;
    for path in paths {
        let answer = crate::test_utils::http_get(app.http_addr, path).await;
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "the coordinator does not serve {path}: {answer}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn kubernetes_runs_three_replicas_with_probes_ports_and_secrets_the_coordinator_has() {
    let docker = Dockerfile::parse(&read("deploy/Dockerfile"));
    let dir = repo().join("deploy/kubernetes");
    let kustomization: Kustomization =
        serde_yaml_ng::from_str(&read("deploy/kubernetes/kustomization.yaml")).unwrap();
    let files: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(
        kustomization
            .resources
            .iter()
            .cloned()
            .collect::<BTreeSet<_>>(),
        files,
        "kustomization.yaml lists every manifest"
    );
    let mut objects = Vec::new();
    for file in &kustomization.resources {
        let text = read(&format!("deploy/kubernetes/{file}"));
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            objects.push(Object::deserialize(doc).unwrap_or_else(|e| panic!("{file}: {e}")));
        }
    }
    let of_kind = |kind: &'static str| objects.iter().filter(move |o| o.kind == kind);
    let secrets: BTreeMap<&str, BTreeSet<&str>> = of_kind("Secret")
        .map(|o| {
            let keys = o.string_data.keys().chain(o.data.keys());
            (o.metadata.name.as_str(), keys.map(String::as_str).collect())
        })
        .collect();

    let deployments: Vec<&Object> = of_kind("Deployment").collect();
    assert_eq!(deployments.len(), 1);
    let d: DeploymentSpec = serde_yaml_ng::from_value(deployments[0].spec.clone()).unwrap();
    assert_eq!(d.replicas, 3);
    let pod_labels = &d.template.metadata.labels;
    assert!(contains_all(pod_labels, &d.selector.match_labels));
    assert_eq!(d.template.spec.containers.len(), 1);
    let c = &d.template.spec.containers[0];

    // Environment: literal values, or keys of Secrets defined here.
    let mut env = BTreeMap::new();
    let mut used_secret_keys = BTreeSet::new();
    for e in &c.env {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => v.clone(),
            (
                None,
                Some(EnvSource {
                    field_ref: Some(f),
                    secret_key_ref: None,
                }),
            ) => {
                assert_eq!(
                    f.field_path, "metadata.name",
                    "{}: only the pod's name",
                    e.name
                );
                "mlxnet-coordinator-7d9f8-abcde".to_owned()
            }
            (
                None,
                Some(EnvSource {
                    secret_key_ref: Some(r),
                    field_ref: None,
                }),
            ) => {
                assert!(
                    secrets
                        .get(r.name.as_str())
                        .is_some_and(|k| k.contains(r.key.as_str())),
                    "{} reads key {} of Secret {}, which the manifests do not define",
                    e.name,
                    r.key,
                    r.name
                );
                used_secret_keys.insert((r.name.clone(), r.key.clone()));
                of_kind("Secret")
                    .find(|o| o.metadata.name == r.name)
                    .and_then(|o| o.string_data.get(&r.key).cloned())
                    .unwrap_or_default()
            }
            _ => panic!(
                "{}: exactly one of value, a secret key, the pod's name",
                e.name
            ),
        };
        assert!(
            env.insert(e.name.clone(), value).is_none(),
            "{} twice",
            e.name
        );
    }
    assert!(c.command.is_none(), "the image's entrypoint runs");
    let (config, cli) = coordinator_config(&env, &argv(&docker, "coordinator", &c.args));
    assert!(cli.command.is_none(), "the container runs the server");
    assert!(
        config.database_url().starts_with("postgres://"),
        "replicas share PostgreSQL, not a SQLite file per pod"
    );
    assert_eq!(
        config.replica_id.as_deref(),
        Some("mlxnet-coordinator-7d9f8-abcde"),
        "each replica is named after its pod"
    );

    // Ports: exactly the coordinator's listeners.
    let declared: BTreeSet<(u16, String)> = c
        .ports
        .iter()
        .map(|p| (p.container_port, p.protocol.to_lowercase()))
        .collect();
    let want: BTreeSet<(u16, String)> = listeners(&config)
        .into_iter()
        .map(|(p, proto)| (p, proto.to_owned()))
        .collect();
    assert_eq!(
        declared, want,
        "container ports are the coordinator's listeners"
    );

    // Probes: on the HTTP listener, at paths a running coordinator serves.
    let http = (config.http_addr.port(), "tcp".to_owned());
    let readiness = c.readiness_probe.as_ref().expect("a readiness probe");
    let liveness = c.liveness_probe.as_ref().expect("a liveness probe");
    assert_eq!(readiness.http_get.path, "/readyz");
    assert_eq!(liveness.http_get.path, "/healthz");
    for p in [readiness, liveness] {
        assert_eq!(
            c.port(&p.http_get.port),
            http,
            "probes ask the HTTP listener"
        );
    }

    // Volumes: the node-link certificate mounted as the files the
    // coordinator loads from its data directory.
    let mut cert_files = BTreeSet::new();
    for m in &c.volume_mounts {
        let v = d
            .template
            .spec
            .volumes
            .iter()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("mount of undeclared volume {}", m.name));
        let Some(secret) = &v.secret else { continue };
        let defined = secrets.get(secret.secret_name.as_str());
        for item in &secret.items {
            if let Some(keys) = defined {
                assert!(keys.contains(item.key.as_str()), "{}", item.key);
            }
            let at = match &m.sub_path {
                Some(sub) if *sub == item.path => m.mount_path.clone(),
                Some(_) => continue,
                None => m.mount_path.join(&item.path),
            };
            if let Some(file) = at
                .strip_prefix(&config.data_dir)
                .ok()
                .and_then(|f| f.to_str())
            {
                cert_files.insert(file.to_owned());
            }
        }
    }
    assert_eq!(
        cert_files,
        BTreeSet::from([CERT_FILE.to_owned(), KEY_FILE.to_owned()]),
        "every replica gets the one node-link certificate in its data directory"
    );
    for (name, keys) in &secrets {
        for key in keys {
            assert!(
                used_secret_keys.contains(&(name.to_string(), key.to_string())),
                "Secret {name} key {key} is read by nothing"
            );
        }
    }

    // Services: select the pods; their ports reach the container's, with
    // the same protocol; together they expose every listener.
    let mut exposed = BTreeSet::new();
    for s in of_kind("Service") {
        let spec: ServiceSpec = serde_yaml_ng::from_value(s.spec.clone()).unwrap();
        assert!(
            contains_all(pod_labels, &spec.selector),
            "{}",
            s.metadata.name
        );
        for p in &spec.ports {
            let (port, proto) = c.port(&p.target_port);
            assert_eq!(
                proto,
                p.protocol.to_lowercase(),
                "{} port {}",
                s.metadata.name,
                p.port
            );
            exposed.insert((port, proto));
        }
    }
    assert_eq!(exposed, want, "the Services expose every listener");

    // The disruption budget keeps most replicas up.
    let pdbs: Vec<&Object> = of_kind("PodDisruptionBudget").collect();
    assert_eq!(pdbs.len(), 1);
    let pdb: PdbSpec = serde_yaml_ng::from_value(pdbs[0].spec.clone()).unwrap();
    assert!(contains_all(pod_labels, &pdb.selector.match_labels));
    assert!((1..d.replicas).contains(&pdb.min_available));

    assert_served(
        &[readiness, liveness]
            .map(|p| p.http_get.path.clone())
            .into(),
    )
    .await;
}

#[test]
fn the_dockerfile_builds_and_ships_every_binary_and_exposes_the_listeners() {
    let docker = Dockerfile::parse(&read("deploy/Dockerfile"));
    let build = docker.stage("build");
    let cargo = build
        .iter()
        .find(|l| l.starts_with("RUN cargo build"))
        .expect("the build stage runs cargo build");
    let words: Vec<&str> = cargo.split_whitespace().collect();
    assert!(
        words.contains(&"--release") && words.contains(&"--locked"),
        "{cargo}"
    );
    let packages: BTreeSet<&str> = words
        .windows(2)
        .filter(|w| w[0] == "-p")
        .map(|w| w[1])
        .collect();
    let copied: String = docker
        .stages
        .iter()
        .flat_map(|(_, lines)| lines)
        .filter(|l| l.starts_with("COPY --from=build"))
        .cloned()
        .collect::<Vec<_>>()
        .join(" ");
    let binaries = published_binaries();
    assert!(binaries.len() >= 3, "{binaries:?}");
    for (package, bin) in &binaries {
        assert!(
            packages.contains(package.as_str()),
            "the image does not build {package}"
        );
        assert!(
            copied.contains(&format!("/src/target/release/{bin} ")),
            "no image ships {bin}"
        );
    }

    // The coordinator image exposes the default listeners.
    let (config, _) = coordinator_config(&BTreeMap::new(), &argv(&docker, "coordinator", &[]));
    let expose: BTreeSet<(u16, &str)> = docker
        .stage("coordinator")
        .iter()
        .filter_map(|l| l.strip_prefix("EXPOSE"))
        .flat_map(|l| l.split_whitespace())
        .map(|p| {
            let (n, proto) = p.split_once('/').expect("PORT/PROTO");
            (
                n.parse().unwrap(),
                if proto == "udp" { "udp" } else { "tcp" },
            )
        })
        .collect();
    assert_eq!(expose, listeners(&config));
    assert_eq!(
        docker.stages.last().map(|(n, _)| n.as_str()),
        Some("coordinator"),
        "a build without --target makes the coordinator image"
    );
}
