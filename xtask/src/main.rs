//! Starling's dev tasks; std only, so they build in seconds.
//!
//! * `cargo xtask test`: the one command that runs every check, on a fresh machine too. It
//!   makes sure a Postgres is reachable (installing Debian's `postgresql` and starting its
//!   cluster when there is none), exports `DATABASE_URL`, then runs formatting, clippy and the
//!   whole test suite. `.ci/run` calls exactly this.
//! * `cargo xtask demo`: the main job. A coordinator on a fresh embedded SQLite store, and the
//!   client SDK's simulator federating a real model on real data against it.

use std::env;
use std::io::Write;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};

use anyhow::{Context, bail};

/// Role the tests connect as (see `ensure_postgres` for why it is a superuser).
const PG_ROLE: &str = "starling";
const PG_URL: &str = "postgres://starling:starling@127.0.0.1:5432/postgres";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("demo") => demo(&args[1..]),
        Some("postgres") => {
            println!("DATABASE_URL={}", ensure_postgres()?);
            Ok(())
        }
        _ => bail!(
            "usage: cargo xtask test | cargo xtask demo [simulate flags...] | cargo xtask postgres"
        ),
    }
}

fn test() -> anyhow::Result<()> {
    let database_url = match env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => ensure_postgres()?,
    };
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    step("format", Command::new(&cargo).args(["fmt", "--all", "--", "--check"]))?;
    step(
        "clippy",
        Command::new(&cargo).args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    let nextest = Command::new(&cargo)
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut tests = Command::new(&cargo);
    if nextest {
        tests.args(["nextest", "run", "--workspace", "--no-fail-fast"]);
    } else {
        tests.args(["test", "--workspace", "--no-fail-fast"]);
    }
    tests.env("DATABASE_URL", &database_url);
    step("tests", &mut tests)?;
    Ok(())
}

fn demo(extra: &[String]) -> anyhow::Result<()> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask sits in the repo")?
        .to_owned();
    step(
        "build",
        Command::new(&cargo).current_dir(&root).args([
            "build",
            "-q",
            "-p",
            "starling-coordinator",
            "-p",
            "starling-client",
        ]),
    )?;
    let target =
        env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), Into::into).join("debug");
    let data = root.join("starling-data").join("demo");
    std::fs::create_dir_all(&data).context("creating starling-data/demo")?;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(data.join(format!("demo.db{suffix}")));
    }
    let token = format!("demo-operator-{}-{}", std::process::id(), now_nanos());
    let listen = env::var("STARLING_LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".to_owned());
    let mut coordinator = Command::new(target.join("starling-coordinator"))
        .args([
            "serve",
            "--listen",
            &listen,
            "--database-url",
            &format!("sqlite://{}", data.join("demo.db").display()),
        ])
        .env("STARLING_OPERATOR_TOKEN", &token)
        .env("RUST_LOG", env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()))
        .spawn()
        .context("starting the coordinator")?;
    let ready = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        std::net::TcpStream::connect(&listen).is_ok()
    });
    if !ready {
        let _ = coordinator.kill();
        bail!("the coordinator did not start listening on {listen}");
    }
    println!(
        "coordinator on http://{listen} (embedded store in {}); admin API token: {token}",
        data.display()
    );
    let mut simulate = Command::new(target.join("starling-client"));
    simulate.args(["simulate", "--url", &format!("http://{listen}")]);
    // The bundled digits make the default demo zero-setup; a caller may point elsewhere.
    if !extra.iter().any(|a| a.starts_with("--data-dir")) {
        simulate.arg("--data-dir").arg(root.join("client-sdk").join("data"));
    }
    let status = simulate.args(extra).env("STARLING_OPERATOR_TOKEN", &token).status();
    let _ = coordinator.kill();
    let _ = coordinator.wait();
    check("simulation", status.context("running the simulator")?)
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn step(name: &str, cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("==> {name}: {cmd:?}");
    let status = cmd.status().with_context(|| format!("running {name}"))?;
    check(name, status)
}

fn check(name: &str, status: ExitStatus) -> anyhow::Result<()> {
    if !status.success() {
        bail!("{name} failed: {status}");
    }
    Ok(())
}

/// Makes a local Postgres reachable with a role that may create databases; returns its URL.
fn ensure_postgres() -> anyhow::Result<String> {
    if !Path::new("/usr/bin/pg_ctlcluster").exists() {
        eprintln!("==> installing Debian's postgresql");
        let sudo = if is_root() { vec![] } else { vec!["sudo"] };
        let apt = |args: &[&str]| -> anyhow::Result<()> {
            let mut cmd = Command::new(sudo.first().copied().unwrap_or("apt-get"));
            if !sudo.is_empty() {
                cmd.arg("apt-get");
            }
            cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
            check("apt-get", cmd.status().context("running apt-get")?)
        };
        apt(&["update", "-q"])?;
        apt(&["install", "-y", "-q", "postgresql"])?;
    }
    let version = std::fs::read_dir("/etc/postgresql")
        .context("no /etc/postgresql: is postgresql installed?")?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|v| v.parse::<u32>().ok())
        .max()
        .context("no Postgres cluster under /etc/postgresql")?
        .to_string();
    // Starting an already running cluster exits non-zero; only the outcome below matters.
    let _ = Command::new("pg_ctlcluster").args([&version, "main", "start"]).status();
    // A superuser on the loopback test cluster: `#[sqlx::test]` creates and drops databases and
    // keeps a bookkeeping schema in the master database, which a role of an earlier run (or a
    // developer's own) may own. This role is never created anywhere but a test machine.
    let create_role = format!(
        "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{PG_ROLE}') THEN \
         CREATE ROLE {PG_ROLE} LOGIN PASSWORD '{PG_ROLE}'; END IF; END $$;\n\
         ALTER ROLE {PG_ROLE} SUPERUSER;"
    );
    // The SQL goes in on stdin: through `su -c` a shell would expand its `$$`.
    let mut psql = if is_root() {
        let mut c = Command::new("su");
        c.args(["postgres", "-c", "psql -q -v ON_ERROR_STOP=1"]);
        c
    } else {
        let mut c = Command::new("sudo");
        c.args(["-u", "postgres", "psql", "-q", "-v", "ON_ERROR_STOP=1"]);
        c
    };
    let mut child = psql.stdin(Stdio::piped()).spawn().context("running psql as postgres")?;
    child.stdin.take().context("psql stdin")?.write_all(create_role.as_bytes())?;
    let status = child.wait().context("waiting for psql")?;
    check("creating the test role", status)?;
    Ok(PG_URL.to_owned())
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}
