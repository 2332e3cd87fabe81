//! Shared helpers for the end-to-end tests and benchmarks: coordinators in-process or as a
//! child process, enrolled devices, deterministic updates, and the exact expected FedAvg result.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use starling_client::protocol::{AdminClient, ClientError, FleetClient, TlsSettings};
use starling_coordinator::{RunningCoordinator, ServeConfig};
use starling_core::tensor::TensorSchema;
use starling_core::wire::{CheckInResponse, ErrorCode, TaskAssignment, UploadRequest};
use starling_core::{ModelVersion, RunId};

/// Operator token every test coordinator uses.
pub const OPERATOR_TOKEN: &str = "test-operator-token-0123456789";

/// The API error code of a call that must have failed with one.
pub fn api_code<T: std::fmt::Debug>(res: Result<T, ClientError>) -> Option<ErrorCode> {
    match res {
        Err(ClientError::Api { body, .. }) => Some(body.code),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// The shared datasets folder beside the checkout (`../shared/data`).
pub fn shared_data() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data")
}

/// A Python interpreter with `modules` importable (`STARLING_PYTHON`, else `python3`), or
/// `None` after saying the test skips; `cargo xtask test` installs them
/// (`xtask/python-requirements.txt`) and sets `STARLING_REQUIRE_PYTHON_TOOLS`, so that there a
/// missing module fails the test instead.
pub fn python_with(modules: &[&str]) -> Option<std::path::PathBuf> {
    python_in("STARLING_PYTHON", modules)
}

/// A Python interpreter with PyTorch, `transformers` and `peft` (`STARLING_HF_PYTHON`, else
/// `python3`), as [`python_with`] finds one; `cargo xtask test` makes it
/// (`tests/python/hf-requirements.txt`, beside the Python SDK's PyTorch).
pub fn hf_python() -> Option<std::path::PathBuf> {
    python_in("STARLING_HF_PYTHON", &["torch", "transformers", "peft"])
}

fn python_in(variable: &str, modules: &[&str]) -> Option<std::path::PathBuf> {
    let python: std::path::PathBuf =
        std::env::var_os(variable).unwrap_or_else(|| "python3".into()).into();
    let imports = format!("import {}", modules.join(", "));
    let found =
        Command::new(&python).args(["-c", &imports]).output().is_ok_and(|o| o.status.success());
    if found {
        return Some(python);
    }
    assert!(
        std::env::var_os("STARLING_REQUIRE_PYTHON_TOOLS").is_none(),
        "{} cannot `{imports}`, and STARLING_REQUIRE_PYTHON_TOOLS says it must",
        python.display()
    );
    eprintln!("skipped: {} cannot `{imports}` (cargo xtask test installs them)", python.display());
    None
}

/// A fresh SQLite database in a temporary directory (deleted when the guard drops).
pub fn sqlite_db() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("creating a temp dir");
    let url = format!("sqlite://{}", dir.path().join("starling.db").display());
    (dir, url)
}

/// The URL of the Postgres database `#[sqlx::test]` made for this test.
pub fn pg_url(opts: &sqlx::postgres::PgConnectOptions) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for Postgres tests");
    starling_coordinator::store::with_database(
        &base,
        opts.get_database().expect("sqlx::test names a database"),
    )
}

/// A coordinator in this process, on a free loopback port.
pub struct InProcess {
    /// The running service.
    pub running: RunningCoordinator,
    /// Its base URL.
    pub url: String,
    /// An operator client for it.
    pub admin: AdminClient,
}

/// Starts a coordinator in-process on `database_url`.
pub async fn start_in_process(database_url: &str) -> anyhow::Result<InProcess> {
    start_in_process_with(database_url, Default::default()).await
}

/// Starts a coordinator in-process on `database_url` with these rate limits.
pub async fn start_in_process_with(
    database_url: &str,
    limits: starling_coordinator::http::Limits,
) -> anyhow::Result<InProcess> {
    start_in_process_configured(database_url, &TlsSettings::default(), |c| c.limits = limits).await
}

