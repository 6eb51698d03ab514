//! External command hooks: the command is spawned with the payload as JSON on stdin (plus `"hook": name`).
//! Exit 0 allows (stdout, if not blank, is a `Decision` as JSON: `{"decision":"correct","value":...}`,
//! `{"decision":"retry","reason":...}`, ...); exit 2 blocks with stderr as the reason; anything else — another
//! exit code, a signal, a timeout, a command that cannot start, unreadable stdout — is a `HookError`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::config::{ExternalHookConfig, OnError};
use super::{Decision, HookPayload};

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error(
        "cannot run `{command}`: {source} (is it on PATH, or a path relative to the harness directory, and executable?)"
    )]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "`{command}` did not finish within {timeout_ms} ms (raise `timeout_ms` in hooks.json or make the hook faster)"
    )]
    Timeout { command: String, timeout_ms: u64 },
    #[error("`{command}` exited with {status} (0 = allow, 2 = block); stderr: {stderr}")]
    Exit { command: String, status: String, stderr: String },
    #[error(
        "`{command}` printed something that is not a decision ({message}); expected e.g. {{\"decision\":\"retry\",\"reason\":\"...\"}}"
    )]
    BadOutput { command: String, message: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExternalHook {
    pub command: String,
    pub args: Vec<String>,
    pub timeout: Duration,
    pub on_error: OnError,
    /// The working directory (the harness directory); relative command paths resolve against it.
    pub dir: PathBuf,
}

fn is_executable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

/// Where `command` would run from: a path with a `/` resolves against `dir`; a bare name is searched on `PATH`.
/// `None` when no executable file is there.
pub fn resolve_command(command: &str, dir: &Path) -> Option<PathBuf> {
    if command.is_empty() {
        return None;
    }
    if command.contains('/') || command.contains(std::path::MAIN_SEPARATOR) {
        let p = Path::new(command);
        let p = if p.is_absolute() { p.to_path_buf() } else { dir.join(p) };
        return is_executable(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(command)).find(|p| is_executable(p))
}

impl ExternalHook {
    pub fn new(config: &ExternalHookConfig, dir: &Path) -> Self {
        ExternalHook {
            command: config.command.clone(),
            args: config.args.clone(),
            timeout: Duration::from_millis(config.timeout_ms),
            on_error: config.on_error,
            dir: dir.to_path_buf(),
        }
    }

    /// Run the command on `payload` and read its decision.
    pub fn call(&self, hook_name: &str, payload: &HookPayload) -> Result<Decision, HookError> {
        let command = self.command.clone();
        let mut input = serde_json::to_value(payload).unwrap_or(Value::Null);
        if let Value::Object(m) = &mut input {
            m.insert("hook".into(), Value::String(hook_name.to_string()));
        }
        let input = serde_json::to_vec(&input).unwrap_or_default();
        let program = resolve_command(&self.command, &self.dir).unwrap_or_else(|| PathBuf::from(&self.command));
        let spawn = || {
            Command::new(&program)
                .args(&self.args)
                .current_dir(&self.dir)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        };
        // ETXTBSY: a script written a moment ago can still be open for writing in a child another thread just
        // forked; it clears as soon as that child execs.
        const ETXTBSY: i32 = 26;
        let mut attempt = 0;
        let mut child = loop {
            match spawn() {
                Err(e) if e.raw_os_error() == Some(ETXTBSY) && attempt < 20 => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => break other.map_err(|source| HookError::Spawn { command: command.clone(), source })?,
            }
        };

        // Feed stdin and drain stdout/stderr on threads so a chatty or silent hook cannot deadlock us.
        let mut stdin = child.stdin.take();
        std::thread::spawn(move || {
            if let Some(s) = stdin.as_mut() {
                let _ = s.write_all(&input); // a hook that ignores stdin closes it early: not an error
            }
        });
        let (tx, rx) = mpsc::channel::<(bool, Vec<u8>)>();
        for (is_out, pipe) in [
            (true, child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>)),
            (false, child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>)),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut buf);
                }
                let _ = tx.send((is_out, buf));
            });
        }
        drop(tx);

        let deadline = Instant::now() + self.timeout;
        let timeout = || HookError::Timeout { command: command.clone(), timeout_ms: self.timeout.as_millis() as u64 };
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(timeout());
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(2)),
                Err(source) => return Err(HookError::Spawn { command: command.clone(), source }),
            }
        };
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            // A grandchild still holding the pipes open counts as running past the timeout.
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(50));
            match rx.recv_timeout(left) {
                Ok((true, b)) => stdout = b,
                Ok((false, b)) => stderr = b,
                Err(_) => return Err(timeout()),
            }
        }
        let stdout = String::from_utf8_lossy(&stdout).trim().to_string();
        let stderr = String::from_utf8_lossy(&stderr).trim().to_string();
        match status.code() {
            Some(0) if stdout.is_empty() => Ok(Decision::Allow),
            Some(0) => serde_json::from_str::<Decision>(&stdout).map_err(|e| HookError::BadOutput {
                command,
                message: format!("{e}: {}", stdout.chars().take(200).collect::<String>()),
            }),
            Some(2) => Ok(Decision::Block {
                reason: if stderr.is_empty() { format!("blocked by hook `{hook_name}`") } else { stderr },
            }),
            Some(code) => Err(HookError::Exit { command, status: format!("code {code}"), stderr }),
            None => Err(HookError::Exit { command, status: "a signal".into(), stderr }),
        }
    }
}
