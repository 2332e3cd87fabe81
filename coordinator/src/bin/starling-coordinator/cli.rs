//! The `starling-coordinator` command line: `serve` and `migrate`.
//!
//! Configuration is read in two phases: flags and environment variables (clap) over an
//! optional TOML file ([`FileConfig`]), then resolved into a validated [`ServeConfig`].
//! The binary's own: the library takes a [`ServeConfig`] and knows no flags. The one place
//! in the crate that uses anyhow.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::Deserialize;

use starling_coordinator::ServeConfig;

/// Default embedded store, relative to the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://starling-data/starling.db";
/// Default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

#[derive(Debug, Parser)]
#[command(
    name = "starling-coordinator",
    version,
    about = "Starling federated-learning coordinator"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, env = "STARLING_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the fleet and admin APIs.
    Serve(Box<ServeArgs>),
    /// Apply database migrations and exit.
    Migrate(MigrateArgs),
    /// Exit 0 when the coordinator at --url answers /healthz with 200 (its store is reachable);
    /// the container's HEALTHCHECK.
    Healthcheck(HealthcheckArgs),
}

#[derive(Debug, Args)]
struct HealthcheckArgs {
    /// Address the coordinator listens on.
    #[arg(long, env = "STARLING_LISTEN", default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// The coordinator serves TLS with this certificate: speak TLS to it (the same variable as
    /// `serve` reads, so the container's HEALTHCHECK needs no flags).
    #[arg(long, env = "STARLING_TLS_CERT")]
    tls_cert: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// TOML file with any of: listen, database_url, operator_token, migrate, dashboard_dir,
    /// tls_cert, tls_key, tls_client_ca.
    #[arg(long, env = "STARLING_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = "STARLING_LISTEN")]
    listen: Option<SocketAddr>,
    /// postgres://... or sqlite://... [default: sqlite://starling-data/starling.db].
    #[arg(long, env = "STARLING_DATABASE_URL")]
    database_url: Option<String>,
    /// Operator credential for the admin API (required).
    #[arg(long, env = "STARLING_OPERATOR_TOKEN", hide_env_values = true)]
    operator_token: Option<String>,
    /// Do not apply migrations at start.
    #[arg(long)]
    no_migrate: bool,
    /// Serve the built web dashboard (web-dashboard/dist) from here at /dashboard/.
    #[arg(long, env = "STARLING_DASHBOARD_DIR")]
    dashboard_dir: Option<PathBuf>,
    /// Fleet requests per second allowed per device, as RATE/BURST (`off` for none).
    #[arg(long, env = "STARLING_DEVICE_RATE_LIMIT", default_value = "10/30")]
    device_rate_limit: String,
    /// Fleet requests per second allowed per client IP, as RATE/BURST (`off` for none).
    #[arg(long, env = "STARLING_IP_RATE_LIMIT", default_value = "off")]
    ip_rate_limit: String,
    /// PEM certificate chain to serve TLS with (TLS is required unless --insecure-http).
    #[arg(long, env = "STARLING_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "STARLING_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM CA that device certificates must chain to: turns on mutual TLS for the fleet API.
    #[arg(long, env = "STARLING_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Serve plain HTTP: for the local demo, or behind a proxy that terminates TLS.
    #[arg(long, env = "STARLING_INSECURE_HTTP", conflicts_with = "tls_cert")]
    insecure_http: bool,
    /// The largest model a run may have, in bytes (4 per parameter); larger plans are refused.
    #[arg(long, env = "STARLING_MAX_MODEL_BYTES", default_value_t = starling_coordinator::http::DEFAULT_MAX_MODEL_BYTES)]
    max_model_bytes: u64,
    /// Connections the kernel queues for the coordinator before it accepts them (capped by
    /// net.core.somaxconn): room for an enrollment burst of a large fleet.
    #[arg(long, env = "STARLING_LISTEN_BACKLOG", default_value_t = starling_coordinator::DEFAULT_LISTEN_BACKLOG)]
    listen_backlog: u32,
    /// Seconds a connection gets for its TLS handshake and each request's headers.
    #[arg(long, env = "STARLING_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    header_timeout_secs: u64,
    /// Seconds every request body gets, on top of what its size limit needs at 16 KiB/s.
    #[arg(long, env = "STARLING_BODY_TIMEOUT_SECS", default_value_t = 30)]
    body_timeout_secs: u64,
    /// Seconds a connection may move no byte either way before it is closed (keep-alive and
    /// HTTP/2 connections between requests included).
    #[arg(long, env = "STARLING_IDLE_TIMEOUT_SECS", default_value_t = 60)]
    idle_timeout_secs: u64,
    /// Open connections at most [default: all but an eighth of the open-file limit, which is
    /// raised to its hard limit at start]. At the cap a new connection closes the one silent
    /// longest, so a flood of idle connections locks no one out.
    #[arg(long, env = "STARLING_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Open connections from one IP address at most [default: half of --max-connections, at
    /// least 16]; 0 for no per-address cap, as behind a proxy or load balancer, whose address
    /// every connection has. At the cap a new connection from that address closes its one that
    /// has gone longest without a request.
    #[arg(long, env = "STARLING_MAX_CONNECTIONS_PER_IP")]
    max_connections_per_ip: Option<usize>,
    /// Secret shared with the aggregator nodes (at least 16 characters): turns the aggregator
    /// tier on.
    #[arg(long, env = "STARLING_AGGREGATOR_SECRET", hide_env_values = true)]
    aggregator_secret: Option<String>,
    /// Runs that select more devices per round than this upload through aggregators.
    #[arg(long, env = "STARLING_AGGREGATE_ABOVE", default_value_t = 1000)]
    aggregate_above: u32,
    /// Seconds past a round's reporting deadline that aggregators' partials are waited for.
    #[arg(long, env = "STARLING_AGGREGATOR_GRACE_SECS", default_value_t = 10)]
    aggregator_grace_secs: u64,
    /// Milliseconds without a poll after which an aggregator counts as lost.
    #[arg(long, env = "STARLING_AGGREGATOR_LIVENESS_MS", default_value_t = 3000)]
    aggregator_liveness_ms: u64,
    /// The operator's enrolment authority, its public key in hex (as `starling enrolment
    /// new-authority` prints it): devices enroll only with an identity key it certified. Not
    /// the TLS key; its secret never belongs on the coordinator.
    #[arg(long, env = "STARLING_ENROLMENT_AUTHORITY")]
    enrolment_authority: Option<String>,
}