/// Starts a coordinator in-process on `database_url`, with the test defaults changed by
/// `configure` (TLS, timeouts, limits). The admin client verifies the coordinator as
/// `admin_tls` says.
pub async fn start_in_process_configured(
    database_url: &str,
    admin_tls: &TlsSettings,
    configure: impl FnOnce(&mut ServeConfig),
) -> anyhow::Result<InProcess> {
    let mut config = ServeConfig {
        listen: "127.0.0.1:0".parse().expect("loopback parses"),
        listen_backlog: starling_coordinator::DEFAULT_LISTEN_BACKLOG,
        database_url: database_url.to_owned(),
        operator_token: OPERATOR_TOKEN.to_owned(),
        migrate: true,
        dashboard_dir: None,
        limits: Default::default(),
        timeouts: Default::default(),
        max_connections: None,
        max_connections_per_ip: None,
        tls: None,
        tier: None,
        enrolment_authority: None,
    };
    configure(&mut config);
    let running = starling_coordinator::start(config).await?;
    let url = running.url();
    let admin = AdminClient::with_tls(&url, OPERATOR_TOKEN, admin_tls)?;
    Ok(InProcess { running, url, admin })
}

/// A certificate authority for devices and servers, another one nobody trusts, and
/// certificates from both, as PEM files in a temporary directory.
pub struct TestPki {
    /// Holds the files.
    pub dir: tempfile::TempDir,
}

impl TestPki {
    /// Makes the CAs and certificates: `server` (for `localhost` and `127.0.0.1`) and `device`
    /// from the trusted CA, `stranger` and `impostor` (a server certificate for the same names)
    /// from the other.
    pub fn new() -> anyhow::Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let dir = tempfile::tempdir()?;
        let write = |name: &str, text: String| std::fs::write(dir.path().join(name), text);
        let mut issuers = vec![];
        for ca in ["ca", "other-ca"] {
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, format!("Starling test {ca}"));
            let key = KeyPair::generate()?;
            write(&format!("{ca}.pem"), params.self_signed(&key)?.pem())?;
            issuers.push(Issuer::new(params, key));
        }
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        for (leaf, issuer, sans) in [
            ("server", &issuers[0], names.clone()),
            ("device", &issuers[0], vec![]),
            ("stranger", &issuers[1], vec![]),
            ("impostor", &issuers[1], names),
        ] {
            let mut params = CertificateParams::new(sans)?;
            params.distinguished_name.push(DnType::CommonName, leaf);
            let key = KeyPair::generate()?;
            write(&format!("{leaf}.pem"), params.signed_by(&key, issuer)?.pem())?;
            write(&format!("{leaf}.key"), key.serialize_pem())?;
        }
        Ok(TestPki { dir })
    }

    /// A file of this PKI: `ca.pem`, `other-ca.pem`, `server.pem`, `server.key`, ...
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    /// The coordinator's TLS: `server` certificate, and mutual TLS against `ca` when asked.
    pub fn server_tls(&self, mutual: bool) -> starling_coordinator::tls::TlsConfig {
        starling_coordinator::tls::TlsConfig {
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            client_ca: mutual.then(|| self.path("ca.pem")),
        }
    }

    /// What a device trusting `ca_file` and presenting `identity` (a leaf name) uses.
    pub fn client_tls(&self, ca_file: &str, identity: Option<&str>) -> anyhow::Result<TlsSettings> {
        let cert = identity.map(|n| self.path(&format!("{n}.pem")));
        let key = identity.map(|n| self.path(&format!("{n}.key")));
        Ok(TlsSettings::from_files(Some(&self.path(ca_file)), cert.as_deref(), key.as_deref())?)
    }
}

/// A coordinator as a child process, run exactly as the binary runs in production.
pub struct ChildCoordinator {
    child: Child,
    /// Its base URL.
    pub url: String,
}

