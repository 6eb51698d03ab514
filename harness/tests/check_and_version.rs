//! `check` finds each class of problem (with file and line), `Harness::load` fails on the same ones, and the
//! version hash is stable across loads and changes with any byte.

mod common;

use common::{TempDir, default_copy, default_dir};
use nextn_harness::{Finding, Harness, Severity, check, content_hash, has_errors};

fn errors(findings: &[Finding]) -> Vec<&Finding> {
    findings.iter().filter(|f| f.severity == Severity::Error).collect()
}

fn find<'a>(findings: &'a [Finding], file: &str, needle: &str) -> &'a Finding {
    findings
        .iter()
        .find(|f| f.file.to_string_lossy() == file && f.message.contains(needle))
        .unwrap_or_else(|| panic!("no finding in {file} containing {needle:?}: {findings:#?}"))
}

#[test]
fn version_is_stable_for_the_same_directory() {
    let a = Harness::load(default_dir()).unwrap();
    let b = Harness::load(default_dir()).unwrap();
    assert_eq!(a.version(), b.version());
    let copy = default_copy("same");
    assert_eq!(
        Harness::load(copy.path()).unwrap().version(),
        a.version(),
        "the hash does not depend on where the dir is"
    );
}

#[test]
fn version_changes_when_one_byte_changes() {
    let t = default_copy("byte");
    let before = content_hash(t.path()).unwrap();
    let text = t.read("rules.md");
    t.write("rules.md", &text.replacen("short", "shorT", 1));
    assert_ne!(content_hash(t.path()).unwrap(), before);
    t.write("rules.md", &text);
    assert_eq!(content_hash(t.path()).unwrap(), before, "restoring the byte restores the hash");
}

#[test]
fn version_changes_when_a_file_is_added_or_renamed() {
    let t = default_copy("rename");
    let before = content_hash(t.path()).unwrap();
    t.write("skills/extra/notes.txt", "x");
    let added = content_hash(t.path()).unwrap();
    assert_ne!(added, before);
    std::fs::rename(t.path().join("skills/extra/notes.txt"), t.path().join("skills/extra/notes2.txt")).unwrap();
    assert_ne!(content_hash(t.path()).unwrap(), added);
}

#[test]
fn check_reports_missing_harness_json() {
    let t = TempDir::new("empty");
    let f = check(t.path());
    find(&f, "harness.json", "cannot read");
    assert!(has_errors(&f));
    assert!(Harness::load(t.path()).is_err());
}

#[test]
fn check_reports_invalid_harness_json_with_line() {
    let t = default_copy("hjson");
    t.write("harness.json", "{\n  \"role\": \"host\",\n  \"max_loops\": \"four\"\n}\n");
    let f = check(t.path());
    assert_eq!(find(&f, "harness.json", "invalid JSON").line, Some(3));
}

#[test]
fn check_reports_front_matter_errors_with_file_and_line() {
    let t = default_copy("fm");
    t.write("skills/broken/SKILL.md", "---\nname: broken\ndescription: d\nversion 1\n---\n- [BR1] x\n");
    t.write("skills/nover/SKILL.md", "---\nname: nover\ndescription: d\n---\n- [NV1] x\n");
    t.write("skills/open/SKILL.md", "---\nname: open\n");
    let f = check(t.path());
    assert_eq!(find(&f, "skills/broken/SKILL.md", "key: value").line, Some(4));
    assert_eq!(find(&f, "skills/nover/SKILL.md", "`version`").line, Some(1));
    find(&f, "skills/open/SKILL.md", "never closed");
    let e = Harness::load(t.path()).unwrap_err();
    assert!(e.to_string().starts_with("skills/broken/SKILL.md:4:"), "{e}");
}

#[test]
fn check_reports_duplicate_skill_names() {
    let t = default_copy("dupname");
    let text = t.read("skills/size-and-fit/SKILL.md").replace("[SF", "[SX");
    t.write("skills/size-and-fit-2/SKILL.md", &text);
    let f = check(t.path());
    let dup = f
        .iter()
        .find(|x| x.message.contains("skill name `size-and-fit` is already used by"))
        .expect("duplicate reported");
    assert_eq!(dup.severity, Severity::Error);
    assert!(dup.file.to_string_lossy().starts_with("skills/size-and-fit"));
    assert!(Harness::load(t.path()).unwrap_err().to_string().contains("already used"));
}

#[test]
fn check_reports_duplicate_rule_ids_across_files() {
    let t = default_copy("duprule");
    let text = t.read("skills/after-sales/SKILL.md").replace("[AS2]", "[SF1]");
    t.write("skills/after-sales/SKILL.md", &text);
    let f = check(t.path());
    let finding =
        find(&f, "skills/size-and-fit/SKILL.md", "rule id `SF1` is already used at skills/after-sales/SKILL.md:");
    assert!(finding.line.is_some());
    let t2 = default_copy("duprule2");
    t2.write("rules.md", &format!("{}\n- [B1] again\n", t2.read("rules.md")));
    let f = check(t2.path());
    find(&f, "rules.md", "rule id `B1` is already used at rules.md:3");
    assert!(Harness::load(t2.path()).is_err());
}

