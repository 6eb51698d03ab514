//! nextn-agent: the harness agent (loop, MCP client, LLM clients, tool-call parsing, traces) and the
//! `nextn` binary's commands.

pub mod agent;
pub mod llm;
pub mod mcp;
pub mod serve;
pub mod toolcall;
pub mod trace;
