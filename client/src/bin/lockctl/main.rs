//! `lockctl`: operate a Tether cluster from the shell.
//!
//! Exit codes: 0 success; 1 other error; 2 invalid arguments; 3 refused by
//! the lock rules (held, not the holder, stale token, unknown lease, no such
//! pin, wait aborted); 4 a wait's deadline passed; 5 no replica could serve
//! (no leader, unreachable; for a write the outcome is then unknown), no
//! candidate node fits a pin, or a quota was reached; 6 a watch revision
//! was compacted; 7 permission denied or not authenticated; 8 a replica of
//! another cluster than the one first seen answered (nothing was done).
//!
//! # Layout
//! - `cli.rs` — the clap tree, the exit codes its help prints, argument
//!   parsing clap leaves to us.
//! - `output.rs` — JSON, YAML and the tables.
//! - `cluster.rs`, `lock.rs`, `lease.rs`, `pin.rs`, `node.rs`,
//!   `events.rs` — one noun each.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use tether_client::proto::{self as pb, Outcome};
use tether_client::selector::{parse_label, parse_pin_key, parse_term, parse_weighted_term};
use tether_client::{AcquireProgress, Client, Error, Options, WatchUpdate, parse_lock_key};

mod cli;
mod cluster;
mod events;
mod lease;
mod lock;
mod node;
mod output;
mod pin;

use cli::*;
use output::*;

async fn run(cli: Cli) -> Result<(), Error> {
    let mut options = Options {
        call_timeout: cli.timeout,
        retry_timeout: cli.retry_for,
        ..Options::default()
    };
    cli.security.apply(&mut options)?;
    let client = Client::new(cli.endpoints.clone(), options)?;
    let out = Out { format: cli.output };
    match cli.command {
        Command::Cluster(cmd) => cluster::command(&client, &out, cmd).await,
        Command::Lock(cmd) => lock::command(&client, &out, cmd).await,
        Command::Lease(cmd) => lease::command(&client, &out, cmd).await,
        Command::Pin(cmd) => pin::command(&client, &out, cmd).await,
        Command::Node(cmd) => node::command(&client, &out, cmd).await,
        Command::Watch {
            from,
            kinds,
            prefix,
            count,
        } => events::watch(&client, &out, from, kinds, prefix, count).await,
        Command::History { key, since, limit } => {
            events::history(&client, &out, key, since, limit).await
        }
        // Answered in `main` before any connection is made.
        Command::Completion { .. } => Ok(()),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completion { shell } = cli.command {
        let mut command = Cli::command();
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut command, "lockctl", &mut script);
        // A closed pipe (`| head`) is not an error worth a panic.
        let _ = std::io::stdout().write_all(&script);
        return ExitCode::SUCCESS;
    }
    let mut explain_options = Options {
        call_timeout: cli.timeout,
        ..Options::default()
    };
    // A bad --tls-dir is reported by `run`; the explanation does without.
    let _ = cli.security.apply(&mut explain_options);
    let explain = Client::new(cli.endpoints.clone(), explain_options);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lockctl: {err}");
            if let (Error::Unavailable(_), Ok(client)) = (&err, explain) {
                eprintln!("lockctl: {}", cluster::explain_unavailable(&client).await);
            }
            ExitCode::from(err.exit_code() as u8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn yaml_output_reads_back_as_the_same_value_with_ambiguous_strings_kept() {
        let value = json!({
            "lock": "gpu-bind/node-1",
            "holder": {"token": 3, "payload": "true", "pod": "no", "note": "a: b # c", "at": "1e3"},
            "waiters": [{"pod": "a"}, {"pod": "b"}],
            "empty": [],
            "none": {},
        });
        let text = to_yaml(&value);
        let back: Value = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
        assert!(
            text.contains("lock: gpu-bind/node-1"),
            "block style: {text}"
        );
    }
}
