//! Finding the binaries of a real control plane and node.
//!
//! Two sources:
//! - **Kubernetes** (`kube-apiserver`, `kube-scheduler`,
//!   `kube-controller-manager`, `kubelet`), built by `./dev` from the Go
//!   module proxy (the wrapper module in `kubernetes/` beside this crate)
//!   into the build cache, `~/.cache/tether/kubernetes-<version>/`, or the
//!   directory `TETHER_KUBE_BIN` names. Used where they are.
//! - **The rest** (etcd, containerd and its shim, `ctr`, runc, the CNI
//!   plugins, the node images), Debian's, xz-compressed in `../shared/kube`
//!   (or the directory `TETHER_KUBE_ASSETS` names) with their `SHA256SUMS`.
//!   They are unpacked into the build cache (`<target>/kube-assets/<digest
//!   of SHA256SUMS>/`), each checked against its sum, so every later test
//!   run (and every fresh clone sharing the cache) starts them at once. A
//!   binary is renamed into place only after its sum matched, so a run
//!   that died halfway leaves nothing that looks unpacked.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, bail};

/// The environment variable that names the assets' directory.
pub const ASSETS_VAR: &str = "TETHER_KUBE_ASSETS";

/// The environment variable that names the directory of the Kubernetes
/// binaries `./dev` built (it sets it; the default is the same place).
pub const KUBE_BIN_VAR: &str = "TETHER_KUBE_BIN";

/// The Kubernetes release the tests run (`./dev`'s `KUBERNETES_VERSION`,
/// the wrapper module's `k8s.io/kubernetes` requirement).
pub const KUBERNETES_VERSION: &str = "v1.36.3";

/// The Kubernetes binaries, from [`kube_bin_dir`].
const KUBERNETES: [&str; 4] = [
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
];

/// The file `./dev test` sets in this variable collects one line per test
/// skipped for want of assets, so it can count them.
pub const SKIP_LOG_VAR: &str = "TETHER_KUBE_SKIP_LOG";

/// The binaries a control plane is made of.
const CONTROL_PLANE: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
];

/// What a real node is made of ([`crate::node`]): the kubelet, containerd
/// with its shim and `ctr`, runc, the CNI plugins (unpacked as `cni-<name>`)
/// and the archive of local images.
const NODE_FILES: [&str; 9] = [
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "cni-dummy",
    "cni-host-local",
    "cni-loopback",
    "node-images.tar",
];

/// Unpacked, checked binaries and the built Kubernetes ones.
#[derive(Debug)]
pub struct Assets {
    /// Where the unpacked binaries are.
    pub bin_dir: PathBuf,
    /// Where the Kubernetes binaries are.
    pub kube_dir: PathBuf,
}

impl Assets {
    /// The path of one binary (`etcd`, `kube-apiserver`, ...).
    pub fn binary(&self, name: &str) -> PathBuf {
        if KUBERNETES.contains(&name) {
            self.kube_dir.join(name)
        } else {
            self.bin_dir.join(name)
        }
    }
}

/// Where the Kubernetes binaries are looked for.
pub fn kube_bin_dir() -> PathBuf {
    match std::env::var_os(KUBE_BIN_VAR) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home)
                .join(".cache/tether")
                .join(format!("kubernetes-{KUBERNETES_VERSION}"))
        }
    }
}

/// The Kubernetes binaries among `names` exist in [`kube_bin_dir`].
fn check_kubernetes(names: &[&str]) -> anyhow::Result<PathBuf> {
    let dir = kube_bin_dir();
    for name in names.iter().filter(|n| KUBERNETES.contains(n)) {
        if !dir.join(name).is_file() {
            bail!(
                "no {name} in {} (./dev test builds Kubernetes {KUBERNETES_VERSION} there from \
                 the Go module proxy; or set {KUBE_BIN_VAR})",
                dir.display()
            );
        }
    }
    Ok(dir)
}

/// Where the compressed assets are looked for.
pub fn source_dir() -> PathBuf {
    match std::env::var_os(ASSETS_VAR) {
        Some(dir) => PathBuf::from(dir),
        // `../shared/kube` beside the checkout: this crate sits at the
        // workspace root's `kube-testenv/`.
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/kube"),
    }
}

