//! Starling's dev tasks; std only, so they build in seconds.
//!
//! * `cargo xtask test`: the one command that runs every check, on a fresh machine too. It
//!   makes sure a Postgres is reachable (installing Debian's `postgresql` and starting its
//!   cluster when there is none), exports `DATABASE_URL`, installs Mesa's software Vulkan
//!   (`mesa-vulkan-drivers`, so the wgpu training test has an adapter) when missing, then runs
//!   formatting, clippy and the whole test suite. The Python packages some tests check against
//!   (`xtask/python-requirements.txt`) go into a virtual environment beside the build.
//!   `.ci/run` calls exactly this.
//!   After the Rust tests it builds the dashboard and runs its browser tests, and generates the
//!   mobile bindings and runs the Python- and Kotlin-bindings tests (the Kotlin compiler comes
//!   from the npm registry, JNA and a JDK from Debian's packages, when missing), then builds
//!   the Python SDK's wheel, installs it into a fresh venv and runs its pytest suite (PyTorch
//!   from a venv outside the clone, installed once).
//! * `cargo xtask demo`: the main job. A coordinator on a fresh embedded SQLite store, and the
//!   client SDK's simulator federating a real model on real data against it.

use std::env;
use std::io::{IsTerminal, Write};
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
        // The mobile bindings' tests alone, on an existing build (the last part of `test`).
        Some("mobile-tests") => mobile_tests(),
        // The Python SDK's wheel and pytest suite alone, on an existing build.
        Some("python-sdk-tests") => python_sdk_tests(),
        Some("postgres") => {
            println!("DATABASE_URL={}", ensure_postgres()?);
            Ok(())
        }
        _ => bail!(
            "usage: cargo xtask test | cargo xtask demo [simulate flags...] | cargo xtask mobile-tests | cargo xtask postgres"
        ),
    }
}

