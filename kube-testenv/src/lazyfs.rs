//! Directories that lose every write not synced, as a power cut does: each
//! a mount of the project's own lazy file system (`tether-lazyfs`, the
//! `lazyfs/` crate, in the spirit of LazyFS; its `fs` module doc says what
//! it caches and what passes through).
//!
//! It writes to the directory below only what a program syncs (`fsync`,
//! `fdatasync`, a write through an `O_SYNC`/`O_DSYNC` handle), and a
//! `power-cut` sent to its control socket throws the rest away. A power
//! cut is then: kill the program (`kill -9`), cut the power, start the
//! program again on what the disk kept.
//!
//! Each mount lives in a mount namespace of its own (`unshare --mount`
//! runs `tether-lazyfs`), and the programs that use it are started inside
//! that namespace ([`LazyFs::command`], through `nsenter`). So no mount is
//! ever left behind in the machine's namespace: once `tether-lazyfs` and
//! its programs are gone (killed on drop, or by [`Process`]'s watchdog when
//! the test process dies), the kernel drops the namespace and the mount
//! with it. The test process reaches the mount through
//! `/proc/<tether-lazyfs>/root` ([`LazyFs::path`]).
//!
//! The binary is the workspace's own build (`<target>/debug/tether-lazyfs`,
//! beside the test or chaos binary that mounts it; `TETHER_LAZYFS` names
//! another); it needs root and `/dev/fuse`, nothing from Debian beyond
//! util-linux's `unshare` and `nsenter`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::Process;

/// The environment variable that names the `tether-lazyfs` binary.
pub const LAZYFS_VAR: &str = "TETHER_LAZYFS";

/// A directory on the lazy file system, unmounted when dropped.
pub struct LazyFs {
    lazyfs: Process,
    /// The mount point inside the namespace (an empty directory outside).
    mount: PathBuf,
    /// The control socket.
    control: PathBuf,
    log: PathBuf,
}

impl LazyFs {
    /// Mounts a LazyFS over `backing` at `mount` (both directories are
    /// created), its FIFO, configuration and log beside them in `work`
    /// under `name`. Waits until the mount serves.
    pub fn mount(work: &Path, name: &str, backing: &Path, mount: &Path) -> Result<LazyFs, String> {
        let bin = binary()?;
        for dir in [backing, mount] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let control = work.join(format!("{name}.control"));
        let log = work.join(format!("{name}.log"));
        let mut command = Command::new("unshare");
        command
            .arg("--mount")
            .arg("--propagation=private")
            .arg(&bin)
            .arg("--below")
            .arg(backing)
            .arg("--mount")
            .arg(mount)
            .arg("--control")
            .arg(&control);
        let lazyfs = Process::spawn(&format!("lazyfs-{name}"), command, &log, None)
            .map_err(|e| format!("starting tether-lazyfs (unshare from util-linux): {e}"))?;
        let fs = LazyFs {
            lazyfs,
            mount: mount.to_path_buf(),
            control,
            log,
        };
        fs.wait_mounted()?;
        Ok(fs)
    }

    /// Waits until the namespace shows the mount and its control socket
    /// exists (made once the mount serves).
    fn wait_mounted(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mountinfo = format!("/proc/{}/mountinfo", self.lazyfs.id());
        let point = format!(" {} ", self.mount.display());
        loop {
            let mounted = std::fs::read_to_string(&mountinfo).is_ok_and(|info| {
                info.lines()
                    .any(|l| l.contains(&point) && l.contains("tether-lazyfs"))
            });
            if mounted && self.control.exists() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "tether-lazyfs did not mount {} within 60 s:\n{}",
                    self.mount.display(),
                    self.log_tail(20)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The mount as the test process reaches it (through the namespace's
    /// root): reads and writes go through LazyFS.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.lazyfs.id())).join(
            self.mount
                .strip_prefix("/")
                .expect("the mount point is an absolute path"),
        )
    }

    /// The mount point as programs started by [`LazyFs::command`] see it.
    pub fn mount_point(&self) -> &Path {
        &self.mount
    }

    /// `program`, to be started inside the mount's namespace (where
    /// [`LazyFs::mount_point`] is the LazyFS mount). `nsenter` enters the
    /// namespace and then runs the program in its own place (same process
    /// id): a kill reaches the program itself.
    pub fn command(&self, program: &Path) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--mount=/proc/{}/ns/mnt", self.lazyfs.id()))
            .arg("--")
            .arg(program);
        command
    }

    /// Throws away every write not yet synced: the power cut. Call it with
    /// the programs that write here stopped. Returns once the file system
    /// has forgotten them.
    pub fn clear_cache(&self) -> Result<(), String> {
        let failed = |e: std::io::Error| {
            format!(
                "power cut through {}: {e}\n{}",
                self.control.display(),
                self.log_tail(20)
            )
        };
        let mut stream = UnixStream::connect(&self.control).map_err(failed)?;
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(failed)?;
        stream.write_all(b"power-cut\n").map_err(failed)?;
        let mut answer = String::new();
        BufReader::new(stream)
            .read_line(&mut answer)
            .map_err(failed)?;
        if answer.starts_with("lost ") {
            Ok(())
        } else {
            Err(format!(
                "tether-lazyfs answered {answer:?} to a power cut:\n{}",
                self.log_tail(20)
            ))
        }
    }

    fn log_text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// The last `lines` lines of tether-lazyfs's own log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// The `tether-lazyfs` binary: `TETHER_LAZYFS`, or the build's own beside
/// the running executable (`<target>/debug/` for binaries, its `deps/`
/// for test executables).
pub fn binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(LAZYFS_VAR) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("{LAZYFS_VAR}={} is not a file", path.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("this executable's path: {e}"))?;
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join("tether-lazyfs"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            format!(
                "no tether-lazyfs beside {} (build it: cargo build -p tether-lazyfs, \
                 or ./dev test builds the suite; or set {LAZYFS_VAR})",
                exe.display()
            )
        })
}

/// Whether the lazy file system can run here: its binary, `/dev/fuse` and
/// root (it mounts with mount(2)). `Err` says what is missing.
pub fn available() -> Result<(), String> {
    binary()?;
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse (the fuse kernel module)".into());
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0");
    if !root {
        return Err("not root: tether-lazyfs mounts with mount(2)".into());
    }
    Ok(())
}

/// Whether a test can use the lazy file system; if not, says so in one loud
/// line and returns false (the test then passes by), or under `CI=true`
/// panics: CI must run the power-loss tests, not skip them.
pub fn available_or_skip(test: &str) -> bool {
    match available() {
        Ok(()) => true,
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{test}: {why} (CI=true: a failure, not a skip)")
        }
        Err(why) => {
            eprintln!("\nSKIPPED {test}: {why}");
            false
        }
    }
}