impl ChildCoordinator {
    /// Spawns `bin serve` on `listen` and waits until `/healthz` answers.
    pub async fn spawn(
        bin: &Path,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let env = [("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN)];
        Self::spawn_with(bin, database_url, listen, log, &env).await
    }

    /// Spawns `bin serve` on `listen` while another coordinator leads the same store, and
    /// waits until it answers `/livez` as a replica.
    pub async fn spawn_standby(
        bin: &Path,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let env = [("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN)];
        Self::spawn_standby_with(bin, database_url, listen, log, &env).await
    }

    /// Like [`ChildCoordinator::spawn_standby`], with extra environment variables.
    pub async fn spawn_standby_with(
        bin: &Path,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::spawn_until(bin, database_url, listen, log, env, "/livez").await
    }

    /// Like [`ChildCoordinator::spawn`], with extra environment variables.
    pub async fn spawn_with(
        bin: &Path,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::spawn_until(bin, database_url, listen, log, env, "/healthz").await
    }

    /// Like [`ChildCoordinator::spawn_with`], in a process allowed only `nofile` open files
    /// (soft and hard limit, set by util-linux's `prlimit`), with extra `serve` arguments.
    pub async fn spawn_with_nofile(
        bin: &Path,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
        nofile: u64,
        args: &[&str],
    ) -> anyhow::Result<Self> {
        let mut command = Command::new("prlimit");
        command.arg(format!("--nofile={nofile}:{nofile}")).arg("--").arg(bin);
        command.args(["serve", "--listen", &listen.to_string(), "--insecure-http"]).args(args);
        let env = [("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN)];
        Self::spawn_command(command, database_url, listen, log, &env, "/healthz").await
    }

    /// Spawns `bin serve` and waits until `probe` answers 200.
    async fn spawn_until(
        bin: &Path,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
        env: &[(&str, &str)],
        probe: &str,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(bin);
        command.args(["serve", "--listen", &listen.to_string(), "--insecure-http"]);
        Self::spawn_command(command, database_url, listen, log, env, probe).await
    }

    /// Spawns `command` (a coordinator's `serve`) and waits until `probe` answers 200.
    async fn spawn_command(
        mut command: Command,
        database_url: &str,
        listen: SocketAddr,
        log: &Path,
        env: &[(&str, &str)],
        probe: &str,
    ) -> anyhow::Result<Self> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .context("opening the child's log")?;
        let child = command
            .env("STARLING_DATABASE_URL", database_url)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info,sqlx=warn".to_owned()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {:?}", command.get_program()))?;
        let mut me = ChildCoordinator { child, url: format!("http://{listen}") };
        let http = http_client();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(res) = http.get(format!("{}{probe}", me.url)).send().await
                && res.status().is_success()
            {
                return Ok(me);
            }
            if let Some(status) = me.child.try_wait()? {
                bail!("coordinator exited during start: {status}");
            }
            if Instant::now() > deadline {
                bail!("coordinator did not answer {probe} in 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().context("killing the coordinator")?;
        self.child.wait().context("reaping the coordinator")?;
        Ok(())
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the process to exit by itself; its exit status.
    pub async fn exited_within(
        &mut self,
        timeout: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("the coordinator was still running after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) with kill(1).
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .context("running kill")?;
        anyhow::ensure!(status.success(), "kill -{signal} failed: {status}");
        Ok(())
    }
}

impl Drop for ChildCoordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A coordinator process that a crash-recovery test SIGKILLs and starts again on the same
/// address and store, logging to one file in a temporary directory.
pub struct RestartableCoordinator {
    bin: std::path::PathBuf,
    database_url: String,
    listen: SocketAddr,
    logs: tempfile::TempDir,
    child: ChildCoordinator,
    /// An operator client for it (the address outlives restarts).
    pub admin: AdminClient,
}

impl RestartableCoordinator {
    /// Spawns `bin serve` on `database_url` and a free loopback port.
    pub async fn spawn(bin: &Path, database_url: &str) -> anyhow::Result<Self> {
        let (logs, listen) = (tempfile::tempdir()?, free_addr());
        let log = logs.path().join("coordinator.log");
        let child = ChildCoordinator::spawn(bin, database_url, listen, &log).await?;
        let admin = AdminClient::new(&child.url, OPERATOR_TOKEN);
        let database_url = database_url.to_owned();
        Ok(RestartableCoordinator { bin: bin.to_owned(), database_url, listen, logs, child, admin })
    }

    /// Its base URL.
    pub fn url(&self) -> &str {
        &self.child.url
    }

    /// The log every incarnation writes to.
    pub fn log(&self) -> std::path::PathBuf {
        self.logs.path().join("coordinator.log")
    }

    /// The running incarnation's process id.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()
    }

    /// Starts it again, on the same address and store, and waits until it answers.
    pub async fn respawn(&mut self) -> anyhow::Result<()> {
        self.child =
            ChildCoordinator::spawn(&self.bin, &self.database_url, self.listen, &self.log())
                .await?;
        Ok(())
    }
}

/// A plain reqwest client for raw requests in tests (ring installed as rustls's provider first,
/// as the SDK does; without it reqwest panics).
pub fn http_client() -> reqwest::Client {
    starling_client::protocol::install_tls_provider();
    reqwest::Client::new()
}

/// A reqwest client that trusts only the PEM CA in `ca_file`.
pub fn http_client_trusting(ca_file: &Path) -> anyhow::Result<reqwest::Client> {
    starling_client::protocol::install_tls_provider();
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca_file)?)?;
    Ok(reqwest::Client::builder().tls_certs_only([ca]).build()?)
}

/// Writes `head` (an HTTP request, or the start of one) on a fresh connection and reads until
/// the answer's headers end, the server closes, or `wait` passes: the status line (empty if
/// nothing came) and how long that took.
pub fn raw_answer(addr: SocketAddr, head: &[u8], wait: Duration) -> (String, Duration) {
    use std::io::{Read, Write};
    let started = Instant::now();
    let mut stream = std::net::TcpStream::connect(addr).expect("connecting to the coordinator");
    stream.set_read_timeout(Some(wait)).expect("a read timeout");
    stream.write_all(head).expect("writing the request head");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&answer);
    (text.lines().next().unwrap_or_default().to_owned(), started.elapsed())
}

/// A free loopback address (bound, then released).
pub fn free_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("binding a free port");
    l.local_addr().expect("local addr")
}

/// Enrolls `n` devices of the `default` population, each with its own HTTP client.
pub async fn enroll(url: &str, admin: &AdminClient, n: usize) -> anyhow::Result<Vec<FleetClient>> {
    enroll_in(url, admin, n, &["default"]).await
}

/// Enrolls `n` devices that may join `populations`, each with its own HTTP client.
pub async fn enroll_in(
    url: &str,
    admin: &AdminClient,
    n: usize,
    populations: &[&str],
) -> anyhow::Result<Vec<FleetClient>> {
    let token = admin.enrollment_token_for(n.max(1) as i64, populations).await?.token;
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let mut d = FleetClient::new(url);
        d.enroll(&token).await?;
        devices.push(d);
    }
    Ok(devices)
}

/// A plan training the SDK's built-in MLP on `input` (two devices per round, both needed),
/// for `epochs` local epochs and `rounds` rounds.
pub fn mlp_plan(
    input: starling_core::model_spec::InputSpec,
    epochs: u32,
    rounds: u32,
) -> serde_json::Value {
    use starling_client::simulate::{ModelKind, model_spec};
    serde_json::json!({
        "model": {"spec": model_spec(ModelKind::Mlp, input), "init": {"kind": "seeded", "seed": 1}},
        "training": {"epochs": epochs, "batch_size": 10, "lr": 0.1},
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": rounds,
    })
}

/// `clients` simulated SDK devices training the MLP on the digits (IID, 5 local epochs) against
/// the coordinator at `url`. On the CPU backend: it keeps CI's two cores fast, and wgpu has its
/// own training test in client-sdk.
pub fn digits_simulation(
    url: &str,
    clients: usize,
    cohort: u32,
    rounds: u32,
    seed: u64,
) -> starling_client::simulate::SimulationConfig {
    use starling_client::backend::{self, BackendChoice};
    use starling_client::data::{Dataset, Partition};
    use starling_client::simulate::{ModelKind, SimulationConfig};
    SimulationConfig {
        tls: Default::default(),
        url: url.to_owned(),
        operator_token: OPERATOR_TOKEN.to_owned(),
        clients,
        cohort,
        rounds,
        dataset: Dataset::Digits,
        data_dir: shared_data(),
        partition: Partition::Iid,
        model: ModelKind::Mlp,
        training: serde_json::json!({"epochs": 5, "batch_size": 10, "lr": 0.1}),
        seed,
        max_examples: 0,
        backend: backend::select(BackendChoice::Cpu).expect("the CPU backend is always there"),
        secure: false,
        population: None,
        pacing: Default::default(),
        holdout: 0.1,
        strategy: serde_json::Value::Null,
        selection: Default::default(),
        poisoning: None,
        compression: Default::default(),
        model_download: Default::default(),
        asynchronous: None,
        slowdown: None,
        checkpoint_interval: 1,
        scoring: Default::default(),
        seeded_cohorts: false,
        timeout: None,
        target: None,
        lstm: Default::default(),
        shakespeare: Default::default(),
    }
}

/// A one-round plan for a one-tensor model of `params` f32 values, `cohort` devices selected
/// and all of them needed, with long deadlines.
pub fn one_round_plan(params: u64, cohort: u32) -> serde_json::Value {
    PlanSpec {
        params,
        cohort,
        over_selection: 1.0,
        quorum: cohort,
        selection_secs: 30.0,
        reporting_secs: 60.0,
        rounds: 1,
    }
    .json()
}

/// A run plan for a one-tensor model of `params` f32 values.
#[derive(Debug, Clone)]
pub struct PlanSpec {
    /// Model size.
    pub params: u64,
    /// Reports per round.
    pub cohort: u32,
    /// Over-selection factor.
    pub over_selection: f64,
    /// Minimum reports.
    pub quorum: u32,
    /// Selection window.
    pub selection_secs: f64,
    /// Reporting deadline from round opening.
    pub reporting_secs: f64,
    /// Rounds to commit.
    pub rounds: u32,
}

impl PlanSpec {
    /// `devices` devices of a one-tensor model of `params` values, every one selected and
    /// needed each round, with long deadlines.
    pub fn all_of(devices: usize, params: usize, rounds: u32) -> Self {
        PlanSpec {
            params: params as u64,
            cohort: devices as u32,
            over_selection: 1.0,
            quorum: devices as u32,
            selection_secs: 30.0,
            reporting_secs: 60.0,
            rounds,
        }
    }

