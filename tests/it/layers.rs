//! The crate's rooms form layers: read from the code itself, no top-level
//! module of `src/` reaches a module that reaches it back, and inside a
//! room no two of its modules do. Every `crate::`, `super::` and `self::`
//! path of a file (groups expanded, inline modules such as `mod tests`
//! counted, comments and literals blanked) is followed to the module that
//! defines what it names, through the `use` lines that re-export it, and
//! counts as an import between the two siblings under the modules' common
//! parent. A circle means no room can be read, tested or changed without
//! the others in mind; the check names the circle and the lines that close
//! it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Circles inside a room left as they are for now: the ledger's phase, its
/// external steps and its routes are rewritten together when a phase
/// becomes one round trip.
const KNOWN_INNER: &[&[&str]] = &[&["ledger/external", "ledger/phase", "ledger/routes"]];

#[test]
fn no_room_of_the_crate_reaches_back_to_a_room_that_reaches_it() {
    let krate = Crate::read();
    assert!(krate.files.len() > 50, "read {} files of src/", krate.files.len());
    let rooms = krate.imports(true);
    let circles = rooms.circles();
    assert!(circles.is_empty(), "the top-level modules import each other round a circle:\n{}", rooms.explain(&circles));
}

#[test]
fn no_two_modules_of_a_room_import_each_other_round_a_circle() {
    let inner = Crate::read().imports(false);
    let circles: Vec<_> = inner
        .circles()
        .into_iter()
        .filter(|circle| !KNOWN_INNER.iter().any(|known| circle.iter().map(String::as_str).eq(known.iter().copied())))
        .collect();
    assert!(circles.is_empty(), "modules of one room import each other round a circle:\n{}", inner.explain(&circles));
}

/// The crate's files, and what each module's `use` lines bring in.
struct Crate {
    /// Each file's code by its module path (`keystore/mod.rs` is
    /// `["keystore"]`); `lib.rs` and `main.rs` are left out.
    files: BTreeMap<Vec<String>, String>,
    /// What a name in a module stands for: the absolute path a `use` of
    /// the module gives it.
    uses: BTreeMap<(Vec<String>, String), Vec<String>>,
}

impl Crate {
    fn read() -> Self {
        let files = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
        let mut uses = BTreeMap::new();
        for (module, code) in &files {
            let inline = inline_modules(code);
            for (at, written) in use_lines(code) {
                let absolute = match written.path.first().map(String::as_str) {
                    Some("crate" | "super" | "self") => absolute(module, &inline, at, &written.path),
                    Some(first) if files.contains_key(&[module.clone(), vec![first.to_owned()]].concat()) => {
                        Some([module.as_slice(), written.path.as_slice()].concat())
                    }
                    _ => None,
                };
                if let Some(path) = absolute {
                    uses.insert((module.clone(), written.name().to_owned()), path);
                }
            }
        }
        Self { files, uses }
    }

    /// The module that defines what the absolute `path` names.
    fn home(&self, path: &[String], depth: usize) -> Vec<String> {
        let mut module = Vec::new();
        for segment in path {
            let child = [module.as_slice(), std::slice::from_ref(segment)].concat();
            if self.files.contains_key(&child) {
                module = child;
            } else if let Some(target) = self.uses.get(&(module.clone(), segment.clone())).filter(|_| depth < 8) {
                return self.home(target, depth + 1);
            } else {
                break;
            }
        }
        module
    }

    /// The imports between siblings: of the top-level modules (`top`), or
    /// of the modules inside one module.
    fn imports(&self, top: bool) -> Graph {
        let mut graph = Graph::default();
        for (module, code) in &self.files {
            let inline = inline_modules(code);
            for (at, written) in references(code) {
                let Some(path) = absolute(module, &inline, at, &written.path) else { continue };
                let home = self.home(&path, 0);
                let shared = module.iter().zip(&home).take_while(|(a, b)| a == b).count();
                if shared >= module.len() || shared >= home.len() || (shared == 0) != top {
                    continue;
                }
                let from = module[..=shared].join("/");
                let to = home[..=shared].join("/");
                graph.add(&from, &to, module, &written.path);
            }
        }
        graph
    }
}

/// `path` as written at byte `at` of `module`'s code, made absolute: `self`
/// and `super` counted from the inline module the path is written in.
fn absolute(module: &[String], inline: &[(usize, usize, String)], at: usize, path: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = module.to_vec();
    base.extend(inline.iter().filter(|(start, end, _)| (*start..*end).contains(&at)).map(|m| m.2.clone()));
    match path.first().map(String::as_str) {
        Some("crate") => Some(path[1..].to_vec()),
        Some("self") => Some([base.as_slice(), &path[1..]].concat()),
        Some("super") => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let kept = base.len().checked_sub(ups)?;
            Some([&base[..kept], &path[ups..]].concat())
        }
        _ => None,
    }
}

