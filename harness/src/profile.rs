//! Which harness a run uses. A model directory may declare the harness profile it was trained on in
//! `nextn.json` beside `config.json`:
//!
//! ```json
//! {"harness": "../../harness/live-tiny"}
//! ```
//!
//! (a directory, relative to the model directory). [`choose_harness`] is the rule every command follows:
//! `--harness DIR` if given; else, for a model run in process, the profile its directory declares; else the
//! bundled `harness/default`. A model behind an OpenAI-compatible endpoint declares nothing here.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{json_error, HarnessError, Location};

/// The model directory's nextn metadata file.
pub const NEXTN_JSON: &str = "nextn.json";

/// `nextn.json`. Unknown keys are allowed: the file may carry more than the harness later.
#[derive(Debug, Deserialize)]
struct ModelMeta {
    #[serde(default)]
    harness: Option<PathBuf>,
}

/// The harness profile `model_dir/nextn.json` declares, resolved against the model directory and
/// canonicalised; `None` when there is no `nextn.json` or it names no harness. A file that is not JSON, or a
/// harness that is not an existing directory, is an error naming `nextn.json`.
pub fn profile_of_model(model_dir: &Path) -> Result<Option<PathBuf>, HarnessError> {
    let path = model_dir.join(NEXTN_JSON);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(HarnessError::invalid(Location::file(path), format!("cannot read: {e}"))),
    };
    let meta: ModelMeta = serde_json::from_str(&text).map_err(|e| json_error(&path, &e))?;
    let Some(rel) = meta.harness else { return Ok(None) };
    if rel.as_os_str().is_empty() {
        return Err(HarnessError::invalid(Location::file(path), "`harness` is empty: name the harness directory, relative to the model directory"));
    }
    let joined = model_dir.join(&rel);
    match std::fs::canonicalize(&joined) {
        Ok(dir) if dir.is_dir() => Ok(Some(dir)),
        _ => Err(HarnessError::invalid(
            Location::file(path),
            format!("`harness`: {} ({}) is not a directory; fix the path (relative to the model directory) or pass --harness DIR", rel.display(), joined.display()),
        )),
    }
}

/// The harness a run uses: `flag` (`--harness DIR`) if given; else, when the model runs in process
/// (`local_model`: its directory), the profile it declares in `nextn.json`, if any; else `bundled_default()`
/// (the bundled `harness/default`, looked up only when needed).
pub fn choose_harness(
    flag: Option<&Path>,
    local_model: Option<&Path>,
    bundled_default: impl FnOnce() -> Option<PathBuf>,
) -> Result<PathBuf, HarnessError> {
    if let Some(dir) = flag {
        return Ok(dir.to_path_buf());
    }
    if let Some(model) = local_model
        && let Some(dir) = profile_of_model(model)?
    {
        return Ok(dir);
    }
    bundled_default().ok_or(HarnessError::NoDefaultHarness)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty directory under the system temp dir.
    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nextn-profile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn repo(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
    }

    #[test]
    fn no_nextn_json_means_no_profile() {
        let d = scratch("none");
        assert_eq!(profile_of_model(&d).unwrap(), None);
        std::fs::write(d.join(NEXTN_JSON), r#"{"other": 1}"#).unwrap();
        assert_eq!(profile_of_model(&d).unwrap(), None, "a nextn.json without `harness` declares none");
    }

    #[test]
    fn bad_json_is_an_error_naming_nextn_json() {
        let d = scratch("bad");
        std::fs::write(d.join(NEXTN_JSON), "{\"harness\": ").unwrap();
        let e = profile_of_model(&d).unwrap_err();
        assert!(matches!(e, HarnessError::Parse { .. }), "{e:?}");
        assert!(e.to_string().contains(NEXTN_JSON), "{e}");
        std::fs::write(d.join(NEXTN_JSON), r#"{"harness": 3}"#).unwrap();
        assert!(profile_of_model(&d).unwrap_err().to_string().contains(NEXTN_JSON));
    }

    #[test]
    fn missing_harness_dir_is_an_error_naming_nextn_json_and_the_path() {
        let d = scratch("missing");
        std::fs::write(d.join(NEXTN_JSON), r#"{"harness": "../no-such-harness"}"#).unwrap();
        let e = profile_of_model(&d).unwrap_err();
        assert!(matches!(e, HarnessError::Invalid { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(NEXTN_JSON) && msg.contains("no-such-harness"), "{msg}");
    }

    #[test]
    fn relative_profile_resolves_against_the_model_dir() {
        let d = scratch("rel");
        std::fs::create_dir_all(d.join("h/p")).unwrap();
        std::fs::create_dir_all(d.join("models/m")).unwrap();
        std::fs::write(d.join("models/m").join(NEXTN_JSON), r#"{"harness": "../../h/p"}"#).unwrap();
        let got = profile_of_model(&d.join("models/m")).unwrap().unwrap();
        assert_eq!(got, std::fs::canonicalize(d.join("h/p")).unwrap());
    }

    #[test]
    fn bundled_model_declares_live_tiny_and_it_loads() {
        let dir = profile_of_model(&repo("models/nextn-live-tiny")).unwrap().expect("models/nextn-live-tiny/nextn.json");
        assert!(dir.ends_with("harness/live-tiny"), "{}", dir.display());
        crate::Harness::load(&dir).unwrap();
    }

    #[test]
    fn flag_beats_model_profile_beats_default() {
        let model = repo("models/nextn-live-tiny");
        let default = || Some(repo("harness/default"));
        let flag = repo("harness/default");
        assert_eq!(choose_harness(Some(&flag), Some(&model), default).unwrap(), flag);
        let from_model = choose_harness(None, Some(&model), || panic!("the default is not looked up")).unwrap();
        assert!(from_model.ends_with("harness/live-tiny"), "{}", from_model.display());
        // A model behind an endpoint (no local directory), or one that declares nothing: the default.
        assert_eq!(choose_harness(None, None, default).unwrap(), repo("harness/default"));
        assert_eq!(choose_harness(None, Some(&scratch("plain")), default).unwrap(), repo("harness/default"));
        assert!(matches!(choose_harness(None, None, || None), Err(HarnessError::NoDefaultHarness)));
    }
}
