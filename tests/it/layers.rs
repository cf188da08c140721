//! The crate's rooms form layers: read from the code itself, no top-level
//! module of `src/` reaches (through `crate::` paths, each file belonging
//! to its top-level module) a module that reaches it back, and inside a room
//! no two files import each other round a circle. A circle means no room
//! can be read, tested or changed without the others in mind; this check
//! names the circle and the lines that close it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Circles inside a room left as they are for now: the ledger's phase, its
/// external steps and its routes are rewritten together when a phase
/// becomes one round trip.
const KNOWN_INNER: &[&[&str]] = &[&["ledger/external", "ledger/phase", "ledger/routes"]];

#[test]
fn no_room_of_the_crate_reaches_back_to_a_room_that_reaches_it() {
    let files = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(files.len() > 50, "read {} files of src/", files.len());
    let mut rooms = Graph::default();
    for (module, text) in &files {
        let room = &module[0];
        if matches!(room.as_str(), "lib" | "main") {
            continue;
        }
        for path in paths(text, "crate") {
            let Some(to) = path.first() else { continue };
            if to != room && files.keys().any(|m| m.first() == Some(to)) {
                rooms.add(room, to, module, &path);
            }
        }
    }
    let circles = rooms.circles();
    assert!(circles.is_empty(), "the top-level modules import each other round a circle:\n{}", rooms.explain(&circles));
}

#[test]
fn no_two_files_of_a_room_import_each_other_round_a_circle() {
    let files = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut siblings = Graph::default();
    for (module, text) in &files {
        let Some((_, parent)) = module.split_last().filter(|(_, parent)| !parent.is_empty()) else { continue };
        let from = module.join("/");
        let found = paths(text, "crate")
            .into_iter()
            .chain(paths(text, "super").into_iter().map(|p| [parent, p.as_slice()].concat()));
        for path in found {
            let Some(sibling) = path.strip_prefix(parent).and_then(|rest| rest.first()) else { continue };
            let to = [parent, std::slice::from_ref(sibling)].concat();
            if to != *module && files.contains_key(&to) {
                siblings.add(&from, &to.join("/"), module, &path);
            }
        }
    }
    let circles: Vec<_> = siblings
        .circles()
        .into_iter()
        .filter(|circle| !KNOWN_INNER.iter().any(|known| circle.iter().map(String::as_str).eq(known.iter().copied())))
        .collect();
    assert!(circles.is_empty(), "files of one room import each other round a circle:\n{}", siblings.explain(&circles));
}

