//! `starling`, the operator's command line: runs, models, enrollment tokens and devices through
//! the admin API, with the operator token from the environment.
//!
//! It is a binary of the SDK rather than subcommands of the coordinator: it is an HTTP client of
//! the admin API and reuses the SDK's [`AdminClient`] (TLS settings included), runs on the
//! operator's machine rather than the server's, and the coordinator binary stays a server that
//! needs no operator credential to start. It lives in the library so that tests run the same
//! code as the binary.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use starling_core::admin::{ModelView, RunView};
use starling_core::{DeviceId, RunId};

use starling_client::protocol::AdminClient;

#[derive(Debug, Parser)]
#[command(
    name = "starling",
    version,
    about = "Operate a Starling coordinator through its admin API"
)]
struct Cli {
    /// Coordinator URL.
    #[arg(long, global = true, env = "STARLING_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Operator token.
    #[arg(long, global = true, env = "STARLING_OPERATOR_TOKEN", hide_env_values = true)]
    operator_token: Option<String>,
    /// PEM CA certificate(s) an `https://` coordinator's certificate must chain to (default:
    /// the system's trust store).
    #[arg(long, global = true, env = "STARLING_CA_CERT")]
    ca_cert: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Training runs.
    #[command(subcommand)]
    Runs(RunsCommand),
    /// Committed models.
    #[command(subcommand)]
    Models(ModelsCommand),
    /// Enrollment tokens.
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// Enrolled devices.
    #[command(subcommand)]
    Devices(DevicesCommand),
    /// The operator's enrolment authority, which certifies device identity keys (offline: no
    /// coordinator is called).
    #[command(subcommand)]
    Enrolment(EnrolmentCommand),
}

