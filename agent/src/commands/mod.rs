/// `println!` for command output that a reader may close early (`nextn agent --json | head -c 300`): a closed
/// pipe ends the process quietly with exit 0 (the reader has what it wanted) instead of a panic; any other
/// write error is exit 1 with the reason.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("error: writing to stdout: {e}");
            std::process::exit(1);
        }
    }};
}


pub mod common;
pub mod draft_vocab;
pub mod logits;
pub mod generate;
pub mod agent;
pub mod serve;
pub mod render;
pub mod perturb;
