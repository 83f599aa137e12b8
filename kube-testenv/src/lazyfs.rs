//! Directories that lose every write not fsynced, as a power cut does:
//! each a LazyFS mount (github.com/dsrhaslab/lazyfs, built for these
//! machines in `../shared/lazyfs`, whose README this follows).
//!
//! LazyFS is a FUSE file system with a page cache of its own: it writes to
//! the directory below it only what a program fsyncs (or flushes), and
//! `lazyfs::clear-cache` written to its fault FIFO throws the rest away.
//! A power cut is then: kill the program (`kill -9`), clear the cache,
//! start the program again on what the disk kept.
//!
//! Each mount lives in a mount namespace of its own (`unshare --mount`
//! runs `lazyfs`), and the programs that use it are started inside that
//! namespace ([`LazyFs::command`], through `nsenter`). So no mount is ever
//! left behind in the machine's namespace: once `lazyfs` and its programs
//! are gone (killed on drop, or by [`Process`]'s watchdog when the test
//! process dies), the kernel drops the namespace and the mount with it.
//! The test process reaches the mount through `/proc/<lazyfs>/root`
//! ([`LazyFs::path`]).
//!
//! The binaries are `lazyfs.xz` and `libpcache.so.0.xz` of `../shared/lazyfs`
//! (or the directory `TETHER_LAZYFS` names), unpacked once into the
//! machine's temp directory and checked against its `SHA256SUMS`; the run-time libraries
//! (`fuse3 libfuse3-3 libspdlog1.10 libfmt9`) are Debian's, which `./dev`
//! installs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::process::Process;

/// The environment variable that names the directory of the compressed
/// LazyFS binaries.
pub const LAZYFS_VAR: &str = "TETHER_LAZYFS";

/// LazyFS's page cache per mount: what a replica writes between two
/// fsyncs, and the pages it reads back, fit easily. Eviction is on (the
/// shared README's example has it off): checked on 2026-12-05 to keep
/// every fsynced byte of a 5 MB file through a 1 MB cache; what it does
/// with evicted unsynced pages was not checked.
const CACHE_SIZE: &str = "128mb";

/// A directory on LazyFS, unmounted when dropped.
pub struct LazyFs {
    lazyfs: Process,
    /// The mount point inside the namespace (an empty directory outside).
    mount: PathBuf,
    /// The fault FIFO.
    fifo: PathBuf,
    log: PathBuf,
}

impl LazyFs {
    /// Mounts a LazyFS over `backing` at `mount` (both directories are
    /// created), its FIFO, configuration and log beside them in `work`
    /// under `name`. Waits until the mount serves.
    pub fn mount(work: &Path, name: &str, backing: &Path, mount: &Path) -> Result<LazyFs, String> {
        let bin = binaries()?;
        for dir in [backing, mount] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let fifo = work.join(format!("{name}.fifo"));
        let config = work.join(format!("{name}.toml"));
        let log = work.join(format!("{name}.log"));
        std::fs::write(
            &config,
            format!(
                "[faults]\nfifo_path=\"{}\"\n[cache]\napply_eviction=true\n[cache.simple]\n\
                 custom_size=\"{CACHE_SIZE}\"\nblocks_per_page=1\n[filesystem]\n\
                 log_all_operations=false\nlogfile=\"\"\n",
                fifo.display()
            ),
        )
        .map_err(|e| format!("{}: {e}", config.display()))?;
        let mut command = Command::new("unshare");
        command
            .arg("--mount")
            .arg("--propagation=private")
            .arg(bin.join("lazyfs"))
            .arg(mount)
            .arg("--config-path")
            .arg(&config)
            .args(["-o", "allow_other", "-o", "modules=subdir"])
            .arg("-o")
            .arg(format!("subdir={}", backing.display()))
            .arg("-f")
            .env("LD_LIBRARY_PATH", &bin);
        let lazyfs = Process::spawn(&format!("lazyfs-{name}"), command, &log, None)
            .map_err(|e| format!("starting lazyfs (unshare from util-linux): {e}"))?;
        let fs = LazyFs {
            lazyfs,
            mount: mount.to_path_buf(),
            fifo,
            log,
        };
        fs.wait_mounted()?;
        Ok(fs)
    }