#[derive(Debug, Subcommand)]
enum EnrolmentCommand {
    /// Make a new enrolment authority: write its secret to FILE (readable by its owner only;
    /// keep it off the coordinator) and print its public key, which devices pin and the
    /// coordinator's --enrolment-authority takes.
    NewAuthority {
        /// Where the secret goes; an existing file is not overwritten.
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the authority's certificate (128 hex digits) of a device's identity key.
    Certify {
        /// The authority's secret file.
        #[arg(long)]
        authority: PathBuf,
        /// The device's identity key, 64 hex digits.
        identity: String,
    },
}

#[derive(Debug, Subcommand)]
enum RunsCommand {
    /// Create a run from a plan file (`.toml`, or JSON otherwise) and print its id.
    Create {
        /// The plan, with the fields of `POST /v1/admin/runs`.
        plan: PathBuf,
        /// Start from a committed model of another run, `RUN:VERSION` (same schema): it
        /// replaces the plan's `model.init`. With `evaluation_only = true` in the plan, the
        /// fleet evaluates that model without training it.
        #[arg(long, value_name = "RUN:VERSION")]
        init_from: Option<String>,
    },
    /// List runs.
    List {
        /// Print JSON rather than a table.
        #[arg(long)]
        json: bool,
    },
    /// Follow a run until it ends, with a progress bar of its rounds.
    Watch {
        /// The run.
        run: i64,
        /// Seconds between looks.
        #[arg(long, default_value_t = 1.0)]
        interval_secs: f64,
    },
    /// Stop a run: its open round is abandoned and no round opens after it.
    Stop {
        /// The run.
        run: i64,
    },
}

#[derive(Debug, Subcommand)]
enum ModelsCommand {
    /// List a run's committed models with their evaluations.
    List {
        /// The run.
        run: i64,
        /// Print JSON rather than a table.
        #[arg(long)]
        json: bool,
    },
    /// Import a pretrained model (a safetensors file of F32 tensors) for plans to start
    /// from: prints its content hash, which a plan's `init` names
    /// (`{"kind": "base_model", "hash": ...}`).
    Import {
        /// The safetensors file.
        file: PathBuf,
        /// A name for people.
        #[arg(long)]
        name: String,
    },
    /// Import a Hugging Face checkpoint (a directory with `config.json` and an F32
    /// `model.safetensors`, of the GPT-2 or Llama family) as a pretrained model: writes the
    /// model spec it becomes to `--spec-out` (a plan's `model.spec`) and prints the content hash
    /// its `init` names.
    ImportHf {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// A name for people.
        #[arg(long)]
        name: String,
        /// Tokens the model takes: the plan's input length, at most the checkpoint's positions.
        #[arg(long, default_value_t = 64)]
        length: u64,
        /// Where to write the model spec (JSON).
        #[arg(long)]
        spec_out: PathBuf,
    },
    /// List the imported pretrained models.
    Bases {
        /// Print JSON rather than a table.
        #[arg(long)]
        json: bool,
    },
    /// Import a Hugging Face tokenizer (a checkpoint's `tokenizer.json`) for devices to
    /// tokenize their text with: prints its content hash, which a plan's `model.tokenizer`
    /// names.
    ImportTokenizer {
        /// The `tokenizer.json` file.
        file: PathBuf,
        /// A name for people.
        #[arg(long)]
        name: String,
    },
    /// List the imported tokenizers.
    Tokenizers {
        /// Print JSON rather than a table.
        #[arg(long)]
        json: bool,
    },
    /// Download a committed model.
    Export {
        /// The run.
        run: i64,
        /// The model version [default: the latest].
        #[arg(long)]
        version: Option<i64>,
        /// `safetensors` (named f32 tensors), `payload` (the CBOR payload devices download), or
        /// for a run from a GPT-2 or Llama checkpoint (`models import-hf`) `hf` (the model, adapters
        /// merged, as a Hugging Face checkpoint directory) or `peft` (a LoRA run's adapters as a
        /// PEFT adapter directory).
        #[arg(long, default_value = "safetensors", value_parser = ["safetensors", "payload", "hf", "peft"])]
        format: String,
        /// With safetensors: `all` (the model as trained), or for a LoRA run `merged` (the base
        /// model with the adapters merged in) or `adapters` (the adapters alone).
        #[arg(long, default_value = "all", value_parser = ["all", "merged", "adapters"])]
        part: String,
        /// The file to write (a directory for `hf` and `peft`).
        #[arg(long, short)]
        out: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum TokensCommand {
    /// Issue an enrollment token and print it.
    Issue {
        /// Devices that may enroll with it (required: a token without a limit could enroll
        /// devices without end).
        #[arg(long)]
        uses: i64,
        /// How long it is valid, in seconds [default: no expiry].
        #[arg(long)]
        ttl_secs: Option<i64>,
        /// A population its devices may check in to; repeat for several [default: default].
        #[arg(long = "population", value_name = "NAME")]
        populations: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum DevicesCommand {
    /// List enrolled devices.
    List {
        /// Print JSON rather than a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a device's credential: it can no longer call the fleet API.
    Revoke {
        /// The device.
        device: i64,
    },
}

/// The `starling` binary.
pub(crate) fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Command::Enrolment(command) = &cli.command {
        return enrolment(command, &mut std::io::stdout().lock());
    }
    let token = cli.operator_token.as_deref().context(
        "an operator token is required: set STARLING_OPERATOR_TOKEN (or pass --operator-token)",
    )?;
    let tls =
        starling_client::protocol::TlsSettings::from_files(cli.ca_cert.as_deref(), None, None)?;
    let admin = AdminClient::with_tls(&cli.url, token, &tls)?;
    let mut out = std::io::stdout().lock();
    match cli.command {
        Command::Runs(RunsCommand::Create { plan, init_from }) => {
            let mut plan = read_plan(&plan)?;
            if let Some(from) = init_from {
                let init = model_init_from(&admin, &from).await?;
                set_model_init(&mut plan, init)?;
            }
            let run = admin.create_run(&plan).await?;
            writeln!(out, "{}", run.id)?;
            eprintln!("created run {} ({}) in population {:?}", run.id, name(&run), run.population);
        }
        Command::Runs(RunsCommand::List { json }) => {
            let runs = admin.runs().await?;
            if json {
                serde_json::to_writer_pretty(&mut out, &runs)?;
                writeln!(out)?;
            } else {
                writeln!(
                    out,
                    "{:>5}  {:<28}  {:<20}  {:<9}  {:>7}  {:>6}",
                    "run", "name", "population", "status", "rounds", "model"
                )?;
                for r in &runs {
                    writeln!(
                        out,
                        "{:>5}  {:<28}  {:<20}  {:<9}  {:>7}  {:>6}",
                        r.id,
                        name(r),
                        r.population,
                        r.status,
                        format!("{}/{}", r.rounds_committed, r.total_rounds),
                        r.model_version
                    )?;
                }
            }
        }
        Command::Runs(RunsCommand::Watch { run, interval_secs }) => {
            let interval = watch_interval(interval_secs)?;
            drop(out);
            watch(&admin, RunId(run), interval).await?;
        }
        Command::Runs(RunsCommand::Stop { run }) => {
            let view = admin.stop(RunId(run)).await?;
            writeln!(out, "run {} {}", view.id, view.status)?;
        }
        Command::Models(ModelsCommand::List { run, json }) => {
            let models = admin.models(RunId(run)).await?;
            if json {
                serde_json::to_writer_pretty(&mut out, &models)?;
                writeln!(out)?;
            } else {
                writeln!(
                    out,
                    "{:>7}  {:>5}  {:>14}  {:>14}  {:<16}",
                    "version", "round", "federated acc", "central acc", "hash"
                )?;
                for m in &models {
                    let round = m.round_idx.map_or("-".to_owned(), |r| r.to_string());
                    // Given up by the run's checkpoint interval: listed, but not exportable.
                    let kept = if m.given_up { "  not kept" } else { "" };
                    writeln!(
                        out,
                        "{:>7}  {:>5}  {:>14}  {:>14}  {:<16}{kept}",
                        m.version,
                        round,
                        percent(m.evaluation.get("accuracy").copied()),
                        percent(central_accuracy(m)),
                        &m.content_hash[..m.content_hash.len().min(16)]
                    )?;
                }
            }
        }
        Command::Models(ModelsCommand::Import { file, name }) => {
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let base = admin.import_base_model(&name, bytes).await?;
            writeln!(
                out,
                "{} ({}: {} tensors, {} bytes)",
                base.content_hash,
                base.name,
                base.schema.tensors.len(),
                base.bytes
            )?;
        }
        Command::Models(ModelsCommand::Bases { json }) => {
            let bases = admin.base_models().await?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&bases)?)?;
            } else {
                writeln!(out, "{:<64}  {:>8}  {:>12}  name", "content hash", "tensors", "bytes")?;
                for b in bases {
                    writeln!(
                        out,
                        "{:<64}  {:>8}  {:>12}  {}",
                        b.content_hash,
                        b.schema.tensors.len(),
                        b.bytes,
                        b.name
                    )?;
                }
            }
        }
        Command::Models(ModelsCommand::ImportHf { dir, name, length, spec_out }) => {
            use starling_core::tensor::{f32_to_le_bytes, safetensors};
            let read = |file: &str| {
                let path = dir.join(file);
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
            };
            let config = String::from_utf8(read("config.json")?).context("config.json")?;
            let imported =
                starling_core::hf_import::import(&config, &read("model.safetensors")?, length)?;
            let file = safetensors::to_safetensors(
                &imported.schema,
                &f32_to_le_bytes(&imported.values),
                &Default::default(),
            );
            let base = admin.import_base_model(&name, file).await?;
            let spec = serde_json::to_string_pretty(&imported.spec)?;
            std::fs::write(&spec_out, spec)
                .with_context(|| format!("writing {}", spec_out.display()))?;
            writeln!(
                out,
                "{} ({}: {} tensors, {} bytes); model spec in {}",
                base.content_hash,
                base.name,
                base.schema.tensors.len(),
                base.bytes,
                spec_out.display()
            )?;
        }
        Command::Models(ModelsCommand::ImportTokenizer { file, name }) => {
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let t = admin.import_tokenizer(&name, bytes).await?;
            writeln!(
                out,
                "{} ({}: ids below {}, {} bytes)",
                t.content_hash, t.name, t.vocab_size, t.bytes
            )?;
        }
        Command::Models(ModelsCommand::Tokenizers { json }) => {
            let tokenizers = admin.tokenizers().await?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&tokenizers)?)?;
            } else {
                writeln!(out, "{:<64}  {:>8}  {:>12}  name", "content hash", "vocab", "bytes")?;
                for t in tokenizers {
                    writeln!(
                        out,
                        "{:<64}  {:>8}  {:>12}  {}",
                        t.content_hash, t.vocab_size, t.bytes, t.name
                    )?;
                }
            }
        }
        Command::Models(ModelsCommand::Export { run, version, format, part, out: path }) => {
            let run = RunId(run);
            let version = match version {
                Some(v) => v,
                None => admin.run(run).await?.model_version,
            };
            if format == "hf" || format == "peft" {
                anyhow::ensure!(part == "all", "--part {part} needs --format safetensors");
                let files = hugging_face_files(&admin, run, version, &format).await?;
                std::fs::create_dir_all(&path)
                    .with_context(|| format!("making {}", path.display()))?;
                for (name, bytes) in &files {
                    let file = path.join(name);
                    std::fs::write(&file, bytes)
                        .with_context(|| format!("writing {}", file.display()))?;
                }
                let names: Vec<&str> = files.keys().copied().collect();
                writeln!(
                    out,
                    "run {run} model {version}: {} in {}",
                    names.join(" and "),
                    path.display()
                )?;
                return Ok(());
            }
            let bytes = match part.as_str() {
                "all" => admin.model_file(run, version, &format).await?,
                part if format == "safetensors" => {
                    admin.model_part_file(run, version, part).await?
                }
                part => anyhow::bail!("--part {part} needs --format safetensors"),
            };
            std::fs::write(&path, &bytes).with_context(|| format!("writing {}", path.display()))?;
            writeln!(
                out,
                "run {run} model {version}: {} bytes of {format} in {}",
                bytes.len(),
                path.display()
            )?;
        }
        Command::Tokens(TokensCommand::Issue { uses, ttl_secs, populations }) => {
            let populations = (!populations.is_empty()).then_some(populations);
            let request = starling_core::admin::NewEnrollmentToken {
                uses: Some(uses),
                ttl_secs,
                populations,
            };
            let token = admin.enrollment_token_with(&request).await?;
            writeln!(out, "{}", token.token)?;
        }
        Command::Devices(DevicesCommand::List { json }) => {
            let devices = admin.devices().await?;
            if json {
                serde_json::to_writer_pretty(&mut out, &devices)?;
                writeln!(out)?;
            } else {
                writeln!(out, "{:>7}  {:>15}  {:<7}", "device", "enrolled (ms)", "revoked")?;
                for d in &devices {
                    writeln!(
                        out,
                        "{:>7}  {:>15}  {:<7}",
                        d.device_id, d.enrolled_at_ms, d.revoked
                    )?;
                }
            }
        }
        Command::Devices(DevicesCommand::Revoke { device }) => {
            let view = admin.revoke_device(DeviceId(device)).await?;
            writeln!(out, "device {} revoked", view.device_id)?;
        }
        Command::Enrolment(_) => unreachable!("answered without the admin API"),
    }
    Ok(())
}