/// The inline modules of `code` (`mod tests { .. }`): where each opens and
/// closes, and its name, outermost first.
fn inline_modules(code: &str) -> Vec<(usize, usize, String)> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("mod ") {
        if at > 0 && code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + 4..];
        let name_end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let Some(body) = rest[name_end..].trim_start().strip_prefix('{') else { continue };
        let open = code.len() - body.len();
        let mut depth = 1;
        let close = body.char_indices().find_map(|(i, c)| {
            depth += match c {
                '{' => 1,
                '}' => -1,
                _ => 0,
            };
            (depth == 0).then_some(open + i)
        });
        found.push((open, close.unwrap_or(code.len()), rest[..name_end].to_owned()));
    }
    found
}

/// Every `.rs` file under `root` but the crate roots, by its module path
/// (`keystore/mod.rs` is `["keystore"]`), comments and literals blanked.
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
                if module == ["lib"] || module == ["main"] {
                    continue;
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
    // `r"..."`, and the byte and C string forms `br"..."` and `cr"..."`.
    let raw_prefix = |i: usize| !word_before(i) || (matches!(b[i - 1], b'b' | b'c') && !word_before(i - 1));
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
        } else if b[i] == b'r' && raw_prefix(i) && matches!(b.get(i + 1), Some(b'#' | b'"')) {
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

/// A path as written: its segments and the name a `use` gives it (`as`).
#[derive(Debug, PartialEq)]
struct Written {
    path: Vec<String>,
    alias: Option<String>,
}

impl Written {
    fn name(&self) -> &str {
        self.alias.as_deref().or(self.path.last().map(String::as_str)).unwrap_or_default()
    }
}

/// Every path in `code` that starts `crate::`, `super::` or `self::`, with
/// where it starts and groups expanded (`crate::{a::B, c}` is `crate::a::B`
/// and `crate::c`).
fn references(code: &str) -> Vec<(usize, Written)> {
    let mut out = Vec::new();
    for root in ["crate", "super", "self"] {
        let needle = format!("{root}::");
        for (at, _) in code.match_indices(&needle) {
            let starts_word = at == 0 || !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':');
            if starts_word {
                let mut found = Vec::new();
                expand(&code[at + needle.len()..], vec![root.to_owned()], &mut found);
                out.extend(found.into_iter().map(|written| (at, written)));
            }
        }
    }
    out
}

/// Every path a `use` of `code` names, relative ones included, with where
/// the `use` starts.
fn use_lines(code: &str) -> Vec<(usize, Written)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("use ") {
        if at > 0 && code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let mut found = Vec::new();
        expand(&code[at + 4..], Vec::new(), &mut found);
        out.extend(found.into_iter().map(|written| (at, written)));
    }
    out
}

/// The paths `rest` continues `prefix` with.
fn expand(rest: &str, mut prefix: Vec<String>, out: &mut Vec<Written>) {
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
        rest = rest[end..].trim_start();
        match rest.strip_prefix("::") {
            Some(more) => rest = more.trim_start(),
            None => {
                let alias = rest.strip_prefix("as ").map(|a| {
                    let a = a.trim_start();
                    a[..a.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(a.len())].to_owned()
                });
                out.push(Written { path: prefix, alias });
                return;
            }
        }
    }
    if !prefix.is_empty() {
        out.push(Written { path: prefix, alias: None });
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
        "use crate::{a::B, c::{d, e::F as G}};\n// crate::x\nlet s = \"crate::y\"; let c = '\"'; let r = br\"\\\";\n\
         f(super::super::g::h); use other_crate::z;\nmod tests { use super::*; }",
    );
    let found: Vec<_> = references(&code).into_iter().map(|(_, w)| (w.path.join("::"), w.alias)).collect();
    let expected = [
        ("crate::a::B", None),
        ("crate::c::d", None),
        ("crate::c::e::F", Some("G".to_owned())),
        ("super::super::g::h", None),
        ("super", None),
    ];
    assert_eq!(found.iter().map(|(p, a)| (p.as_str(), a.clone())).collect::<Vec<_>>(), expected);
    let tests = inline_modules(&code);
    assert_eq!(tests.iter().map(|m| m.2.as_str()).collect::<Vec<_>>(), ["tests"]);
    let module = ["room".to_owned(), "file".to_owned()];
    let (in_tests, _) = references(&code).into_iter().find(|(_, w)| w.path == ["super"]).unwrap();
    let inside = absolute(&module, &tests, in_tests, &["super".to_owned(), "x".to_owned()]).unwrap();
    assert_eq!(inside, ["room", "file", "x"], "super inside `mod tests` is the file itself");
    let outside = absolute(&module, &tests, 0, &["super".to_owned(), "super".to_owned(), "x".to_owned()]).unwrap();
    assert_eq!(outside, ["x"]);
}