    /// Waits until the namespace shows the mount and its FIFO exists.
    fn wait_mounted(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mountinfo = format!("/proc/{}/mountinfo", self.lazyfs.id());
        let point = format!(" {} ", self.mount.display());
        loop {
            let mounted = std::fs::read_to_string(&mountinfo).is_ok_and(|info| {
                info.lines()
                    .any(|l| l.contains(&point) && l.contains("lazyfs"))
            });
            if mounted && self.fifo.exists() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "LazyFS did not mount {} within 60 s:\n{}",
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

    /// Throws away every write not yet fsynced: the power cut. Call it with
    /// the programs that write here stopped. Returns once LazyFS reports
    /// the cache cleared.
    pub fn clear_cache(&self) -> Result<(), String> {
        let before = self.log_text().matches("cache is cleared").count();
        // Opening a FIFO for writing blocks until its reader (LazyFS's
        // fault thread) has it open: it does from the mount on.
        std::fs::write(&self.fifo, "lazyfs::clear-cache\n")
            .map_err(|e| format!("{}: {e}", self.fifo.display()))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.log_text().matches("cache is cleared").count() <= before {
            if Instant::now() > deadline {
                return Err(format!(
                    "LazyFS did not clear its cache within 60 s:\n{}",
                    self.log_tail(20)
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    fn log_text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// The last `lines` lines of LazyFS's own log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// Where the compressed binaries are looked for.
pub fn source_dir() -> PathBuf {
    match std::env::var_os(LAZYFS_VAR) {
        Some(dir) => PathBuf::from(dir),
        // `../shared/lazyfs` beside the checkout.
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/lazyfs"),
    }
}

/// Whether LazyFS can run here: its binaries, `/dev/fuse`, `unshare` and
/// `nsenter`. `Err` says what is missing.
pub fn available() -> Result<(), String> {
    binaries()?;
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse".into());
    }
    Ok(())
}

/// Whether a test can use LazyFS; if not, says so in one loud line and
/// returns false (the test then passes by), or under `CI=true` panics: CI
/// must run the power-loss tests, not skip them.
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

/// The unpacked, checked binaries' directory (unpacked on first use).
fn binaries() -> Result<PathBuf, String> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| unpack(&source_dir()))
        .clone()
        .map_err(|e| format!("LazyFS: {e} (set {LAZYFS_VAR} to ../shared/lazyfs's copy)"))
}

fn unpack(source: &Path) -> Result<PathBuf, String> {
    let sums_path = source.join("SHA256SUMS");
    let sums = std::fs::read_to_string(&sums_path)
        .map_err(|e| format!("cannot read {}: {e}", sums_path.display()))?;
    // Keyed by the sums, so new binaries unpack beside the old.
    let key: u64 = sums.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let dir = std::env::temp_dir().join(format!("tether-lazyfs-{key:016x}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for name in ["lazyfs", "libpcache.so.0"] {
        let target = dir.join(name);
        if target.exists() {
            continue;
        }
        let expected = sums
            .lines()
            .find_map(|line| {
                let (sum, file) = line.split_once(char::is_whitespace)?;
                (file.trim().trim_start_matches('*') == name).then(|| sum.to_string())
            })
            .ok_or_else(|| format!("{} has no sum for {name}", sums_path.display()))?;
        let packed = source.join(format!("{name}.xz"));
        // Unpacked under a name of this process, checked, then renamed: two
        // test processes unpacking at once each finish a whole file.
        let partial = dir.join(format!(".{name}.{}", std::process::id()));
        let output = std::fs::File::create(&partial).map_err(|e| e.to_string())?;
        let status = Command::new("xz")
            .arg("-dc")
            .arg(&packed)
            .stdout(output)
            .stderr(Stdio::inherit())
            .status()
            .map_err(|e| format!("cannot run xz: {e}"))?;
        if !status.success() {
            let _ = std::fs::remove_file(&partial);
            return Err(format!("xz -dc {} failed: {status}", packed.display()));
        }
        let summed = Command::new("sha256sum")
            .arg(&partial)
            .output()
            .map_err(|e| format!("cannot run sha256sum: {e}"))?;
        let actual = String::from_utf8_lossy(&summed.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        if actual != expected {
            let _ = std::fs::remove_file(&partial);
            return Err(format!(
                "{name}: SHA-256 {actual}, SHA256SUMS says {expected}"
            ));
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", partial.display()))?;
        std::fs::rename(&partial, &target).map_err(|e| e.to_string())?;
    }
    Ok(dir)
}
