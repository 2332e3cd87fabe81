//! The coordinator's and the aggregator's containers without a container engine (this machine
//! has none): each Dockerfile is read, its build command runs here, and the release binary is
//! started with the final image's environment, entrypoint and command — the coordinator against
//! a fresh Postgres database, its HEALTHCHECK command run (over TLS, as the image serves); the
//! aggregator as its Kubernetes manifest configures it, through a TLS round — and `docker
//! stop`'s SIGTERM ends each cleanly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use starling_client::protocol::AdminClient;
use starling_core::RunId;
use starling_tests::{OPERATOR_TOKEN, TestPki, free_addr, pg_url};

/// What the Dockerfile says, in the parts this test replays.
struct Image {
    build: Vec<String>,
    env: Vec<(String, String)>,
    entrypoint: Vec<String>,
    healthcheck: Vec<String>,
}

fn json_words(text: &str) -> Vec<String> {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not a JSON array: {text}: {e}"))
}

fn read_dockerfile(path: &Path) -> Image {
    let text = std::fs::read_to_string(path).unwrap();
    let mut image = Image { build: vec![], env: vec![], entrypoint: vec![], healthcheck: vec![] };
    let mut stage = 0;
    let mut cmd = vec![];
    for line in text.lines().map(str::trim) {
        if line.starts_with("FROM ") {
            stage += 1;
            image.env.clear();
        } else if let Some(run) = line.strip_prefix("RUN cargo build") {
            assert_eq!(stage, 1, "the build stage comes first");
            image.build = run.split_whitespace().map(str::to_owned).collect();
        } else if let Some(env) = line.strip_prefix("ENV ") {
            let (k, v) = env.split_once('=').expect("ENV KEY=value");
            image.env.push((k.to_owned(), v.to_owned()));
        } else if let Some(e) = line.strip_prefix("ENTRYPOINT ") {
            image.entrypoint = json_words(e);
        } else if let Some(c) = line.strip_prefix("CMD ") {
            cmd = json_words(c);
        } else if let Some(h) = line.strip_prefix("HEALTHCHECK ") {
            let (_, c) = h.split_once("CMD ").expect("HEALTHCHECK ... CMD [...]");
            image.healthcheck = json_words(c);
        }
    }
    assert!(!image.build.is_empty() && !image.entrypoint.is_empty() && !cmd.is_empty());
    image.entrypoint.extend(cmd);
    image
}

impl Image {
    /// The final stage's environment as this machine runs it: `listen_key`'s address (all
    /// interfaces, as the image listens) on `listen`'s free port, since a container's port is
    /// remapped anyway, and each path inside the image that `path_here(key, value)` maps to
    /// where this checkout has it.
    fn env_here(
        &self,
        listen_key: &str,
        listen: std::net::SocketAddr,
        path_here: impl Fn(&str, &str) -> Option<PathBuf>,
    ) -> Vec<(String, String)> {
        let value = |k: &str, v: &str| {
            if k == listen_key {
                assert!(v.starts_with("0.0.0.0:"), "the image listens on all interfaces");
                return format!("0.0.0.0:{}", listen.port());
            }
            path_here(k, v).map_or_else(|| v.to_owned(), |p| p.display().to_string())
        };
        self.env.iter().map(|(k, v)| (k.clone(), value(k, v))).collect()
    }
}

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => dir.into(),
        // This test binary is target/debug/deps/container-*.
        None => std::env::current_exe().unwrap().ancestors().nth(3).unwrap().to_owned(),
    }
}

/// Runs an image's `cargo build` line in the repository, as the image's build stage does.
async fn build_image(root: &Path, image: &Image) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = tokio::process::Command::new(cargo)
        .arg("build")
        .args(&image.build)
        .current_dir(root)
        .status()
        .await
        .unwrap();
    assert!(status.success(), "the image's cargo build failed");
}

