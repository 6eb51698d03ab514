//! One validator: for every broken fixture under `tests/fixtures/broken/`, `check` reports an error exactly when
//! `Harness::load` refuses the directory, and both name the file and the field or limit.

mod common;

use common::fixture;
use nextn_harness::{Harness, Severity, check, has_errors};

/// (fixture, loads?, file the finding is in, text the finding and the load error must contain).
const CASES: &[(&str, bool, &str, &str)] = &[
    ("missing_hook_command", false, "hooks.json", "hook `brand-words`: command `hooks/brand.sh` not found"),
    ("optional_missing_hook", true, "hooks.json", "the hook is optional and will be left out"),
    ("invalid_yaml_front_matter", false, "skills/greet/SKILL.md", "invalid YAML"),
    ("max_loops_50", false, "harness.json", "`max_loops` is 50 but the ceiling is 8"),
    ("tool_timeout_600000", false, "harness.json", "`tool_timeout_ms` is 600000 but the ceiling is 15000"),
    ("request_budget_too_high", false, "harness.json", "`request_budget_ms` is 120000 but the ceiling is 60000"),
    (
        "tool_timeout_above_budget",
        false,
        "harness.json",
        "`tool_timeout_ms` (10000) is above `request_budget_ms` (8000)",
    ),
    ("duplicate_skill_names", false, "skills/greet", "skill name `greet` is already used by"),
];

#[test]
fn every_broken_fixture_is_listed() {
    let dir = fixture("broken");
    let mut on_disk: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    on_disk.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "add new fixtures to CASES");
}

#[test]
fn check_errors_exactly_when_load_refuses() {
    for &(name, loads, file, needle) in CASES {
        let dir = fixture("broken").join(name);
        let findings = check(&dir);
        let loaded = Harness::load(&dir);
        assert_eq!(has_errors(&findings), loaded.is_err(), "{name}: check {findings:#?} vs load {:?}", loaded.err());
        assert_eq!(loaded.is_ok(), loads, "{name}: {findings:#?}");
        let hit = findings
            .iter()
            .find(|f| f.file.to_string_lossy().starts_with(file) && f.message.contains(needle))
            .unwrap_or_else(|| panic!("{name}: no finding in {file} with {needle:?}: {findings:#?}"));
        assert_eq!(hit.severity == Severity::Error, !loads, "{name}: {hit}");
        if let Err(e) = loaded {
            let text = e.to_string();
            assert!(text.contains(file) && text.contains(needle), "{name}: load error {text:?}");
        }
    }
}

#[test]
fn invalid_yaml_names_its_line() {
    let f = check(fixture("broken/invalid_yaml_front_matter"));
    let hit = f.iter().find(|f| f.message.contains("invalid YAML")).unwrap();
    assert!(matches!(hit.line, Some(3) | Some(4)), "{hit}");
}

#[test]
fn an_optional_missing_hook_is_left_out_and_recorded() {
    let h = Harness::load(fixture("broken/optional_missing_hook")).unwrap();
    assert!(h.hooks().get("brand-words").is_none());
    assert_eq!(h.hooks().skipped()[0].hook, "brand-words");
}