/// `starling enrolment …`: key material on the operator's machine, nothing over the network.
fn enrolment(command: &EnrolmentCommand, out: &mut impl Write) -> anyhow::Result<()> {
    use starling_core::secagg::{EnrolmentAuthority, parse_public_key};
    match command {
        EnrolmentCommand::NewAuthority { out: path } => {
            let authority = starling_client::protocol::new_enrolment_authority();
            let mut file = std::fs::OpenOptions::new();
            file.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut file, 0o600);
            let mut file = file.open(path).with_context(|| {
                format!("creating {} (an existing file is kept)", path.display())
            })?;
            writeln!(file, "{}", authority.secret_hex())?;
            writeln!(out, "{}", authority.public_hex())?;
        }
        EnrolmentCommand::Certify { authority, identity } => {
            let text = std::fs::read_to_string(authority)
                .with_context(|| format!("reading {}", authority.display()))?;
            let signer = EnrolmentAuthority::from_secret_hex(&text)
                .map_err(|why| anyhow::anyhow!("{}: {why}", authority.display()))?;
            let identity = parse_public_key(identity)
                .map_err(|why| anyhow::anyhow!("the identity key: {why}"))?;
            writeln!(out, "{}", signer.certify(&identity).to_hex())?;
        }
    }
    Ok(())
}