    /// The schema of [`PlanSpec::json`]'s model: one f32 tensor `w` of `params` values.
    pub fn schema(&self) -> starling_core::tensor::TensorSchema {
        use starling_core::tensor::{DType, TensorSchema, TensorSpec};
        TensorSchema {
            tensors: vec![TensorSpec {
                name: "w".into(),
                shape: vec![self.params],
                dtype: DType::F32,
            }],
        }
    }

    /// The plan as the admin API takes it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "model": {
                "schema": {"tensors": [{"name": "w", "shape": [self.params], "dtype": "f32"}]},
                "init": {"kind": "seeded", "seed": 42}
            },
            "training": {"optimizer": "sgd", "lr": 0.1},
            "cohort_size": self.cohort,
            "over_selection": self.over_selection,
            "min_quorum": self.quorum,
            "selection_timeout_secs": self.selection_secs,
            "reporting_timeout_secs": self.reporting_secs,
            "rounds": self.rounds,
        })
    }
}

/// The delta logical device `device` sends in round `round`: multiples of 1/64 in [-1, 1], so
/// every weighted sum in a test is exact in f64 and the expected model is known to the bit.
pub fn delta(device: usize, round: i64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| {
            let k = (j as i64 * 31 + device as i64 * 17 + round * 7) % 129 - 64;
            k as f32 / 64.0
        })
        .collect()
}