fn test() -> anyhow::Result<()> {
    let database_url = match env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => ensure_postgres()?,
    };
    ensure_software_vulkan()?;
    keep_disk_headroom(&target_dir(&repo_root()?))?;
    let python = ensure_python_tools(&repo_root()?)?;
    let hf_python = ensure_hf_venv(&repo_root()?)?;
    // The container test serves the built dashboard, as the image does.
    build_dashboard(&repo_root()?.join("web-dashboard"))?;
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    step("format", Command::new(&cargo).args(["fmt", "--all", "--", "--check"]))?;
    step(
        "clippy",
        build_cargo(&cargo).args(["clippy"]).args(WORKSPACE).args([
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // The mobile library as an app's build compiles it: alone, not with the features the
    // workspace unifies (it once compiled only there, using a module gated behind `tools`).
    step(
        "mobile library alone",
        build_cargo(&cargo).args(["check", "-q", "-p", "starling-mobile", "--lib"]),
    )?;
    let nextest = Command::new(&cargo)
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut tests = build_cargo(&cargo);
    if nextest {
        tests.args(["nextest", "run"]).args(WORKSPACE).arg("--no-fail-fast");
    } else {
        tests.args(["test"]).args(WORKSPACE).arg("--no-fail-fast");
    }
    tests.env("DATABASE_URL", &database_url);
    wgpu_env(&mut tests)?;
    // Lavapipe was installed above: the wgpu training test must find it, not skip.
    tests.env("STARLING_REQUIRE_WGPU", "1");
    // So were the Python packages: the tests that check against them must not skip either.
    tests.env("STARLING_PYTHON", &python).env("STARLING_REQUIRE_PYTHON_TOOLS", "1");
    tests.env("STARLING_HF_PYTHON", &hf_python);
    // A skipped test passes: the tests that skip write why here, and the list is printed last.
    let skip_log = target_dir(&repo_root()?).join("skipped-tests.txt");
    let _ = std::fs::remove_file(&skip_log);
    tests.env("STARLING_SKIP_LOG", &skip_log);
    let outcome = step("tests", &mut tests)
        .and_then(|()| dashboard_tests(&cargo))
        .and_then(|()| mobile_tests())
        .and_then(|()| python_sdk_tests());
    report_skips(&skip_log);
    outcome
}

/// Prints the tests that passed without running (no GPU, no NCCL), so a summary says so.
fn report_skips(skip_log: &Path) {
    let skipped = std::fs::read_to_string(skip_log).unwrap_or_default();
    let lines: Vec<&str> = skipped.lines().filter(|l| !l.trim().is_empty()).collect();
    eprintln!("==> tests that skipped here (they pass without running): {}", lines.len());
    for line in lines {
        eprintln!("    {line}");
    }
}

/// What every workspace build of both commands builds: all members, and the mobile crate's
/// bindings generator (its command line is a feature, so that the library apps link has none).
/// The same everywhere, so one build serves clippy, the tests and the binaries.
const WORKSPACE: [&str; 3] = ["--workspace", "--features", "starling-mobile/bindgen"];

/// Cargo for the workspace builds of both commands (the same settings, so one build serves
/// both). Without incremental state: a whole-suite run gains little from it and it was a quarter
/// of the target directory (17 GB) when CI's disk filled up.
fn build_cargo(cargo: &str) -> Command {
    let mut cmd = Command::new(cargo);
    cmd.env("CARGO_INCREMENTAL", "0");
    cmd
}

/// Free space the suite wants on the target directory's disk before it builds (a cold build
/// writes about 10 GB).
const WANTED_FREE_BYTES: u64 = 20 << 30;
/// Past this the target directory is mostly stale artifacts (every other clone path, lockfile or
/// feature set leaves its own hashed copies behind), so it is cleared.
const TARGET_DIR_BUDGET_BYTES: u64 = 40 << 30;

/// Keeps the stable target directory from filling the disk: a run that starts short of space
/// first drops incremental state, then the whole debug build, and says so. The price is one cold
/// build; the alternative was a CI run that died with "No space left on device".
fn keep_disk_headroom(target: &Path) -> anyhow::Result<()> {
    let short = |size: u64, free: Option<u64>| {
        size > TARGET_DIR_BUDGET_BYTES || free.is_some_and(|f| f < WANTED_FREE_BYTES)
    };
    let (size, free) = (directory_bytes(target), free_bytes(target));
    eprintln!(
        "==> disk: target directory {:.1} GiB, {} free",
        gib(size),
        free.map_or_else(|| "unknown".to_owned(), |f| format!("{:.1} GiB", gib(f)))
    );
    if !short(size, free) {
        return Ok(());
    }
    let debug = target.join("debug");
    for (dir, why) in [
        (debug.join("incremental"), "short of disk"),
        (debug, "still short of disk; a cold build follows"),
    ] {
        if dir.exists() {
            eprintln!("==> disk: {why}: removing {}", dir.display());
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        if !short(directory_bytes(target), free_bytes(target)) {
            return Ok(());
        }
    }
    if let Some(free) = free_bytes(target).filter(|&f| f < WANTED_FREE_BYTES) {
        eprintln!(
            "==> disk: warning: only {:.1} GiB free after clearing the build; the build may fail",
            gib(free)
        );
    }
    Ok(())
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// Bytes under `dir` (0 when it does not exist); symlinks are not followed.
fn directory_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .map(|entry| match entry.file_type() {
            Ok(kind) if kind.is_dir() => directory_bytes(&entry.path()),
            Ok(kind) if kind.is_file() => entry.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Free bytes on the disk holding `path` (or its nearest existing ancestor), from POSIX `df`.
fn free_bytes(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let output = Command::new("df").arg("-Pk").arg(existing).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    // "Filesystem 1024-blocks Used Available Capacity Mounted-on", then one line of numbers.
    let available_kib: u64 = text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()?;
    Some(available_kib * 1024)
}

/// Generates the mobile bindings from the built library and runs the Python- and
/// Kotlin-bindings tests against a live coordinator; the Android sample app is type-checked
/// against the Kotlin bindings with stubs for the `android.*` it uses. Swift generates only:
/// no Swift compiler runs on Linux build machines here.
fn mobile_tests() -> anyhow::Result<()> {
    let root = repo_root()?;
    let target = target_dir(&root);
    let debug = target.join("debug");
    let library = debug.join("libstarling_mobile.so");
    let out = target.join("mobile-bindings");
    for language in ["python", "kotlin", "swift"] {
        let dir = out.join(language);
        let _ = std::fs::remove_dir_all(&dir);
        let mut generate = Command::new(debug.join("uniffi-bindgen"));
        generate.arg("generate").arg("--library").arg(&library);
        generate.args(["--language", language, "--no-format", "--out-dir"]).arg(&dir);
        step(&format!("{language} bindings"), &mut generate)?;
    }
    let python = out.join("python");
    std::fs::copy(&library, python.join("libstarling_mobile.so"))
        .context("copying the library beside the Python bindings")?;
    let mut test = Command::new("python3");
    test.arg(root.join("mobile").join("tests").join("test_python_bindings.py"))
        .env("PYTHONPATH", &python)
        .env("STARLING_COORDINATOR_BIN", debug.join("starling-coordinator"))
        .env("STARLING_DIGITS_DIR", root.join("client-sdk").join("data").join("sklearn_digits"));
    wgpu_env(&mut test)?;
    step("mobile bindings tests (Python)", &mut test)?;
    kotlin_tests(&root, &debug, &out)
}

/// The Kotlin compiler `kotlin_tests` uses: the npm registry's `kotlin-compiler` package is the
/// JetBrains command-line compiler (JVM target, kotlin-stdlib included). Pinned: the generated
/// bindings are checked against this version.
const KOTLIN_COMPILER: &str = "kotlin-compiler@2.4.20";
/// Debian's JNA (`libjna-java`), which UniFFI's Kotlin loads the library through.
const JNA_JAR: &str = "/usr/share/java/jna.jar";

/// Compiles the generated Kotlin, runs `mobile/tests/kotlin/BindingsTest.kt` on the JVM against
/// a live coordinator, and type-checks the Android sample app against the same bindings.
fn kotlin_tests(root: &Path, debug: &Path, bindings: &Path) -> anyhow::Result<()> {
    let kotlinc = ensure_kotlin_compiler(&target_dir(root))?;
    let tests = root.join("mobile").join("tests").join("kotlin");
    let out = bindings.join("kotlin-jars");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).context("creating the Kotlin output directory")?;
    let generated = bindings.join("kotlin").join("uniffi").join("starling_mobile");
    let bindings_jar = out.join("starling-bindings.jar");
    let mut compile = Command::new(&kotlinc);
    compile.arg(generated.join("starling_mobile.kt")).args(["-cp", JNA_JAR, "-d"]);
    step("Kotlin bindings compile", compile.arg(&bindings_jar))?;
    let classpath = |extra: &[&Path]| {
        let mut parts = vec![bindings_jar.clone(), JNA_JAR.into()];
        parts.extend(extra.iter().map(|p| p.to_path_buf()));
        std::env::join_paths(parts).context("a classpath")
    };
    let test_jar = out.join("bindings-test.jar");
    let mut compile = Command::new(&kotlinc);
    compile.arg(tests.join("BindingsTest.kt")).arg("-cp").arg(classpath(&[])?).arg("-d");
    step("Kotlin bindings test compile", compile.arg(&test_jar))?;
    let stdlib = kotlinc.parent().and_then(Path::parent).context("kotlinc's home")?;
    let stdlib = stdlib.join("lib").join("kotlin-stdlib.jar");
    let mut test = Command::new("java");
    test.arg(format!("-Djna.library.path={}", debug.display()))
        .arg("-cp")
        .arg(classpath(&[&test_jar, &stdlib])?)
        .arg("dev.starling.bindingstest.BindingsTestKt")
        .env("STARLING_COORDINATOR_BIN", debug.join("starling-coordinator"))
        .env("STARLING_DIGITS_DIR", root.join("client-sdk").join("data").join("sklearn_digits"));
    wgpu_env(&mut test)?;
    step("mobile bindings tests (Kotlin, JVM)", &mut test)?;
    let sample = root.join("mobile").join("android").join("sample").join("src").join("main");
    let mut check = Command::new(&kotlinc);
    check.arg(
        sample.join("java").join("dev").join("starling").join("sample").join("MainActivity.kt"),
    );
    for stub in std::fs::read_dir(tests.join("android-stubs")).context("the Android stubs")? {
        check.arg(stub?.path());
    }
    check.arg("-cp").arg(classpath(&[])?).arg("-d").arg(out.join("android-sample.jar"));
    step("Android sample type-check (stubs for android.*)", &mut check)
}

/// kotlinc from the npm registry (beside the build, fetched once), with a JDK and Debian's JNA
/// installed when missing; returns kotlinc's path.
fn ensure_kotlin_compiler(target: &Path) -> anyhow::Result<std::path::PathBuf> {
    if !Command::new("java").arg("-version").output().is_ok_and(|o| o.status.success()) {
        apt_install("default-jdk-headless")?;
    }
    if !Path::new(JNA_JAR).exists() {
        apt_install("libjna-java")?;
    }
    let home = target.join("kotlin-tools").join(KOTLIN_COMPILER);
    let kotlinc = home.join("package").join("bin").join("kotlinc");
    if kotlinc.exists() {
        return Ok(kotlinc);
    }
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).context("creating the Kotlin tools directory")?;
    // npm checks the tarball against the registry's integrity hash.
    step(
        "fetch the Kotlin compiler",
        Command::new("npm").current_dir(&home).args(["pack", "--silent", KOTLIN_COMPILER]),
    )?;
    let tarball = std::fs::read_dir(&home)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "tgz"))
        .context("npm pack left no tarball")?;
    step(
        "unpack the Kotlin compiler",
        Command::new("tar").current_dir(&home).arg("xzf").arg(&tarball),
    )?;
    let _ = std::fs::remove_file(&tarball);
    anyhow::ensure!(kotlinc.exists(), "{KOTLIN_COMPILER} has no {}", kotlinc.display());
    Ok(kotlinc)
}

/// wgpu's runtime wants `XDG_RUNTIME_DIR`; its shader and autotune cache stays out of the home
/// directory.
fn wgpu_env(cmd: &mut Command) -> anyhow::Result<()> {
    let scratch = env::temp_dir().join("starling-test-xdg");
    std::fs::create_dir_all(&scratch).context("creating the XDG scratch directory")?;
    if env::var_os("XDG_RUNTIME_DIR").is_none() {
        cmd.env("XDG_RUNTIME_DIR", &scratch);
    }
    cmd.env("XDG_CACHE_HOME", scratch.join("cache"));
    Ok(())
}

/// Builds the dashboard and runs its browser tests (headless Chromium through playwright-core)
/// against the real coordinator and simulator binaries.
fn dashboard_tests(cargo: &str) -> anyhow::Result<()> {
    let root = repo_root()?;
    if !Path::new("/usr/bin/chromium").exists() {
        apt_install("chromium")?;
    }
    let web = root.join("web-dashboard");
    // The same targets (and so the same feature set) the test run just built: nothing rebuilds.
    step(
        "build the binaries",
        build_cargo(cargo)
            .current_dir(&root)
            .args(["build", "-q"])
            .args(WORKSPACE)
            .arg("--all-targets"),
    )?;
    let target = target_dir(&root).join("debug");
    step(
        "dashboard browser tests",
        Command::new("npm")
            .current_dir(&web)
            .args(["test"])
            .env("STARLING_COORDINATOR_BIN", target.join("starling-coordinator"))
            .env("STARLING_CLIENT_BIN", target.join("starling-client"))
            .env("STARLING_ARTIFACTS", target_dir(&root).join("dashboard-screenshots")),
    )
}

/// `npm ci` when the packages are missing or stale, then the Vite build into `dist/`.
fn build_dashboard(web: &Path) -> anyhow::Result<()> {
    let installed = web.join("node_modules").join(".package-lock.json");
    let stale = |marker: &Path| {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        modified(marker) < modified(&web.join("package-lock.json"))
    };
    if stale(&installed) {
        step(
            "npm ci",
            Command::new("npm").current_dir(web).args(["ci", "--no-audit", "--no-fund"]),
        )?;
    }
    step("dashboard build", Command::new("npm").current_dir(web).args(["run", "build"]))
}

/// The checkout this run is for. `cargo run` says where xtask's manifest is at run time; the
/// path compiled in is only a fallback, because clones share one target dir (CI's and a
/// developer's), and the xtask binary there may have been built from another clone.
fn repo_root() -> anyhow::Result<std::path::PathBuf> {
    let manifest_dir =
        env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    Ok(Path::new(&manifest_dir).parent().context("xtask sits in the repo")?.to_owned())
}

fn target_dir(root: &Path) -> std::path::PathBuf {
    env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), Into::into)
}