/// `RATE/BURST` or `off`.
fn parse_rate(
    flag: &str,
    text: &str,
) -> anyhow::Result<Option<starling_coordinator::http::limits::RateLimit>> {
    if text == "off" {
        return Ok(None);
    }
    let parsed = text
        .split_once('/')
        .and_then(|(r, b)| Some((r.parse::<f64>().ok()?, b.parse::<f64>().ok()?)));
    match parsed {
        Some((per_sec, burst))
            if per_sec > 0.0 && per_sec.is_finite() && burst >= 1.0 && burst.is_finite() =>
        {
            Ok(Some(starling_coordinator::http::limits::RateLimit { per_sec, burst }))
        }
        _ => bail!("--{flag} {text:?}: expected RATE/BURST with RATE > 0 and BURST >= 1, or off"),
    }
}

#[derive(Debug, Args)]
struct MigrateArgs {
    /// postgres://... or sqlite://...
    #[arg(long, env = "STARLING_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
}

/// The optional configuration file, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Listen address.
    pub listen: Option<SocketAddr>,
    /// Database URL.
    pub database_url: Option<String>,
    /// Operator credential.
    pub operator_token: Option<String>,
    /// Apply migrations at start (default true).
    pub migrate: Option<bool>,
    /// Directory of the built dashboard.
    pub dashboard_dir: Option<PathBuf>,
    /// PEM certificate chain for TLS.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    pub tls_key: Option<PathBuf>,
    /// PEM CA for device certificates (mutual TLS).
    pub tls_client_ca: Option<PathBuf>,
}