/// The longest `runs watch --interval-secs`: a day between looks is already no watching.
const MAX_WATCH_INTERVAL_SECS: f64 = 86_400.0;

/// `--interval-secs` as a duration, or a clear error (`Duration::from_secs_f64` panics on
/// values past its range, such as 1e300).
fn watch_interval(secs: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        secs.is_finite() && secs > 0.0 && secs <= MAX_WATCH_INTERVAL_SECS,
        "--interval-secs must be a number of seconds in (0, {MAX_WATCH_INTERVAL_SECS}], not {secs}"
    );
    Ok(Duration::from_secs_f64(secs))
}

/// Puts `init` in the plan's `model.init`, refusing a plan that is not an object or whose
/// `model` is not one (indexing a JSON value that is not an object panics).
fn set_model_init(plan: &mut serde_json::Value, init: serde_json::Value) -> anyhow::Result<()> {
    let plan = plan
        .as_object_mut()
        .context("--init-from: the plan must be an object with a \"model\" object")?;
    let model = plan
        .get_mut("model")
        .and_then(serde_json::Value::as_object_mut)
        .context("--init-from: the plan's \"model\" must be an object (it names the layers)")?;
    model.insert("init".to_owned(), init);
    Ok(())
}

/// `model.init` holding the values of the committed model `RUN:VERSION`.
async fn model_init_from(admin: &AdminClient, from: &str) -> anyhow::Result<serde_json::Value> {
    use base64::Engine as _;
    let (run, version) = from
        .split_once(':')
        .and_then(|(r, v)| Some((r.parse::<i64>().ok()?, v.parse::<i64>().ok()?)))
        .with_context(|| format!("--init-from {from:?}: expected RUN:VERSION, e.g. 3:10"))?;
    let payload = admin
        .model_file(RunId(run), version, "payload")
        .await
        .with_context(|| format!("downloading model {version} of run {run}"))?;
    let payload: starling_core::tensor::TensorPayload = starling_core::codec::decode(&payload)
        .with_context(|| format!("model {version} of run {run} is not a model payload"))?;
    let data_base64 = base64::engine::general_purpose::STANDARD.encode(&payload.data);
    Ok(serde_json::json!({"kind": "parameters", "data_base64": data_base64}))
}