fn demo(extra: &[String]) -> anyhow::Result<()> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let root = repo_root()?;
    // The dashboard needs Node.js; without it the demo runs without one.
    let dashboard =
        if Command::new("npm").arg("--version").output().is_ok_and(|o| o.status.success()) {
            build_dashboard(&root.join("web-dashboard"))?;
            Some(root.join("web-dashboard").join("dist"))
        } else {
            eprintln!("==> npm not found: running without the dashboard");
            None
        };
    // The whole workspace's binaries: the same feature set as `cargo xtask test`, so one build
    // serves both commands (building two packages alone resolves burn's features differently
    // and rebuilds it).
    step(
        "build",
        build_cargo(&cargo).current_dir(&root).args(["build", "-q"]).args(WORKSPACE).arg("--bins"),
    )?;
    let target = target_dir(&root).join("debug");
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
            // The demo stays on this machine's loopback; production serves TLS (README).
            "--insecure-http",
            "--listen",
            &listen,
            "--database-url",
            &format!("sqlite://{}", data.join("demo.db").display()),
        ])
        .args(
            dashboard.iter().flat_map(|d| [std::ffi::OsStr::new("--dashboard-dir"), d.as_os_str()]),
        )
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
    if dashboard.is_some() {
        println!("dashboard: http://{listen}/dashboard/ (sign in with the admin API token above)");
    }
    let mut simulate = Command::new(target.join("starling-client"));
    simulate.args(["simulate", "--url", &format!("http://{listen}")]);
    // The bundled digits make the default demo zero-setup; a caller may point elsewhere.
    if !extra.iter().any(|a| a.starts_with("--data-dir")) {
        simulate.arg("--data-dir").arg(root.join("client-sdk").join("data"));
    }
    wgpu_env(&mut simulate)?;
    let status = simulate.args(extra).env("STARLING_OPERATOR_TOKEN", &token).status();
    // Someone at a terminal may still be looking at the dashboard: keep it up until they're done.
    if dashboard.is_some() && std::io::stdin().is_terminal() {
        println!(
            "training done; the dashboard stays up at http://{listen}/dashboard/ — press Enter to stop"
        );
        let _ = std::io::stdin().read_line(&mut String::new());
    }
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