/// The assets, unpacked on first use; `Err` says what is missing.
pub fn assets() -> Result<&'static Assets, String> {
    static ASSETS: OnceLock<Result<Assets, String>> = OnceLock::new();
    ASSETS
        .get_or_init(|| unpack(&source_dir(), &CONTROL_PLANE).map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// The node's assets ([`NODE_FILES`]), unpacked on first use beside the
/// control plane's; `Err` says what is missing.
pub fn node_assets() -> Result<&'static Assets, String> {
    static ASSETS: OnceLock<Result<Assets, String>> = OnceLock::new();
    ASSETS
        .get_or_init(|| unpack(&source_dir(), &NODE_FILES).map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// The node's assets for a test, or `None` after reporting the test as
/// skipped (a failure under `CI=true`), as [`assets_or_skip`].
pub fn node_assets_or_skip(test: &str) -> Option<&'static Assets> {
    match node_assets() {
        Ok(assets) => Some(assets),
        Err(why) => {
            let why = format!(
                "{test}: no real Kubernetes node ({why}); ./dev test builds the kubelet, and \
                 {ASSETS_VAR} names a directory holding containerd.xz, \
                 containerd-shim-runc-v2.xz, ctr.xz, runc.xz, cni-*.xz, node-images.tar.xz and \
                 SHA256SUMS (../shared/kube by default)"
            );
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{why} (CI=true: missing assets are a failure, not a skip)");
            }
            report_skip(&format!("SKIPPED {why}"));
            None
        }
    }
}

/// The assets for a test, or `None` after reporting the test as skipped
/// with one loud line naming [`ASSETS_VAR`]. Under `CI=true` missing assets
/// fail the test instead: CI must run these tests, not skip them.
pub fn assets_or_skip(test: &str) -> Option<&'static Assets> {
    match assets() {
        Ok(assets) => Some(assets),
        Err(why) => {
            let why = format!(
                "{test}: no real Kubernetes control plane ({why}); ./dev test builds \
                 Kubernetes, and {ASSETS_VAR} names a directory holding etcd.xz and SHA256SUMS \
                 (../shared/kube by default)"
            );
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{why} (CI=true: missing assets are a failure, not a skip)");
            }
            report_skip(&format!("SKIPPED {why}"));
            None
        }
    }
}

/// Writes `line` past the test harness's output capture (which takes only
/// `print!`/`eprint!`) and into the skip log when `./dev test` keeps one.
fn report_skip(line: &str) {
    let _ = writeln!(std::io::stderr(), "\n{line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_VAR)
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
    {
        let _ = writeln!(file, "{line}");
    }
}

/// The build cache's `target/` directory: the test binary runs from
/// `<target>/<profile>/deps/`.
fn target_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("the test binary's path")?;
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .context("the test binary is not under <target>/<profile>/deps")
}

fn unpack(source: &Path, names: &[&str]) -> anyhow::Result<Assets> {
    let kube_dir = check_kubernetes(names)?;
    let sums_path = source.join("SHA256SUMS");
    let sums = std::fs::read_to_string(&sums_path)
        .with_context(|| format!("cannot read {}", sums_path.display()))?;
    let digest = hex(ring::digest::digest(&ring::digest::SHA256, sums.as_bytes()).as_ref());
    let bin_dir = target_dir()?.join("kube-assets").join(&digest[..16]);
    std::fs::create_dir_all(&bin_dir)
        .with_context(|| format!("cannot create {}", bin_dir.display()))?;
    for &name in names.iter().filter(|n| !KUBERNETES.contains(n)) {
        let target = bin_dir.join(name);
        if target.exists() {
            continue;
        }
        let expected = sums
            .lines()
            .find_map(|line| {
                let (sum, file) = line.split_once(char::is_whitespace)?;
                (file.trim().trim_start_matches('*') == name).then(|| sum.to_string())
            })
            .with_context(|| format!("{} has no sum for {name}", sums_path.display()))?;
        let packed = source.join(format!("{name}.xz"));
        if !packed.exists() {
            bail!("{} is missing", packed.display());
        }
        // Unpacked under a name of this process, checked, then renamed: two
        // test binaries unpacking at once each finish a whole file.
        let partial = bin_dir.join(format!(".{name}.{}", std::process::id()));
        let output = std::fs::File::create(&partial)?;
        let status = Command::new("xz")
            .arg("-dc")
            .arg(&packed)
            .stdout(output)
            .stderr(Stdio::inherit())
            .status()
            .context("cannot run xz (./dev installs xz-utils)")?;
        if !status.success() {
            let _ = std::fs::remove_file(&partial);
            bail!("xz -dc {} failed: {status}", packed.display());
        }
        let actual = hex(sha256_of_file(&partial)?.as_ref());
        if actual != expected {
            let _ = std::fs::remove_file(&partial);
            bail!("{name}: SHA-256 {actual}, SHA256SUMS says {expected}");
        }
        set_executable(&partial)?;
        std::fs::rename(&partial, &target)?;
    }
    Ok(Assets { bin_dir, kube_dir })
}

fn sha256_of_file(path: &Path) -> anyhow::Result<ring::digest::Digest> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buffer = vec![0; 1 << 20];
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            return Ok(context.finish());
        }
        context.update(&buffer[..n]);
    }
}

fn set_executable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