/// A plan file as the JSON the admin API takes: TOML by extension, JSON otherwise.
fn read_plan(path: &Path) -> anyhow::Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if path.extension().is_some_and(|e| e == "toml") {
        let value: toml::Value =
            toml::from_str(&text).with_context(|| format!("{} is not TOML", path.display()))?;
        Ok(serde_json::to_value(value)?)
    } else {
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
    }
}

/// Prints a line to standard output. A reader that went away (`runs watch 7 | head -1`) ends
/// the command quietly with success, as command-line tools do, not in a panic (exit 101,
/// "Broken pipe").
fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to standard output: {e}");
        std::process::exit(1);
    }
}

/// Whether `e` is a write to a closed pipe (the reader of our output went away).
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || cause
                .downcast_ref::<serde_json::Error>()
                .and_then(|j| j.io_error_kind())
                .is_some_and(|k| k == std::io::ErrorKind::BrokenPipe)
    })
}

/// Follows a run with a progress bar of its committed rounds (a line per change when the
/// output is not a terminal) until it is no longer running.
async fn watch(admin: &AdminClient, run: RunId, interval: Duration) -> anyhow::Result<()> {
    let view = admin.run(run).await?;
    let bar = indicatif::ProgressBar::new(u64::from(view.total_rounds));
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "run {prefix} {bar:30} {pos}/{len} rounds {elapsed} {msg}",
        )
        .expect("the template is valid"),
    );
    bar.set_prefix(view.id.to_string());
    let terminal = std::io::stderr().is_terminal();
    let mut last_line = String::new();
    let view = loop {
        let view = admin.run(run).await?;
        let models = admin.models(run).await?;
        let latest = models.iter().max_by_key(|m| m.version);
        let line = format!(
            "{}: {}/{} rounds, model {}, federated accuracy {}, central accuracy {}",
            view.status,
            view.rounds_committed,
            view.total_rounds,
            view.model_version,
            percent(latest.and_then(|m| m.evaluation.get("accuracy").copied())),
            percent(latest.and_then(central_accuracy)),
        );
        bar.set_position(view.rounds_committed.max(0) as u64);
        if terminal {
            bar.set_message(line.clone());
        } else if line != last_line {
            say(format_args!("run {run} {line}"));
        }
        last_line = line;
        if view.status != "running" {
            break view;
        }
        tokio::time::sleep(interval).await;
    };
    bar.finish_and_clear();
    if terminal {
        say(format_args!("run {run} {last_line}"));
    }
    anyhow::ensure!(
        view.status == "finished",
        "run {run} ended {} after {} of {} rounds{}",
        view.status,
        view.rounds_committed,
        view.total_rounds,
        view.stop_reason.map(|why| format!(": {why}")).unwrap_or_default()
    );
    Ok(())
}