/// A virtual environment with `xtask/python-requirements.txt` installed from PyPI (again only
/// when that file changes); returns its interpreter.
fn ensure_python_tools(root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let requirements = root.join("xtask").join("python-requirements.txt");
    ensure_venv(&target_dir(root).join("python-tools"), &requirements)
}

/// The venv the Hugging Face tests build checkpoints in: `tests/python/hf-requirements.txt`
/// (transformers) over the Python SDK's PyTorch venv, which it sees through a .pth file.
fn ensure_hf_venv(root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let torch = torch_venv();
    let requirements =
        root.join("client-sdk").join("python").join("tests").join("requirements.txt");
    let torch_python = ensure_venv(&torch, &requirements)?;
    let hf = torch.with_file_name("hf-venv");
    ensure_venv_over(
        &hf,
        &root.join("tests").join("python").join("hf-requirements.txt"),
        Some(&torch_python),
    )
}

/// The directory a venv's interpreter `python` imports pure packages from.
fn site_packages(python: &Path) -> anyhow::Result<String> {
    let output = Command::new(python)
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .output()?;
    Ok(String::from_utf8(output.stdout)?.trim().to_owned())
}

/// A virtual environment at `venv` with `requirements` installed from PyPI, again only when
/// that file changes; returns its interpreter.
fn ensure_venv(venv: &Path, requirements: &Path) -> anyhow::Result<std::path::PathBuf> {
    ensure_venv_over(venv, requirements, None)
}

