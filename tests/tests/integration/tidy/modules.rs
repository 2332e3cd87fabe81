//! The module graph of a crate, read from its sources: which of its modules name which, for the
//! tidy test that keeps each crate's modules a DAG.
//!
//! A module is a file (`lib.rs` is the crate, `a/b.rs` is `a::b`); an edge is a path it names
//! (`use` trees and inline `crate::`, `super::`, `self::` paths) resolved to the longest module
//! it starts with. A parent and its own descendants may name each other (a child reaching up
//! with `super::` is how Rust modules are written); any other edge is lifted to the two
//! siblings under the modules' common ancestor, and those must not form a cycle. Unit-test
//! modules, binaries and comments are left out: they are not what the library depends on.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path inside its crate (`[]` is the crate root).
pub type ModulePath = Vec<String>;

/// Every edge between sibling modules of the crate whose sources are under `src`.
pub fn sibling_edges(src: &Path) -> BTreeSet<(ModulePath, ModulePath)> {
    let mut files = vec![];
    library_files(src, &mut files);
    let modules: BTreeMap<ModulePath, PathBuf> =
        files.into_iter().map(|f| (module_of(src, &f), f)).collect();
    let mut edges = BTreeSet::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).expect("readable source");
        for path in named_paths(&without_tests_and_comments(&text)) {
            let Some(full) = resolve(module, &path) else { continue };
            let target = (0..=full.len())
                .rev()
                .map(|k| full[..k].to_vec())
                .find(|prefix| modules.contains_key(prefix))
                .expect("the crate root is a module");
            let common = module.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == module.len() || common == target.len() {
                continue; // the same module, an ancestor or a descendant
            }
            edges.insert((module[..=common].to_vec(), target[..=common].to_vec()));
        }
    }
    edges
}

/// A cycle among `edges`, as the modules along it, if there is one.
pub fn find_cycle(edges: &BTreeSet<(ModulePath, ModulePath)>) -> Option<Vec<ModulePath>> {
    let mut graph: BTreeMap<&ModulePath, Vec<&ModulePath>> = BTreeMap::new();
    for (a, b) in edges {
        graph.entry(a).or_default().push(b);
    }
    // Depth-first search with the path on the stack: 0 unseen, 1 on the path, 2 done.
    fn visit<'a>(
        node: &'a ModulePath,
        graph: &BTreeMap<&'a ModulePath, Vec<&'a ModulePath>>,
        state: &mut BTreeMap<&'a ModulePath, u8>,
        path: &mut Vec<&'a ModulePath>,
    ) -> Option<Vec<ModulePath>> {
        state.insert(node, 1);
        path.push(node);
        for &next in graph.get(node).into_iter().flatten() {
            match state.get(next).copied().unwrap_or(0) {
                1 => {
                    let start = path.iter().position(|p| *p == next).expect("on the path");
                    return Some(path[start..].iter().map(|p| (*p).clone()).collect());
                }
                0 => {
                    if let Some(cycle) = visit(next, graph, state, path) {
                        return Some(cycle);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(node, 2);
        None
    }
    let mut state = BTreeMap::new();
    for &node in graph.keys() {
        if state.get(node).copied().unwrap_or(0) == 0
            && let Some(cycle) = visit(node, &graph, &mut state, &mut vec![])
        {
            return Some(cycle);
        }
    }
    None
}

/// The library's source files: not binaries, not unit-test files.
fn library_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading a source dir") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("").to_owned();
        if path.is_dir() {
            if name != "bin" && name != "tests" {
                library_files(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" && name != "main.rs" {
            out.push(path);
        }
    }
}

fn module_of(src: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src).expect("under src").with_extension("");
    let mut segments: ModulePath =
        relative.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    if matches!(segments.last().map(String::as_str), Some("lib" | "mod")) {
        segments.pop();
    }
    segments
}

/// The code without its unit-test module (`#[cfg(test)] mod tests { .. }`, braces counted)
/// and without comment lines.
fn without_tests_and_comments(text: &str) -> String {
    let code: String =
        text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    let Some(at) = code.find("#[cfg(test)]\nmod tests {") else { return code };
    let body = at + code[at..].find('{').expect("the module's brace");
    let mut depth = 0;
    for (i, c) in code[body..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => continue,
        }
        if depth == 0 {
            return format!("{}{}", &code[..at], &code[body + i + 1..]);
        }
    }
    code[..at].to_owned()
}

/// Every path the code names that starts with `crate`, `super` or `self`.
fn named_paths(code: &str) -> Vec<String> {
    let mut paths = vec![];
    // `use` declarations: a line that starts one (after any visibility), up to its `;`.
    let mut offset = 0;
    for line in code.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let declaration = trimmed
            .strip_prefix("pub ")
            .or_else(|| trimmed.strip_prefix("pub(").and_then(|r| r.split_once(") ")).map(|x| x.1))
            .unwrap_or(trimmed);
        if let Some(tree) = declaration.strip_prefix("use ") {
            let start = offset + (line.len() - tree.len());
            let end = code[start..].find(';').map_or(code.len(), |e| start + e);
            let tree: String = code[start..end].chars().filter(|c| !c.is_whitespace()).collect();
            paths.extend(expand_use_tree(&tree));
        }
        offset += line.len();
    }
    for root in ["crate", "super", "self"] {
        let mut rest = code;
        while let Some(at) = find_word(rest, root) {
            let tail = &rest[at..];
            let len = tail
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            paths.push(tail[..len].trim_end_matches(':').to_owned());
            rest = &tail[len.max(1)..];
        }
    }
    paths
}

/// Where `word` starts in `text` as a whole word.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = text[from..].find(word).map(|i| i + from) {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        if !before.is_some_and(is_ident) && !after.is_some_and(is_ident) {
            return Some(i);
        }
        from = i + word.len();
    }
    None
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`.
fn expand_use_tree(tree: &str) -> Vec<String> {
    let Some(open) = tree.find('{') else { return vec![tree.to_owned()] };
    let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
    let (prefix, inner) = (&tree[..open], &tree[open + 1..close]);
    let mut parts = vec![];
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| expand_use_tree(&format!("{prefix}{p}")))
        .collect()
}

/// `path` (as named in `module`) from the crate root; `None` when it is not the crate's.
fn resolve(module: &ModulePath, path: &str) -> Option<ModulePath> {
    let mut segments = path.split("::").filter(|s| !s.is_empty() && *s != "*").peekable();
    let mut base: ModulePath = match *segments.peek()? {
        "crate" => {
            segments.next();
            vec![]
        }
        "super" | "self" => module.clone(),
        _ => return None,
    };
    while let Some(&s) = segments.peek() {
        match s {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        segments.next();
    }
    base.extend(segments.map(str::to_owned));
    Some(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_trees_expand_and_paths_resolve_from_their_module() {
        let expanded = expand_use_tree("crate::{a::{B,c::D},e}");
        assert_eq!(expanded, vec!["crate::a::B", "crate::a::c::D", "crate::e"]);
        let module: ModulePath = vec!["driver".into(), "close".into()];
        assert_eq!(
            resolve(&module, "super::recover::replay"),
            Some(vec!["driver".into(), "recover".into(), "replay".into()])
        );
        assert_eq!(resolve(&module, "std::io"), None);
        let edges: BTreeSet<(ModulePath, ModulePath)> = [
            (vec!["a".into()], vec!["b".into()]),
            (vec!["b".into()], vec!["c".into()]),
            (vec!["c".into()], vec!["a".into()]),
        ]
        .into();
        assert_eq!(find_cycle(&edges).map(|c| c.len()), Some(3));
    }
}
