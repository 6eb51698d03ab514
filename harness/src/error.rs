//! Errors of harness loading and use. Every error names the file (and line, when there is one) so that
//! `nextn harness check DIR` and a failed `Harness::load` say exactly what to fix.

use std::fmt;
use std::path::PathBuf;

/// `path:line` (line optional), the place a problem was found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Location {
    pub file: PathBuf,
    pub line: Option<usize>,
}

impl Location {
    pub fn file(file: impl Into<PathBuf>) -> Self {
        Location { file: file.into(), line: None }
    }
    pub fn line(file: impl Into<PathBuf>, line: usize) -> Self {
        Location { file: file.into(), line: Some(line) }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}", self.file.display(), line),
            None => write!(f, "{}", self.file.display()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("{path}: {source} (is this a harness directory? see harness/default/ for the layout)")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file is not well formed (JSON, JSON lines, front matter).
    #[error("{at}: {message}")]
    Parse { at: Location, message: String },
    /// A file is well formed but says something invalid (missing field, duplicate name, bad value).
    #[error("{at}: {message}")]
    Invalid { at: Location, message: String },
    /// A skill asked for by name (an explicit selection) does not exist.
    #[error("unknown skill `{name}`; known skills: {known}")]
    UnknownSkill { name: String, known: String },
    /// Two tools would be shown to the model under the same name.
    #[error("tool name `{name}` is used twice ({first} and {second}); add a rename in tools.json")]
    DuplicateTool { name: String, first: String, second: String },
    /// `check` found errors in the directory: every one, as `file:line: message` lines (warnings left out).
    #[error("{}", .errors.iter().map(|f| format!("{}: {}", f.location(), f.message)).collect::<Vec<_>>().join("\n"))]
    Rejected { errors: Vec<crate::check::Finding> },
    /// No `--harness`, no profile declared by the model, and the bundled `harness/default` is not there.
    #[error("no --harness given, the model declares no harness profile (nextn.json), and the bundled harness/default was not found; pass --harness DIR")]
    NoDefaultHarness,
}

impl HarnessError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        HarnessError::Io { path: path.into(), source }
    }
    pub(crate) fn parse(at: Location, message: impl Into<String>) -> Self {
        HarnessError::Parse { at, message: message.into() }
    }
    pub(crate) fn invalid(at: Location, message: impl Into<String>) -> Self {
        HarnessError::Invalid { at, message: message.into() }
    }

    /// Where the problem is, when the error has a place.
    pub fn location(&self) -> Option<Location> {
        match self {
            HarnessError::Io { path, .. } => Some(Location::file(path.clone())),
            HarnessError::Parse { at, .. } | HarnessError::Invalid { at, .. } => Some(at.clone()),
            HarnessError::Rejected { errors } => errors.first().map(crate::check::Finding::location),
            _ => None,
        }
    }

    /// The message without the location prefix.
    pub fn message(&self) -> String {
        match self {
            HarnessError::Parse { message, .. } | HarnessError::Invalid { message, .. } => message.clone(),
            HarnessError::Io { source, .. } => source.to_string(),
            other => other.to_string(),
        }
    }
}

/// A `serde_json` error with its line, for a JSON file.
pub(crate) fn json_error(file: impl Into<PathBuf>, e: &serde_json::Error) -> HarnessError {
    let file = file.into();
    let at = if e.line() > 0 { Location::line(file, e.line()) } else { Location::file(file) };
    HarnessError::parse(at, format!("invalid JSON: {e}"))
}