/// [`ensure_venv`], seeing the packages of the venv of interpreter `base` too (installed
/// before `requirements`, so that pip takes what is there).
fn ensure_venv_over(
    venv: &Path,
    requirements: &Path,
    base: Option<&Path>,
) -> anyhow::Result<std::path::PathBuf> {
    let python = venv.join("bin").join("python");
    let wanted = std::fs::read_to_string(requirements).context("reading the requirements")?;
    let installed = venv.join("installed-requirements.txt");
    if std::fs::read_to_string(&installed).is_ok_and(|had| had == wanted) && python.exists() {
        return Ok(python);
    }
    let mut create = Command::new("python3");
    create.args(["-m", "venv", "--clear"]).arg(venv);
    if !create.status().is_ok_and(|s| s.success()) {
        apt_install("python3-venv")?;
        step("python venv", &mut create)?;
    }
    if let Some(base) = base {
        std::fs::write(
            Path::new(&site_packages(&python)?).join("starling-base.pth"),
            site_packages(base)?,
        )
        .context("pointing the venv at its base")?;
    }
    step(
        &format!("python packages ({})", requirements.display()),
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(["--progress-bar", "off", "-r"])
            .arg(requirements),
    )?;
    std::fs::write(&installed, wanted).context("recording the installed requirements")?;
    Ok(python)
}

