//! `nextn`: the command-line entry point. Each subcommand lives in `commands/`.

use std::process::ExitCode;

/// Large blocks on huge pages, kept for reuse (a prefill's buffers fault in once, not per op).
#[global_allocator]
static ALLOC: nextn_engine::alloc::Retaining = nextn_engine::alloc::Retaining;

use clap::{Parser, Subcommand};

mod commands;

#[derive(Parser)]
#[command(name = "nextn", version, about = "nextn: speculative-decoding inference engine for sparse MoE models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the logits at every prompt position as JSON: {"logits": [[f32; vocab] per position]}.
    ///
    /// Meant for diffing numerics against other engines (e.g. HF transformers) on the same checkpoint.
    Logits(commands::logits::Args),
    /// Generate a continuation of a prompt (text or token ids), streaming text or printing JSON:
    /// {"token_ids": [...], "text": ..., "finish_reason": "stop|length|context", "stats": {...}}.
    Generate(commands::generate::Args),
    /// Answer one viewer comment as the live-stream host: harness prompt, MCP tools, hooks, at most 4 loops.
    Agent(commands::agent::Args),
    /// Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)
    /// with continuous batching across all requests.
    Serve(commands::serve::Args),
    /// Harness utilities.
    #[command(subcommand)]
    Harness(HarnessCommand),
    /// Rank the model's tokens by frequency in a corpus and write draft_vocab.txt (the reduced MTP draft
    /// vocabulary that `--draft-vocab N` reads beside the model), with the share of the corpus each size covers.
    DraftVocab(commands::draft_vocab::Args),
}

#[derive(Subcommand)]
enum HarnessCommand {
    /// Validate a harness directory (front matter, unique ids, schemas, hook commands, FAQ).
    Check(commands::agent::CheckArgs),
    /// Print exactly what `nextn agent` sends the model (rendered prompts, optionally token ids) for a comment
    /// or for scripted conversations (--cases), running the real harness, MCP tools and hooks: JSON lines.
    Render(commands::render::RenderArgs),
    /// Write a task-preserving variant of a harness (Harness-State Augmentation) along five dimensions
    /// (skill-id, skill-content, tool-def, prompt, hook) with a perturbation.json manifest of every change.
    Perturb(commands::perturb::PerturbArgs),
}

fn main() -> ExitCode {
    // Bad flags are the caller's mistake: exit 1 like every other caller error (clap would use 2).
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
        }
    };
    let result = match cli.command {
        Command::Logits(args) => commands::logits::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Agent(args) => commands::agent::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Harness(HarnessCommand::Check(args)) => commands::agent::check(args),
        Command::Harness(HarnessCommand::Render(args)) => commands::render::render(args),
        Command::Harness(HarnessCommand::Perturb(args)) => commands::perturb::run(args),
        Command::DraftVocab(args) => commands::draft_vocab::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A reader that closed stdout early (`nextn logits ... | head -c 200`) has what it wanted: exit 0
        // quietly, as `outln!` does for line output.
        Err(e) if closed_stdout(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether `e` comes from writing to a closed pipe (directly or through serde_json's writer).
fn closed_stdout(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<serde_json::Error>().and_then(|j| j.io_error_kind()) == Some(std::io::ErrorKind::BrokenPipe)
    })
}