/// The aggregator image with the environment `aggregator/deploy/kubernetes/aggregator.yaml`
/// gives it (its pod name as the node id, TLS from the mounted secret), against a TLS
/// coordinator with the tier on: it answers `/livez` over TLS, devices of a large round upload
/// to it, the round commits, and SIGTERM stops it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aggregator_image_serves_a_round_as_its_manifest_configures_it() {
    use starling_tests::*;
    const SECRET: &str = "container-test-secret-0123456789";
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let image = read_dockerfile(&root.join("aggregator").join("Dockerfile"));
    build_image(root, &image).await;
    let pki = TestPki::new().unwrap();
    let (_dir, db) = sqlite_db();
    let device_tls = pki.client_tls("ca.pem", None).unwrap();
    let c = start_in_process_configured(&db, &device_tls, |config| {
        config.limits.device = None;
        config.tls = Some(pki.server_tls(false));
        config.tier = Some(starling_coordinator::tier::TierSettings {
            secret: SECRET.to_owned(),
            cohort_threshold: 4,
            report_grace: Duration::from_secs(3),
            liveness: Duration::from_millis(1500),
        });
    })
    .await
    .unwrap();

    let listen = free_addr();
    let mut env = image.env_here("STARLING_AGGREGATOR_LISTEN", listen, |k, _| match k {
        // What the manifest mounts from the `starling-aggregator-tls` secret.
        "STARLING_TLS_CERT" => Some(pki.path("server.pem")),
        "STARLING_TLS_KEY" => Some(pki.path("server.key")),
        "STARLING_CA_CERT" => Some(pki.path("ca.pem")),
        _ => None,
    });
    let public_url = format!("https://localhost:{}", listen.port());
    // What the manifest adds: the StatefulSet's pod name as the node id.
    env.push(("STARLING_AGGREGATOR_ID".into(), "starling-aggregator-2".into()));
    env.push(("STARLING_AGGREGATOR_PUBLIC_URL".into(), public_url.clone()));
    env.push(("STARLING_COORDINATOR_URL".into(), c.url.clone()));
    env.push(("STARLING_AGGREGATOR_SECRET".into(), SECRET.into()));
    assert_eq!(image.entrypoint, ["starling-aggregator", "--engine", "auto"]);
    let bin = target_dir().join("release").join(&image.entrypoint[0]);
    let mut node = tokio::process::Command::new(bin)
        .args(&image.entrypoint[1..])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let https = http_client_trusting(&pki.path("ca.pem")).unwrap();
    wait_for("the node's /livez over TLS", Duration::from_secs(30), || async {
        let res = https.get(format!("{public_url}/livez")).send().await;
        Ok(res.is_ok_and(|r| r.status().is_success()).then_some(()))
    })
    .await
    .unwrap();
    let token = c.admin.enrollment_token(8).await.unwrap();
    let mut devices = vec![];
    for _ in 0..8 {
        let mut d = starling_client::protocol::FleetClient::with_tls(&c.url, &device_tls).unwrap();
        d.enroll(&token).await.unwrap();
        devices.push(d);
    }
    // The coordinator assigns devices to nodes it has heard from.
    wait_aggregators_live(&c.url, &https, 1).await.unwrap();
    let run = RunId(c.admin.create_run(&PlanSpec::all_of(8, 64, 1).json()).await.unwrap().id);
    let tasks = expect_tasks(&devices).await.unwrap();
    for (i, (d, t)) in devices.iter().zip(&tasks).enumerate() {
        let target = t.upload_to.as_ref().expect("a large round uploads through the tier");
        assert_eq!((target.aggregator.0, target.url.as_str()), (2, public_url.as_str()));
        let upload = upload_request(t, &delta(i, 0, 64), weight(i));
        d.upload_to_aggregator(target, run, t.round_idx, &upload).await.unwrap();
    }
    wait_model(&c.admin, run, 1).await.unwrap();

    let pid = node.id().unwrap();
    let kill = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    assert!(kill.unwrap().success());
    let exit = tokio::time::timeout(Duration::from_secs(10), node.wait()).await;
    assert!(exit.expect("still running 10 s after SIGTERM").unwrap().success());
    c.running.shutdown().await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn the_container_entrypoint_serves_against_postgres(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let image = read_dockerfile(&root.join("Dockerfile"));

    // The image's build, to the letter (`cargo build` + the Dockerfile's flags).
    build_image(root, &image).await;
    let bin_dir = target_dir().join("release");
    let pki = TestPki::new().unwrap();

    // The final stage's environment; paths inside the image map to where this checkout has them,
    // and the port to a free one (a container's port is remapped anyway).
    let listen = free_addr();
    let mut env = image.env_here("STARLING_LISTEN", listen, |k, v| match k {
        "STARLING_DASHBOARD_DIR" => {
            assert_eq!(v, "/usr/share/starling/dashboard");
            let dist = root.join("web-dashboard").join("dist");
            assert!(
                dist.join("index.html").exists(),
                "cargo xtask test builds the dashboard first"
            );
            Some(dist)
        }
        // What compose.yaml mounts at /etc/starling/tls.
        "STARLING_TLS_CERT" => {
            assert_eq!(v, "/etc/starling/tls/cert.pem");
            Some(pki.path("server.pem"))
        }
        "STARLING_TLS_KEY" => {
            assert_eq!(v, "/etc/starling/tls/key.pem");
            Some(pki.path("server.key"))
        }
        _ => None,
    });
    // What compose.yaml (the deployment) adds.
    env.push(("STARLING_DATABASE_URL".into(), pg_url(&opts)));
    env.push(("STARLING_OPERATOR_TOKEN".into(), OPERATOR_TOKEN.into()));
    let run = |words: &[String]| {
        let mut cmd = tokio::process::Command::new(bin_dir.join(&words[0]));
        cmd.args(&words[1..]).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd
    };
    assert_eq!(image.entrypoint, ["starling-coordinator", "serve"]);
    let logs = tempfile::NamedTempFile::new().unwrap();
    let mut coordinator =
        run(&image.entrypoint).stderr(logs.reopen().unwrap()).kill_on_drop(true).spawn().unwrap();

    // The HEALTHCHECK turns healthy once the coordinator serves (migrations ran at start).
    let mut healthy = false;
    for _ in 0..100 {
        if run(&image.healthcheck).status().await.unwrap().success() {
            healthy = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(healthy, "the healthcheck never passed");
    assert!(
        image.env.iter().any(|(k, _)| k == "STARLING_TLS_CERT"),
        "the image serves TLS by default"
    );
    let url = format!("https://localhost:{}", listen.port());
    let tls = pki.client_tls("ca.pem", None).unwrap();
    let admin = AdminClient::with_tls(&url, OPERATOR_TOKEN, &tls).unwrap();
    let plan = serde_json::json!({
        "model": {"schema": {"tensors": [{"name": "w", "shape": [4], "dtype": "f32"}]}, "init": {"kind": "zeros"}},
        "cohort_size": 1, "rounds": 1,
    });
    assert_eq!(admin.create_run(&plan).await.unwrap().id, 1, "the schema was migrated at start");
    let browser = starling_tests::http_client_trusting(&pki.path("ca.pem")).unwrap();
    let dashboard = browser.get(format!("{url}/dashboard/")).send().await.unwrap();
    assert_eq!(dashboard.status(), reqwest::StatusCode::OK);

    // `docker stop`: SIGTERM, and a clean exit well before the 10 s grace period.
    let pid = coordinator.id().unwrap();
    let kill = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    assert!(kill.unwrap().success());
    let exit = tokio::time::timeout(Duration::from_secs(10), coordinator.wait()).await;
    assert!(exit.expect("still running 10 s after SIGTERM").unwrap().success());
    assert!(!run(&image.healthcheck).status().await.unwrap().success());
    // The image logs JSON lines.
    let text = std::fs::read_to_string(logs.path()).unwrap();
    let first = text.lines().next().expect("the coordinator logged");
    assert!(serde_json::from_str::<serde_json::Value>(first).is_ok(), "not JSON: {first}");
}