/// Where PyTorch lives for the Python SDK's tests: outside the clone and outside the target
/// directory (whose size is kept under a budget), so warm runs reuse its 5 GiB.
fn torch_venv() -> std::path::PathBuf {
    env::var_os("STARLING_TORCH_VENV")
        .map_or_else(|| "/var/tmp/starling-torch/venv".into(), std::path::PathBuf::from)
}

/// Builds the Python SDK's wheel (maturin, abi3), installs it with pip into a fresh venv that
/// sees PyTorch from `torch_venv`, and runs its pytest suite against the coordinator binary.
fn python_sdk_tests() -> anyhow::Result<()> {
    let root = repo_root()?;
    let target = target_dir(&root);
    let tools = ensure_python_tools(&root)?;
    let sdk = root.join("client-sdk").join("python");
    let torch_python = ensure_venv(&torch_venv(), &sdk.join("tests").join("requirements.txt"))?;
    let out = target.join("python-sdk");
    let wheels = out.join("wheels");
    let _ = std::fs::remove_dir_all(&wheels);
    let maturin = tools.parent().context("the tools venv's bin")?.join("maturin");
    // The dev profile, as the rest of the suite builds: its dependencies are already built.
    let mut build = Command::new(maturin);
    build.args(["build", "--quiet", "--profile", "dev", "-m"]).arg(sdk.join("Cargo.toml"));
    build.arg("-o").arg(&wheels).arg("-i").arg(&torch_python).env("CARGO_INCREMENTAL", "0");
    step("Python SDK wheel (maturin)", &mut build)?;
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("maturin wrote no wheel")?;
    // A fresh venv each run, as a user's: only the wheel is installed into it, with pip; torch,
    // numpy and pytest come from the stable venv through a .pth file.
    let venv = out.join("venv");
    step("fresh venv", Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv))?;
    let python = venv.join("bin").join("python");
    std::fs::write(
        Path::new(&site_packages(&python)?).join("starling-torch.pth"),
        site_packages(&torch_python)?,
    )
    .context("pointing the fresh venv at PyTorch")?;
    let mut install = Command::new(&python);
    install.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]);
    step("pip install the wheel", install.arg(&wheel))?;
    let mut pytest = Command::new(&python);
    pytest.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"]).arg(sdk.join("tests"));
    pytest.env("STARLING_COORDINATOR_BIN", target.join("debug").join("starling-coordinator"));
    step("Python SDK tests (pytest, PyTorch)", &mut pytest)
}

/// Makes a local Postgres reachable with a role that may create databases; returns its URL.
fn ensure_postgres() -> anyhow::Result<String> {
    if !Path::new("/usr/bin/pg_ctlcluster").exists() {
        apt_install("postgresql")?;
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

/// Installs Mesa's lavapipe (a Vulkan driver on the CPU) unless some Vulkan driver is there.
fn ensure_software_vulkan() -> anyhow::Result<()> {
    let has_driver = std::fs::read_dir("/usr/share/vulkan/icd.d")
        .is_ok_and(|mut entries| entries.any(|e| e.is_ok()));
    if has_driver { Ok(()) } else { apt_install("mesa-vulkan-drivers") }
}

/// Installs one of Debian's packages, through sudo unless already root.
fn apt_install(package: &str) -> anyhow::Result<()> {
    eprintln!("==> installing Debian's {package}");
    let root = is_root();
    let apt = |args: &[&str]| -> anyhow::Result<()> {
        let mut cmd = if root { Command::new("apt-get") } else { Command::new("sudo") };
        if !root {
            cmd.arg("apt-get");
        }
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        check("apt-get", cmd.status().context("running apt-get")?)
    };
    apt(&["update", "-q"])?;
    apt(&["install", "-y", "-q", package])
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}
