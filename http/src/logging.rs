//! The one logging set-up of every Tether binary: `tracing` to stderr, the
//! level from `RUST_LOG` (else the binary's default), colour codes only on a
//! terminal (not in files or `kubectl logs`).

use tracing_subscriber::EnvFilter;

/// Installs the process-wide subscriber; `default_filter` applies when
/// `RUST_LOG` is unset or unreadable (e.g. `"info"`).
pub fn init(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter)),
        )
        .init();
}