/// The example count logical device `device` reports.
pub fn weight(device: usize) -> u64 {
    10 + (device as u64 % 7) * 5
}

/// The exact FedAvg result: `global + Σ wᵢ·dᵢ / Σ wᵢ`, computed in f64 and rounded once.
pub fn fedavg_expected(global: &[f32], contributions: &[(Vec<f32>, u64)]) -> Vec<f32> {
    let total: u64 = contributions.iter().map(|(_, w)| w).sum();
    (0..global.len())
        .map(|j| {
            let sum: f64 = contributions.iter().map(|(d, w)| f64::from(d[j]) * *w as f64).sum();
            (f64::from(global[j]) + sum / total as f64) as f32
        })
        .collect()
}

/// An upload for `task` with `delta` and weight `examples`.
pub fn upload_request(task: &TaskAssignment, delta: &[f32], examples: u64) -> UploadRequest {
    UploadRequest {
        model_version: task.model_version,
        example_count: examples,
        metrics: [("loss".to_owned(), 1.0 / examples as f64)].into(),
        delta: task.schema.encode_f32(delta),
    }
}

/// Checks in and expects a task.
pub async fn expect_task(device: &FleetClient) -> anyhow::Result<TaskAssignment> {
    match device.check_in("default").await? {
        CheckInResponse::Task(t) => Ok(t),
        other => bail!("expected a task, got {other:?}"),
    }
}

/// Every device checks in concurrently and each expects a task.
pub async fn expect_tasks(devices: &[FleetClient]) -> anyhow::Result<Vec<TaskAssignment>> {
    futures_util::future::join_all(devices.iter().map(expect_task)).await.into_iter().collect()
}

