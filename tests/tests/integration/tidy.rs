//! Tidy checks that keep the architecture and house rules true, run as ordinary tests.

use std::path::{Path, PathBuf};
use std::process::Command;

mod modules;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the repo root").to_owned()
}

fn files_with_extension(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading a source dir") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "node_modules" | ".git" | "starling-data")
                && !name.starts_with('.')
            {
                files_with_extension(&path, ext, out);
            }
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// The project's Rust files: not the patched third-party copies under `vendor/`, which keep
/// their upstream's code and rules (`vendor/README.md`).
fn rust_files() -> Vec<PathBuf> {
    let mut files = vec![];
    files_with_extension(&repo_root(), "rs", &mut files);
    let vendor = repo_root().join("vendor");
    files.retain(|f| !f.starts_with(&vendor));
    assert!(files.len() > 10, "found only {} Rust files", files.len());
    files
}

/// Every Rust file says why it exists in a `//!` doc at its top.
#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let missing: Vec<_> = rust_files()
        .into_iter()
        .filter(|f| !std::fs::read_to_string(f).expect("readable source").starts_with("//!"))
        .collect();
    assert!(missing.is_empty(), "files without a leading //! doc: {missing:#?}");
}

/// Tests gate on their environment explicitly; they never hide behind these attributes.
#[test]
fn no_ignored_or_should_panic_tests() {
    let this_file = Path::new(file!()).file_name().expect("file name").to_owned();
    let offenders: Vec<_> = rust_files()
        .into_iter()
        .filter(|f| f.file_name() != Some(&this_file))
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("readable source");
            text.contains("#[ignore") || text.contains("#[should_panic")
        })
        .collect();
    assert!(offenders.is_empty(), "{offenders:#?}");
}

/// starling-core is sans-IO: no async runtime, database, HTTP or ML framework in its graph.
#[test]
fn core_depends_on_no_io_or_training_crate() {
    let tree = normal_dependencies("starling-core");
    assert!(tree.iter().any(|p| p == "ciborium"), "unexpected tree output: {tree:?}");
    for forbidden in ["tokio", "sqlx", "burn", "axum", "reqwest", "hyper", "mio"] {
        assert!(!tree.iter().any(|p| p == forbidden), "starling-core depends on {forbidden}");
    }
}

/// The library apps link carries no command-line code: clap, indicatif and the dataset loaders'
/// flate2 stay in the binaries' features. (anyhow does reach it: UniFFI's runtime
/// uses it.)
#[test]
fn the_mobile_library_links_no_command_line_code() {
    let tree = normal_dependencies("starling-mobile");
    assert!(tree.iter().any(|p| p == "burn"), "unexpected tree output: {tree:?}");
    for forbidden in ["clap", "indicatif", "flate2"] {
        assert!(!tree.iter().any(|p| p == forbidden), "starling-mobile links {forbidden}");
    }
}

/// The servers aggregate flat tensors and never train: burn (and wgpu) stay out of their
/// builds, which keeps them small and quick to build.
#[test]
fn the_coordinator_and_aggregator_never_link_burn() {
    for package in ["starling-coordinator", "starling-aggregator"] {
        let tree = normal_dependencies(package);
        assert!(tree.iter().any(|p| p == "starling-core"), "unexpected tree output: {tree:?}");
        for forbidden in ["burn", "wgpu"] {
            assert!(!tree.iter().any(|p| p == forbidden), "{package} links {forbidden}");
        }
    }
}

/// Within each crate, modules depend on each other without cycles (a parent and its own
/// children aside), so each can be read, tested and changed from the bottom up.
#[test]
fn modules_within_each_crate_depend_on_each_other_without_cycles() {
    let crates = ["core", "coordinator", "aggregator", "client-sdk", "mobile", "tests", "xtask"];
    let mut cycles = vec![];
    for krate in crates {
        let edges = modules::sibling_edges(&repo_root().join(krate).join("src"));
        // The parser must see the large crates' module graphs, or the test checks nothing.
        let large = ["core", "coordinator", "aggregator", "client-sdk"].contains(&krate);
        assert!(!large || edges.len() > 10, "{} edges in {krate}", edges.len());
        if let Some(cycle) = modules::find_cycle(&edges) {
            let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
            cycles.push(format!("{krate}: {}", names.join(" → ")));
        }
    }
    assert!(cycles.is_empty(), "module cycles: {cycles:#?}");
}

