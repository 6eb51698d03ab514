//! Ceilings on the numeric constraints of `harness.json`, in one place so that `check`, `Harness::load` and the
//! agent agree on them. A value above a ceiling is an error, not a clamp: a harness that asks for 50 loops or a
//! 10-minute tool timeout was written by mistake, and silently running it would hide the mistake.

/// Most model rounds per comment. Every round is a full prompt + generation; past 8 a live viewer has long
/// stopped waiting, and a loop that has not converged by then will not.
pub const MAX_LOOPS_CEILING: u32 = 8;

/// Longest timeout of one MCP `tools/call`. A tool slower than 15 s cannot serve a spoken reply; the agent
/// should say it will check instead.
pub const TOOL_TIMEOUT_CEILING_MS: u64 = 15_000;

/// Longest wall-clock budget for answering one comment (all rounds, tools and hooks). A minute is already
/// far behind a live stream; anything longer means the reply is about a product no longer on screen.
pub const REQUEST_BUDGET_CEILING_MS: u64 = 60_000;