fn resolve(args: ServeArgs) -> anyhow::Result<ServeConfig> {
    let file = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading config {}", path.display()))?;
            toml::from_str::<FileConfig>(&text)
                .with_context(|| format!("parsing config {}", path.display()))?
        }
        None => FileConfig::default(),
    };
    let listen = match args.listen.or(file.listen) {
        Some(addr) => addr,
        None => DEFAULT_LISTEN.parse().expect("default address parses"),
    };
    let database_url =
        args.database_url.or(file.database_url).unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
    let Some(operator_token) = args.operator_token.or(file.operator_token) else {
        bail!(
            "an operator token is required: --operator-token, STARLING_OPERATOR_TOKEN or operator_token in the config file"
        );
    };
    if operator_token.len() < 16 {
        bail!("the operator token must be at least 16 characters");
    }
    let migrate = !args.no_migrate && file.migrate.unwrap_or(true);
    let dashboard_dir = args.dashboard_dir.or(file.dashboard_dir);
    if let Some(dir) = &dashboard_dir
        && !dir.join("index.html").is_file()
    {
        bail!("--dashboard-dir {} holds no index.html: build the dashboard first", dir.display());
    }
    let limits = starling_coordinator::http::Limits {
        device: parse_rate("device-rate-limit", &args.device_rate_limit)?,
        ip: parse_rate("ip-rate-limit", &args.ip_rate_limit)?,
        max_model_bytes: args.max_model_bytes,
    };
    if args.max_model_bytes < 4 || args.listen_backlog == 0 {
        bail!("--max-model-bytes must be at least 4 and --listen-backlog at least 1");
    }
    let tls = match (args.tls_cert.or(file.tls_cert), args.tls_key.or(file.tls_key)) {
        (Some(cert), Some(key)) => Some(starling_coordinator::tls::TlsConfig {
            cert,
            key,
            client_ca: args.tls_client_ca.or(file.tls_client_ca),
        }),
        (None, None) if args.insecure_http => None,
        (None, None) => bail!(
            "TLS is on by default: pass --tls-cert and --tls-key (STARLING_TLS_CERT, STARLING_TLS_KEY), \
             or --insecure-http to serve plain HTTP (the local demo, or behind a TLS-terminating proxy)"
        ),
        _ => bail!("--tls-cert and --tls-key go together"),
    };
    if tls.is_some() && args.insecure_http {
        bail!("--insecure-http and a TLS certificate contradict each other");
    }
    if args.max_connections == Some(0) {
        bail!("--max-connections must be at least 1");
    }
    for secs in [args.header_timeout_secs, args.body_timeout_secs, args.idle_timeout_secs] {
        if secs == 0 {
            bail!("timeouts must be at least one second");
        }
    }
    let timeouts = starling_coordinator::http::Timeouts {
        header: std::time::Duration::from_secs(args.header_timeout_secs),
        body_grace: std::time::Duration::from_secs(args.body_timeout_secs),
        idle: std::time::Duration::from_secs(args.idle_timeout_secs),
        ..Default::default()
    };
    let tier = match args.aggregator_secret {
        Some(secret) if secret.len() < 16 => {
            bail!("the aggregator secret must be at least 16 characters")
        }
        Some(secret) => {
            if args.aggregator_liveness_ms < 200 {
                bail!("--aggregator-liveness-ms must be at least 200");
            }
            Some(starling_coordinator::tier::TierSettings {
                secret,
                cohort_threshold: args.aggregate_above,
                report_grace: std::time::Duration::from_secs(args.aggregator_grace_secs),
                liveness: std::time::Duration::from_millis(args.aggregator_liveness_ms),
            })
        }
        None => None,
    };
    let enrolment_authority = args
        .enrolment_authority
        .as_deref()
        .map(|hex| {
            starling_core::secagg::parse_public_key(hex)
                .map_err(|why| anyhow::anyhow!("--enrolment-authority: {why}"))
        })
        .transpose()?;
    Ok(ServeConfig {
        tier,
        enrolment_authority,
        listen,
        listen_backlog: args.listen_backlog,
        database_url,
        operator_token,
        migrate,
        dashboard_dir,
        limits,
        timeouts,
        max_connections: args.max_connections,
        max_connections_per_ip: args.max_connections_per_ip,
        tls,
    })
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn,tower_http=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Ctrl-C, or SIGTERM (what `docker stop` and Kubernetes send).
async fn shutdown_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        res = tokio::signal::ctrl_c() => res.context("waiting for ctrl-c"),
        _ = term.recv() => Ok(()),
    }
}

/// Accepts whatever certificate the coordinator shows: the health check talks to its own
/// process over loopback, and asks only whether it is ready, so there is nothing to protect.
#[derive(Debug)]
struct AnyCertificate(std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `GET /healthz` over HTTP/1.1 (in TLS when `tls`), without an HTTP client dependency.
fn healthcheck(listen: SocketAddr, tls: bool) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    // A wildcard listen address is reached on loopback.
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let timeout = std::time::Duration::from_secs(5);
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let mut answer = Vec::new();
    if tls {
        let provider = starling_coordinator::tls::provider();
        let config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(AnyCertificate(provider)))
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::from(addr.ip());
        let connection = rustls::ClientConnection::new(std::sync::Arc::new(config), name)?;
        let mut stream = rustls::StreamOwned::new(connection, stream);
        stream.write_all(request.as_bytes()).with_context(|| format!("asking {addr}"))?;
        // A peer that closes without close_notify still gave a whole HTTP/1.1 answer.
        if let Err(e) = stream.read_to_end(&mut answer)
            && answer.is_empty()
        {
            return Err(e).with_context(|| format!("reading {addr}'s answer"));
        }
    } else {
        stream.write_all(request.as_bytes()).with_context(|| format!("asking {addr}"))?;
        stream.read_to_end(&mut answer).with_context(|| format!("reading {addr}'s answer"))?;
    }
    let status = String::from_utf8_lossy(&answer).lines().next().unwrap_or_default().to_owned();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(())
    } else {
        bail!("{addr}/healthz answered {status:?}")
    }
}

/// The binary's entry point.
pub(crate) fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => {
                let config = resolve(*args)?;
                tracing::info!(listen = %config.listen, tls = config.tls.is_some(), database = %starling_coordinator::store::redact(&config.database_url), "starting");
                let running = starling_coordinator::start(config).await.context("starting the coordinator")?;
                let signal = async {
                    if let Err(e) = shutdown_signal().await {
                        tracing::error!(error = %e, "signal handling failed");
                        std::future::pending::<()>().await;
                    }
                    tracing::info!("shutting down");
                };
                running.serve_until(signal).await?;
                Ok(())
            }
            Command::Healthcheck(args) => healthcheck(args.listen, args.tls_cert.is_some()),
            Command::Migrate(args) => {
                starling_coordinator::store::SqlStore::connect(&args.database_url, true).await.context("migrating")?;
                tracing::info!("migrations applied");
                Ok(())
            }
        }
    })
}
