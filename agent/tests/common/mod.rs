//! Helpers shared by the agent's integration tests.

use std::path::{Path, PathBuf};

/// `target/<profile>/nextn-commerce-mcp`, next to this test's `deps/` directory.
pub fn commerce_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NEXTN_COMMERCE_MCP_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join(format!(
        "nextn-commerce-mcp{}",
        std::env::consts::EXE_SUFFIX
    ));
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build -p nextn-commerce-mcp` (`cargo test --workspace` does), \
         or set NEXTN_COMMERCE_MCP_BIN",
        bin.display()
    );
    bin
}

/// A copy of the directory `src` (e.g. a harness to edit) at `dst`.
#[allow(dead_code)] // not every test binary that includes this module copies a directory
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
}
