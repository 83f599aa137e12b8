//! Child processes that never outlive the test process.
//!
//! Each child runs in a process group of its own (a terminal's Ctrl-C goes
//! to the test, which then cleans up) with a watchdog beside it: a `sh` loop
//! that checks every half second whether the test process is still alive
//! and, once it is not, kills the child (and then removes the control
//! plane's directory, when given one). A test that
//! panics drops its processes as it unwinds; a control plane shared through
//! a `static` is never dropped, and a test binary killed outright runs no
//! destructor at all; the watchdog covers both. (`PR_SET_PDEATHSIG` would
//! do the same from inside the child but needs `unsafe` in `pre_exec`,
//! which this workspace forbids.)

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

/// A running child process, killed (with its watchdog) on drop.
pub struct Process {
    /// What it is, for messages (`etcd`, `kube-apiserver`, ...).
    name: String,
    child: Child,
    watchdog: Child,
    /// Its standard output and error.
    log: PathBuf,
}

impl Process {
    /// Starts `command` with its output in `log` (a new file). When the
    /// test process dies, the watchdog kills it and removes `cleanup` if
    /// given.
    pub fn spawn(
        name: &str,
        command: Command,
        log: &Path,
        cleanup: Option<&Path>,
    ) -> std::io::Result<Process> {
        Self::start(name, command, File::create(log)?, log, cleanup)
    }

    /// [`Process::spawn`], its output appended to `log`: a process started
    /// again (a replica restarted with its data) keeps one log.
    pub fn spawn_appending(name: &str, command: Command, log: &Path) -> std::io::Result<Process> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        Self::start(name, command, out, log, None)
    }

    fn start(
        name: &str,
        mut command: Command,
        out: File,
        log: &Path,
        cleanup: Option<&Path>,
    ) -> std::io::Result<Process> {
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .map_err(|e| std::io::Error::other(format!("cannot start {name}: {e}")))?;
        let pid = child.id();
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(concat!(
                "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; ",
                "kill -KILL \"$2\" 2>/dev/null; ",
                "if [ -n \"$3\" ]; then sleep 0.5; rm -rf -- \"$3\"; fi"
            ))
            .arg("tether-kube-watchdog")
            .arg(std::process::id().to_string())
            .arg(pid.to_string())
            .arg(cleanup.map(|p| p.display().to_string()).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn();
        let watchdog = match watchdog {
            Ok(watchdog) => watchdog,
            Err(e) => {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::other(format!(
                    "cannot start the watchdog of {name}: {e}"
                )));
            }
        };
        Ok(Process {
            name: name.to_string(),
            child,
            watchdog,
            log: log.to_path_buf(),
        })
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits for it to exit (after a `TERM`, say), then stops its watchdog.
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        let status = self.child.wait()?;
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        Ok(status)
    }

    /// The last `lines` lines of its output, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let start = all.len().saturating_sub(lines);
        format!(
            "--- last lines of {} ({}) ---\n{}",
            self.name,
            self.log.display(),
            all[start..].join("\n")
        )
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, ...) to the process alone.
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status();
    }

    /// Kills it and its watchdog at once (SIGKILL) and reaps both.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A loopback port that was free a moment ago, for a child process to
/// listen on. Taken below Linux's ephemeral range (32768+), where `bind(0)`
/// and outgoing connections land, so no other test's client or listener
/// can take it between here and the child's bind (a port from `bind(0)`
/// and let go was once taken by another test's HTTP server, which then
/// answered in the child's place). Each test process walks a stretch of
/// its own (from its pid) and skips ports in use.
pub fn unused_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(397);
    loop {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let port = (LOW + start.wrapping_add(n) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}