/// Every `.rs` file under `root`, by its module path (`keystore/mod.rs` is
/// `["keystore"]`, `src/lib.rs` is `["lib"]`), comments and literals blanked.
fn sources(root: &Path) -> BTreeMap<Vec<String>, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path: PathBuf = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(root).unwrap().with_extension("");
                let mut module: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                if module.last().is_some_and(|m| m == "mod") {
                    module.pop();
                }
                out.insert(module, code_only(&std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out
}

/// `text` with comments removed and string and character literals emptied,
/// so a path named in prose or in a string is not an import.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let (mut out, mut i) = (String::with_capacity(b.len()), 0);
    let word_before = |i: usize| i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            i = text[i..].find('\n').map_or(b.len(), |n| i + n);
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'r' && !word_before(i) && matches!(b.get(i + 1), Some(b'#' | b'"')) {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            if b.get(i + 1 + hashes) == Some(&b'"') {
                let end = format!("\"{}", "#".repeat(hashes));
                let from = i + 2 + hashes;
                i = text[from..].find(&end).map_or(b.len(), |n| from + n + end.len());
                out.push_str("\"\"");
            } else {
                out.push('r');
                i += 1;
            }
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if let Some(end) = char_literal_end(text, i) {
            i = end;
            out.push_str("' '");
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Where the character literal opening at `i` ends, if one does (a `'` is
/// also a lifetime's mark).
fn char_literal_end(text: &str, i: usize) -> Option<usize> {
    let rest = text[i..].strip_prefix('\'')?;
    match rest.chars().next()? {
        '\\' => rest.get(2..)?.find('\'').map(|n| i + 1 + 2 + n + 1),
        c => rest[c.len_utf8()..].starts_with('\'').then(|| i + 1 + c.len_utf8() + 1),
    }
}

/// Every path that starts `root::` in `code`, with groups expanded
/// (`crate::{a::B, c}` is `[a, B]` and `[c]`), without `root` itself.
fn paths(code: &str, root: &str) -> Vec<Vec<String>> {
    let needle = format!("{root}::");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find(&needle).map(|n| from + n) {
        from = at + needle.len();
        let starts_word = at == 0 || !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':');
        if starts_word {
            expand(&code[from..], Vec::new(), &mut out);
        }
    }
    out
}

/// The paths `rest` continues `prefix` with.
fn expand(rest: &str, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut rest = rest.trim_start();
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (1, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' | ',' if depth == 1 => {
                        expand(&group[start..i], prefix.clone(), out);
                        start = i + 1;
                        if c == '}' {
                            return;
                        }
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return;
        }
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        prefix.push(rest[..end].to_owned());
        match rest[end..].trim_start().strip_prefix("::") {
            Some(more) => rest = more.trim_start(),
            None => break,
        }
    }
    if !prefix.is_empty() {
        out.push(prefix);
    }
}

/// Who imports whom, and the lines that say so.
#[derive(Default)]
struct Graph {
    edges: BTreeMap<String, BTreeSet<String>>,
    why: BTreeMap<(String, String), BTreeSet<String>>,
}

impl Graph {
    fn add(&mut self, from: &str, to: &str, file: &[String], path: &[String]) {
        self.edges.entry(from.to_owned()).or_default().insert(to.to_owned());
        let reason = format!("{}: {}", file.join("/"), path.join("::"));
        self.why.entry((from.to_owned(), to.to_owned())).or_default().insert(reason);
    }

    /// The strongly connected groups of more than one node (Tarjan), each
    /// sorted.
    fn circles(&self) -> Vec<Vec<String>> {
        struct Walk<'a> {
            graph: &'a Graph,
            index: BTreeMap<&'a str, usize>,
            low: BTreeMap<&'a str, usize>,
            stack: Vec<&'a str>,
            found: Vec<Vec<String>>,
        }
        impl<'a> Walk<'a> {
            fn visit(&mut self, node: &'a str) {
                let n = self.index.len();
                self.index.insert(node, n);
                self.low.insert(node, n);
                self.stack.push(node);
                for next in self.graph.edges.get(node).into_iter().flatten() {
                    if !self.index.contains_key(next.as_str()) {
                        self.visit(next);
                        let low = self.low[node].min(self.low[next.as_str()]);
                        self.low.insert(node, low);
                    } else if self.stack.contains(&next.as_str()) {
                        let low = self.low[node].min(self.index[next.as_str()]);
                        self.low.insert(node, low);
                    }
                }
                if self.low[node] == self.index[node] {
                    let at = self.stack.iter().rposition(|n| *n == node).unwrap();
                    let mut group: Vec<String> = self.stack.drain(at..).map(str::to_owned).collect();
                    if group.len() > 1 {
                        group.sort();
                        self.found.push(group);
                    }
                }
            }
        }
        let mut walk =
            Walk { graph: self, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), found: Vec::new() };
        for node in self.edges.keys() {
            if !walk.index.contains_key(node.as_str()) {
                walk.visit(node);
            }
        }
        walk.found
    }

    /// Each circle's members and the imports between them.
    fn explain(&self, circles: &[Vec<String>]) -> String {
        let mut out = String::new();
        for circle in circles {
            out.push_str(&format!("{}\n", circle.join(" ")));
            for ((from, to), reasons) in &self.why {
                if circle.contains(from) && circle.contains(to) {
                    out.push_str(&format!(
                        "  {from} -> {to}: {}\n",
                        reasons.iter().cloned().collect::<Vec<_>>().join("; ")
                    ));
                }
            }
        }
        out
    }
}

#[test]
fn paths_are_read_as_the_compiler_reads_them() {
    let code = code_only(
        "use crate::{a::B, c::{d, e::F}};\n// crate::x\nlet s = \"crate::y\"; let c = '\"'; f(crate::g::h);\nuse \
         other_crate::z;",
    );
    let found = paths(&code, "crate");
    let expected: Vec<Vec<String>> = [&["a", "B"][..], &["c", "d"], &["c", "e", "F"], &["g", "h"]]
        .iter()
        .map(|p| p.iter().map(|s| (*s).to_owned()).collect())
        .collect();
    assert_eq!(found, expected);
}