fn name(run: &RunView) -> &str {
    run.name.as_deref().unwrap_or("-")
}

/// The mean of the central evaluators' accuracies of a model, if any reported one.
fn central_accuracy(model: &ModelView) -> Option<f64> {
    let accuracies: Vec<f64> =
        model.central.iter().filter_map(|c| c.metrics.get("accuracy").copied()).collect();
    (!accuracies.is_empty()).then(|| accuracies.iter().sum::<f64>() / accuracies.len() as f64)
}

fn percent(value: Option<f64>) -> String {
    value.map_or("-".to_owned(), |v| format!("{:.2}%", v * 100.0))
}

/// A run's model `version` in Hugging Face's form: `hf`, the model (adapters merged) as a
/// checkpoint; `peft`, a LoRA run's adapters as PEFT's.
async fn hugging_face_files(
    admin: &AdminClient,
    run: RunId,
    version: i64,
    format: &str,
) -> anyhow::Result<starling_core::hf_export::Files> {
    use starling_core::tensor::{f32_from_le_bytes, safetensors};
    let spec: starling_core::model_spec::ModelSpec =
        serde_json::from_value(admin.model_spec(run).await?).context("the run's model spec")?;
    let file = admin.model_file(run, version, "safetensors").await?;
    let values = f32_from_le_bytes(&safetensors::from_safetensors(&spec.schema()?, &file)?);
    Ok(match format {
        "peft" => starling_core::hf_export::peft_adapters(&spec, &values)?,
        _ => {
            starling_core::hf_export::checkpoint(&spec.without_lora(), &spec.merge_lora(&values)?)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `runs watch --interval-secs 1e300` used to panic in `Duration::from_secs_f64`.
    #[test]
    fn watch_intervals_out_of_range_are_clear_errors() {
        assert_eq!(watch_interval(1.5).unwrap(), Duration::from_millis(1500));
        for bad in [1e300, f64::INFINITY, f64::NAN, 0.0, -1.0, 86_401.0] {
            let err = watch_interval(bad).unwrap_err().to_string();
            assert!(err.contains("--interval-secs"), "{bad}: {err}");
        }
    }

    /// `runs create --init-from` on a plan that is not an object (or whose model is not) used
    /// to panic indexing it; now it says what is wrong, and a good plan gets the init.
    #[test]
    fn init_from_on_a_plan_that_is_not_an_object_is_a_clear_error() {
        let init = serde_json::json!({"kind": "parameters", "data_base64": ""});
        for bad in
            [serde_json::json!([1, 2]), serde_json::json!("plan"), serde_json::json!({"model": 3})]
        {
            let mut plan = bad.clone();
            let err = set_model_init(&mut plan, init.clone()).unwrap_err().to_string();
            assert!(err.contains("--init-from"), "{bad}: {err}");
            assert_eq!(plan, bad, "a refused plan is left as it was");
        }
        let mut plan = serde_json::json!({"model": {"layers": []}});
        set_model_init(&mut plan, init.clone()).unwrap();
        assert_eq!(plan["model"]["init"], init);
    }
}
