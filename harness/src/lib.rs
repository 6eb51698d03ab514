//! nextn-harness: the agent's harness state (skills, prompt pipeline, hooks, tool registry).
//! Built by the harness-agent issue; this crate only anchors the workspace layout for now.