/// Checks that the coordinator at `url` is a replica: ready for devices (`/readyz` 200), and
/// the admin API answered 503 with `Retry-After` and a message that says it is a replica.
pub async fn assert_is_a_replica(http: &reqwest::Client, url: &str) {
    let ready = http.get(format!("{url}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), reqwest::StatusCode::OK, "a replica is ready for devices");
    let runs = http.get(format!("{url}/v1/admin/runs")).bearer_auth(OPERATOR_TOKEN);
    let res = runs.send().await.unwrap();
    assert_eq!(res.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().contains_key("retry-after"));
    let body: starling_core::wire::ErrorBody = res.json().await.unwrap();
    assert!(body.message.contains("replica"), "{}", body.message);
}

/// Downloads and decodes a model, asking again for about 30 s while the answer is a transient
/// failure, as devices do: a replica serves models from the store, and answers 503 with
/// `Retry-After` for a model committed moments ago whose bytes the leader is still writing.
pub async fn model_values(
    device: &FleetClient,
    hash: &str,
    schema: &TensorSchema,
) -> anyhow::Result<Vec<f32>> {
    // Backing off from 200 ms to 10 s, nine tries wait about 30 s in all.
    let payload = starling_client::protocol::retrying(9, || device.model(hash)).await?;
    Ok(schema.decode_f32(&payload)?)
}

/// Polls `check` every 25 ms until it returns `Some`, or fails after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits (at most 120 s) until the device state file at `path` holds a trained update not yet
/// acknowledged: the point at which the kill-before-the-answer tests stop the coordinator.
pub async fn wait_for_pending_upload(
    path: &Path,
) -> anyhow::Result<starling_client::participant::PendingUpload> {
    wait_for("the trained update in the state file", Duration::from_secs(120), || async move {
        Ok(starling_client::participant::ParticipantState::load(path)?
            .and_then(|s| s.pending_upload))
    })
    .await
}

/// A process's memory figure from `/proc/PID/status` in MiB: `VmRSS` (resident now) or
/// `VmHWM` (its peak).
pub fn process_memory_mib(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    Ok(kib / 1024.0)
}

/// Waits (at most 30 s) until the coordinator at `url` counts `n` live aggregator nodes (its
/// `starling_aggregators_live` gauge): it assigns devices only to nodes it has heard from.
pub async fn wait_aggregators_live(
    url: &str,
    http: &reqwest::Client,
    n: usize,
) -> anyhow::Result<()> {
    let (metrics, want) = (format!("{url}/metrics"), format!("starling_aggregators_live {n}"));
    wait_for(&format!("{n} live aggregators"), Duration::from_secs(30), || async {
        let text = http.get(&metrics).bearer_auth(OPERATOR_TOKEN).send().await?.text().await?;
        Ok(text.lines().any(|l| l == want).then_some(()))
    })
    .await
}

/// Waits until round `round_idx` of `run` is open.
pub async fn wait_round_open(
    admin: &AdminClient,
    run: RunId,
    round_idx: i64,
) -> anyhow::Result<()> {
    wait_for(&format!("round {round_idx} to open"), Duration::from_secs(30), || async {
        let rounds = admin.rounds(run).await?;
        Ok(rounds.iter().any(|r| r.round_idx == round_idx && r.state == "open").then_some(()))
    })
    .await
}

/// Waits until `run` has committed model `version`, and returns its content hash.
pub async fn wait_model(admin: &AdminClient, run: RunId, version: i64) -> anyhow::Result<String> {
    wait_for(&format!("model version {version}"), Duration::from_secs(60), || async {
        let models = admin.models(run).await?;
        Ok(models.into_iter().find(|m| m.version == version).map(|m| m.content_hash))
    })
    .await
}

/// The model version a task trains on, as a plain number.
pub fn version(task: &TaskAssignment) -> i64 {
    let ModelVersion(v) = task.model_version;
    v
}

/// A progress callback that sends the coordinator process `pid` the signal `signal` (`STOP`,
/// `KILL`) when the participation reaches `phase`.
pub fn signal_at(
    pid: u32,
    phase: starling_client::participant::Phase,
    signal: &'static str,
) -> starling_client::participant::ProgressCallback {
    Box::new(move |p| {
        if p == starling_client::participant::ParticipantProgress::Phase(phase) {
            let sent = std::process::Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status();
            assert!(sent.unwrap().success(), "kill -{signal} {pid}");
        }
    })
}