#[test]
fn check_reports_every_bad_faq_line() {
    let t = default_copy("faq");
    t.write("faq.jsonl", "{\"q\": \"a?\", \"a\": \"b\"}\nnot json\n{\"q\": \"c?\"}\n{\"q\": \"a?\", \"a\": \"d\"}\n");
    let f = check(t.path());
    assert_eq!(errors(&f).iter().filter(|x| x.file.to_string_lossy() == "faq.jsonl").count(), 2);
    assert_eq!(find(&f, "faq.jsonl", "expected {").line, Some(2));
    assert!(f.iter().any(|x| x.line == Some(3) && x.severity == Severity::Error));
    assert_eq!(find(&f, "faq.jsonl", "same question as line 1").severity, Severity::Warning);
    assert!(Harness::load(t.path()).unwrap_err().to_string().starts_with("faq.jsonl:2:"));
}

#[test]
fn check_reports_missing_hook_commands() {
    let t = default_copy("hookcmd");
    t.script("hooks/ok.sh", "exit 0");
    t.write("hooks/not-exec.sh", "exit 0");
    t.write(
        "hooks.json",
        r#"{"external": [
  {"name": "ok", "point": "before_reply", "command": "hooks/ok.sh"},
  {"name": "on-path", "point": "input", "command": "sh", "args": ["-c", "exit 0"]},
  {"name": "ghost", "point": "before_reply", "command": "hooks/ghost.sh"},
  {"name": "noexec", "point": "before_reply", "command": "hooks/not-exec.sh"},
  {"name": "nowhere", "point": "input", "command": "no-such-program-nextn"}
]}"#,
    );
    let f = check(t.path());
    let hook_errors: Vec<&Finding> =
        errors(&f).into_iter().filter(|x| x.file.to_string_lossy() == "hooks.json").collect();
    assert_eq!(hook_errors.len(), 3, "{hook_errors:#?}");
    assert_eq!(find(&f, "hooks.json", "`ghost`").line, Some(4));
    find(&f, "hooks.json", "`noexec`");
    find(&f, "hooks.json", "`nowhere`");
}

#[test]
fn check_reports_bad_hooks_json() {
    let t = default_copy("hookjson");
    t.write("hooks.json", r#"{"builtins": {"reply_lenght": {}}}"#);
    let f = check(t.path());
    find(&f, "hooks.json", "reply_lenght");
    t.write("hooks.json", r#"{"external": [{"name": "x", "point": "after_reply", "command": "sh"}]}"#);
    find(&check(t.path()), "hooks.json", "after_reply");
    t.write("hooks.json", r#"{"external": [{"name": "reply_length", "point": "before_reply", "command": "sh"}]}"#);
    find(&check(t.path()), "hooks.json", "used twice");
    assert!(Harness::load(t.path()).is_err());
}

#[test]
fn check_reports_bad_tool_schemas_and_names() {
    let t = default_copy("tools");
    t.write(
        "tools.json",
        "{\"tools\": {\n  \"check_stock\": {\"input_schema\": {\"type\": \"object\", \"required\": [\"id\"]}},\n  \"get_product\": {\"aliases\": [\"item\"]},\n  \"search_products\": {\"rename\": \"item\"}\n}}",
    );
    let f = check(t.path());
    assert_eq!(find(&f, "tools.json", "`id` is not listed").line, Some(2));
    find(&f, "tools.json", "tool name `item` is declared by both `get_product` and `search_products`");
    t.write("tools.json", "{\"tools\": [1, 2]}");
    find(&check(t.path()), "tools.json", "invalid JSON");
    assert!(Harness::load(t.path()).is_err());
}

#[test]
fn check_warns_about_soft_problems() {
    let t = default_copy("warn");
    std::fs::remove_file(t.path().join("rules.md")).unwrap();
    std::fs::create_dir_all(t.path().join("skills/empty-folder")).unwrap();
    t.write("skills/no-rules/SKILL.md", "---\nname: no-rules\ndescription: d\nversion: 1\n---\nJust text.\n");
    t.write("skills/wrong-folder/SKILL.md", "---\nname: right-name\ndescription: d\nversion: 1\n---\n- [WF1] x\n");
    let f = check(t.path());
    assert!(!has_errors(&f), "{f:#?}");
    assert_eq!(find(&f, "rules.md", "missing").severity, Severity::Warning);
    find(&f, "skills/empty-folder", "without a SKILL.md");
    find(&f, "skills/no-rules/SKILL.md", "no reply rules");
    find(&f, "skills/wrong-folder/SKILL.md", "lives in folder `wrong-folder`");
    // Warnings do not stop loading.
    Harness::load(t.path()).unwrap();
}

#[test]
fn findings_print_as_severity_file_line_message() {
    let t = default_copy("display");
    t.write("faq.jsonl", "oops\n");
    let f = check(t.path());
    let line = f.iter().find(|x| x.file.to_string_lossy() == "faq.jsonl").unwrap().to_string();
    assert!(line.starts_with("error: faq.jsonl:1: "), "{line}");
}
