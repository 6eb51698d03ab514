//! Helpers shared by the agent's integration tests.

use std::path::PathBuf;

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