/// The names of `package`'s normal (non-dev, non-build) dependencies, with its default
/// features only.
fn normal_dependencies(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(repo_root())
        .args(["tree", "--offline", "-p", package, "-e", "normal", "--prefix", "none"])
        .args(["--format", "{p}"])
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8(out.stdout).expect("utf-8 tree");
    tree.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect()
}

/// Migrations come in reversible pairs, with the same versions for every store dialect.
#[test]
fn migrations_are_reversible_and_in_step() {
    let versions = |dialect: &str| {
        let dir = repo_root().join("migrations").join(dialect);
        let mut ups = vec![];
        for entry in std::fs::read_dir(&dir).expect("migrations dir") {
            let name = entry.expect("entry").file_name().into_string().expect("utf-8 name");
            if let Some(stem) = name.strip_suffix(".up.sql") {
                assert!(
                    dir.join(format!("{stem}.down.sql")).exists(),
                    "{dialect}/{name} has no .down.sql"
                );
                ups.push(stem.to_owned());
            }
        }
        ups.sort();
        ups
    };
    let pg = versions("postgres");
    assert!(!pg.is_empty());
    assert_eq!(pg, versions("sqlite"));
}

/// Every API route is registered through `utoipa_axum::routes!`, which documents it in the
/// OpenAPI document; plain `.route(` calls are only for what is not API (the dashboard's files,
/// the document itself).
#[test]
fn every_api_route_is_documented() {
    let http = repo_root().join("coordinator/src");
    let mut files = vec![];
    files_with_extension(&http, "rs", &mut files);
    let mut undocumented = vec![];
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            if let Some(at) = line.find(".route(\"") {
                let path = &line[at + 8..];
                if !(path.starts_with("/dashboard") || path.starts_with("/openapi.json")) {
                    undocumented.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(undocumented.is_empty(), "routes outside the OpenAPI document: {undocumented:#?}");
}

/// The README is a user guide: what Starling is, the two commands, a tour and links, within
/// 3 000 words (it twice grew past 4 900 into a reference manual; reference material lives in
/// docs/). Every relative link in it and in docs/ names a file that exists.
#[test]
fn the_readme_stays_a_guide_and_every_relative_link_resolves() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let words = readme.split_whitespace().count();
    assert!(words <= 3_000, "README.md is {words} words: move reference material to docs/");
    let mut documents = vec![root.join("README.md")];
    files_with_extension(&root.join("docs"), "md", &mut documents);
    let mut broken = vec![];
    for doc in &documents {
        let text = std::fs::read_to_string(doc).expect("a markdown file");
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.contains(char::is_whitespace)
                || target.starts_with('#')
                || target.contains("://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let path = target.split('#').next().unwrap_or_default();
            if !doc.parent().expect("a file's folder").join(path).exists() {
                broken.push(format!("{}: {target}", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "relative links to nothing: {broken:#?}");
}

/// The functions of a rustfmt-formatted file longer than `limit` lines, as `file:line name
/// (n lines)`: a function runs from its `fn` line to the first line that closes it at its
/// own indentation.
fn functions_over(path: &Path, limit: usize) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("readable source");
    let lines: Vec<&str> = text.lines().collect();
    let mut long = vec![];
    for (start, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let indent = &line[..line.len() - code.len()];
        let signature = ["pub(crate) ", "pub(super) ", "pub ", "const ", "async "]
            .iter()
            .fold(code, |rest, prefix| rest.strip_prefix(prefix).unwrap_or(rest));
        let Some(name) = signature.strip_prefix("fn ") else { continue };
        let name = name.split(['(', '<']).next().unwrap_or_default();
        let close = format!("{indent}}}");
        let Some(end) = lines[start..].iter().position(|l| *l == close) else { continue };
        if end + 1 > limit {
            long.push(format!("{}:{} {name} ({} lines)", path.display(), start + 1, end + 1));
        }
    }
    long
}

/// The plan is checked section by section: no function in `core/src/plan*` (tests included)
/// is over 80 lines (`Plan::validate` twice grew past 200 as one function).
#[test]
fn plan_validation_stays_in_functions_a_reader_can_hold() {
    let core = repo_root().join("core/src");
    let mut files = vec![core.join("plan.rs")];
    files_with_extension(&core.join("plan"), "rs", &mut files);
    let long: Vec<String> = files.iter().flat_map(|f| functions_over(f, 80)).collect();
    assert!(long.is_empty(), "functions over 80 lines: {long:#?}");
    // The measure sees a long function where there is one.
    let round_tests = core.join("round/tests/closing.rs");
    assert!(!functions_over(&round_tests, 80).is_empty(), "the measure finds nothing long");
}
