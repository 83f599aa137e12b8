//! One real control plane: etcd and kube-apiserver on free loopback ports,
//! with a throwaway CA, an admin token and a kubeconfig; kube-scheduler and
//! kube-controller-manager on demand.
//!
//! The flags follow `../shared/kube/README.md` (what works here): RBAC on,
//! the `ServiceAccount` admission plugin off (pods need no default service
//! account), the endpoint reconciler off (no Service IP to announce), etcd
//! without fsync (a throwaway store; its durability is not what the tests
//! check). The API server is ready when `/readyz` answers 200 and the
//! `default` namespace exists (a post-start hook creates it a moment after
//! `/readyz`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;
use tether_tls::testing::TestCa;

use crate::apply::Mode;
use crate::assets::{Assets, assets_or_skip};
use crate::process::{Process, unused_port};

/// How long a start may take on a loaded 2-core machine.
const START_DEADLINE: Duration = Duration::from_secs(120);

/// The admin's bearer token (a `system:masters` user). A throwaway control
/// plane on loopback, so a fixed string does.
const ADMIN_TOKEN: &str = "tether-testenv-admin";

/// A running etcd and kube-apiserver, stopped on drop (and by the watchdogs
/// when the test process dies without dropping it).
///
/// Fields drop in order: the API server, then etcd, then the directory.
pub struct ControlPlane {
    apiserver: Mutex<Option<Process>>,
    apiserver_port: u16,
    etcd: Mutex<Process>,
    etcd_port: u16,
    assets: &'static Assets,
    /// Certificates, tokens, kubeconfig, logs and etcd's data.
    dir: PathBuf,
    /// Owns `dir` for a plane that is dropped; `None` for the shared one,
    /// whose directory etcd's watchdog removes.
    _tempdir: Option<tempfile::TempDir>,
    /// How long etcd and the API server took to become ready.
    pub started_in: Duration,
}

/// Namespaces handed out so far by this process.
static NAMESPACES: AtomicU32 = AtomicU32::new(0);

impl ControlPlane {
    /// The process ids of etcd and the API server (the API server's only
    /// while it runs), named: for measuring what they cost.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        let mut pids = vec![(
            "etcd",
            self.etcd.lock().unwrap_or_else(|p| p.into_inner()).id(),
        )];
        if let Some(apiserver) = &*self.apiserver.lock().unwrap_or_else(|p| p.into_inner()) {
            pids.push(("kube-apiserver", apiserver.id()));
        }
        pids
    }

    /// The control plane shared by every test of this test binary, started
    /// on first use; `None` (with the test reported skipped) when the
    /// assets are missing. Tests that share it keep to namespaces of their
    /// own ([`ControlPlane::namespace`]) and names of their own for
    /// cluster-scoped objects.
    pub fn shared_or_skip(test: &str) -> Option<&'static ControlPlane> {
        static SHARED: OnceLock<ControlPlane> = OnceLock::new();
        assets_or_skip(test)?;
        Some(SHARED.get_or_init(|| {
            // Started on a runtime of its own: each `#[tokio::test]` has a
            // runtime that ends with the test, and nothing of the shared
            // plane may depend on one.
            std::thread::spawn(|| {
                tokio::runtime::Runtime::new()
                    .expect("runtime")
                    .block_on(ControlPlane::start_shared())
            })
            .join()
            .expect("control plane start")
            .unwrap_or_else(|e| panic!("the shared control plane did not start: {e:#}"))
        }))
    }

    /// A control plane of the test's own (for outages, compactions,
    /// anything others must not see); `None` when the assets are missing.
    pub async fn start_or_skip(test: &str) -> Option<ControlPlane> {
        assets_or_skip(test)?;
        Some(
            ControlPlane::start()
                .await
                .unwrap_or_else(|e| panic!("the control plane did not start: {e:#}")),
        )
    }

    /// Starts a control plane of its own, dropped with the value.
    pub async fn start() -> anyhow::Result<ControlPlane> {
        let tempdir = tempfile::Builder::new().prefix("tether-kube-").tempdir()?;
        let dir = tempdir.path().to_path_buf();
        let mut plane = ControlPlane::start_in(dir).await?;
        plane._tempdir = Some(tempdir);
        Ok(plane)
    }

    async fn start_shared() -> anyhow::Result<ControlPlane> {
        let dir = tempfile::Builder::new()
            .prefix("tether-kube-shared-")
            .tempdir()?
            .keep();
        ControlPlane::start_in(dir).await
    }

    async fn start_in(dir: PathBuf) -> anyhow::Result<ControlPlane> {
        let assets = crate::assets::assets().map_err(anyhow::Error::msg)?;
        write_credentials(&dir)?;
        let mut last_error = None;
        // Ports are picked free and then let go: another process may take
        // one before etcd or the API server binds it. Try again on new ones.
        for _ in 0..3 {
            let started = Instant::now();
            let etcd_port = unused_port();
            let apiserver_port = unused_port();
            let etcd = start_etcd(assets, &dir, etcd_port)?;
            let plane = ControlPlane {
                assets,
                dir: dir.clone(),
                _tempdir: None,
                etcd: Mutex::new(etcd),
                etcd_port,
                apiserver: Mutex::new(None),
                apiserver_port,
                started_in: Duration::ZERO,
            };
            plane.write_kubeconfig("admin", ADMIN_TOKEN)?;
            match plane.start_apiserver().await {
                Ok(()) => {
                    return Ok(ControlPlane {
                        started_in: started.elapsed(),
                        ..plane
                    });
                }
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.expect("tried"))
    }

    /// The API server's URL.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.apiserver_port)
    }

    /// The admin's kubeconfig (token of a `system:masters` user).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// The directory of this plane's files (for a test's own files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client acting as the admin. Make one per test: a client's
    /// connections belong to the runtime that opened them.
    pub async fn client(&self) -> kube::Client {
        client_from(&self.kubeconfig())
            .await
            .expect("a client from the admin kubeconfig")
    }

    /// A client acting as the service account `namespace/name` (created
    /// when missing) with a token the API server issues for it (the
    /// TokenRequest API, as the kubelet gets a pod's token): it has exactly
    /// the RBAC the test grants that account.
    pub async fn client_as_service_account(&self, namespace: &str, name: &str) -> kube::Client {
        let path = self.service_account_kubeconfig(namespace, name).await;
        client_from(&path).await.expect("a service account client")
    }

    /// A kubeconfig for the service account `namespace/name` (see
    /// [`ControlPlane::client_as_service_account`]), for a component
    /// started with `--kubeconfig`.
    pub async fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> PathBuf {
        let admin = self.client().await;
        self.ensure_namespace(&admin, namespace).await;
        let accounts: Api<ServiceAccount> = Api::namespaced(admin, namespace);
        let account: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name}})).expect("account");
        match accounts.create(&PostParams::default(), &account).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("cannot create service account {namespace}/{name}: {e}"),
        }
        let request: TokenRequest = serde_json::from_value(json!({
            "spec": {"audiences": [], "expirationSeconds": 3600}
        }))
        .expect("token request");
        let token = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("no token for {namespace}/{name}: {e}"))
            .status
            .expect("a token request's status")
            .token;
        self.write_kubeconfig(&format!("sa-{namespace}-{name}"), &token)
            .expect("kubeconfig")
    }

    async fn ensure_namespace(&self, client: &kube::Client, name: &str) {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
        match namespaces.create(&PostParams::default(), &namespace).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("cannot create namespace {name}: {e}"),
        }
    }

    /// Creates or updates `objects` (server-side apply, as the admin):
    /// manifests a test deploys for real, e.g. a component's RBAC. A
    /// namespaced object without a namespace goes to `namespace`, which is
    /// created when missing.
    pub async fn apply(
        &self,
        objects: &[serde_json::Value],
        namespace: &str,
    ) -> anyhow::Result<()> {
        let client = self.client().await;
        self.ensure_namespace(&client, namespace).await;
        let discovery = kube::discovery::Discovery::new(client.clone())
            .run()
            .await?;
        for object in objects {
            crate::apply::apply(&client, &discovery, object, namespace, Mode::ForReal).await?;
        }
        Ok(())
    }

    /// A new namespace named `<prefix>-<n>`, unique in this process.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{}", NAMESPACES.fetch_add(1, Ordering::Relaxed));
        self.ensure_namespace(&self.client().await, &name).await;
        name
    }

    /// Kills the API server (SIGKILL: a crash, connections reset). etcd
    /// keeps running; [`ControlPlane::start_apiserver`] brings it back on
    /// the same port.
    pub fn stop_apiserver(&self) {
        if let Some(mut apiserver) = self.apiserver.lock().unwrap().take() {
            apiserver.kill();
        }
    }

    /// Starts the API server (again) and waits until it is ready.
    pub async fn start_apiserver(&self) -> anyhow::Result<()> {
        let process = self.spawn_apiserver(self.apiserver_port, "kube-apiserver")?;
        *self.apiserver.lock().unwrap() = Some(process);
        let ready = wait_ready(&self.kubeconfig(), || {
            let mut guard = self.apiserver.lock().unwrap();
            let process = guard.as_mut().expect("started");
            process
                .exited()
                .map(|status| format!("kube-apiserver exited ({status})\n{}", process.log_tail(30)))
        })
        .await;
        if let Err(e) = ready {
            self.stop_apiserver();
            return Err(e);
        }
        Ok(())
    }

    /// A second API server on the same etcd (another port, the same
    /// credentials), ready, with a kubeconfig for it: a way to change
    /// objects while the first is down.
    pub async fn extra_apiserver(&self) -> anyhow::Result<ExtraApiServer> {
        let port = unused_port();
        let mut process = self.spawn_apiserver(port, &format!("kube-apiserver-{port}"))?;
        let kubeconfig = self.dir.join(format!("admin-{port}.kubeconfig"));
        std::fs::write(
            &kubeconfig,
            kubeconfig_text(&self.dir, port, "admin", ADMIN_TOKEN),
        )?;
        let ready = wait_ready(&kubeconfig, || {
            process.exited().map(|status| {
                format!(
                    "extra kube-apiserver exited ({status})\n{}",
                    process.log_tail(30)
                )
            })
        })
        .await;
        ready?;
        Ok(ExtraApiServer {
            _process: process,
            kubeconfig,
        })
    }

    fn spawn_apiserver(&self, port: u16, name: &str) -> anyhow::Result<Process> {
        let dir = &self.dir;
        let mut command = Command::new(self.assets.binary("kube-apiserver"));
        command
            .arg(format!(
                "--etcd-servers=http://127.0.0.1:{}",
                self.etcd_port
            ))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={port}"))
            .arg(format!(
                "--cert-dir={}",
                dir.join("apiserver-certs").display()
            ))
            .arg(format!(
                "--tls-cert-file={}",
                dir.join("apiserver.crt").display()
            ))
            .arg(format!(
                "--tls-private-key-file={}",
                dir.join("apiserver.key").display()
            ))
            .arg(format!("--client-ca-file={}", dir.join("ca.crt").display()))
            .arg(format!(
                "--token-auth-file={}",
                dir.join("tokens.csv").display()
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!(
                "--service-account-key-file={}",
                dir.join("sa.pub").display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                dir.join("sa.key").display()
            ))
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            .arg("--authorization-mode=RBAC")
            .arg("--endpoint-reconciler-type=none")
            .arg("--profiling=false")
            .arg("--disable-admission-plugins=ServiceAccount");
        Ok(Process::spawn(
            name,
            command,
            &dir.join(format!("{name}.log")),
            None,
        )?)
    }

    /// Starts kube-controller-manager with only `controllers` (e.g.
    /// `["podgc"]`), as the admin. Stopped when the value drops.
    pub fn controller_manager(&self, controllers: &[&str]) -> anyhow::Result<Process> {
        self.component(
            "kube-controller-manager",
            &[
                format!("--kubeconfig={}", self.kubeconfig().display()),
                "--secure-port=0".into(),
                "--leader-elect=false".into(),
                format!("--controllers={}", controllers.join(",")),
            ],
        )
    }

    /// Starts kube-scheduler with the configuration file `config` (a
    /// KubeSchedulerConfiguration whose `clientConnection.kubeconfig` the
    /// caller points at [`ControlPlane::kubeconfig`]). Stopped on drop.
    pub fn scheduler(&self, config: &Path) -> anyhow::Result<Process> {
        // Each scheduling attempt and queue move in the log a failing test
        // prints.
        self.scheduler_logging(config, 4)
    }

    /// [`ControlPlane::scheduler`] logging at klog level `verbosity`: a
    /// benchmark placing thousands of pods runs it at 2 (a deployment's
    /// usual level), as level 4's lines per attempt cost CPU.
    pub fn scheduler_logging(&self, config: &Path, verbosity: u8) -> anyhow::Result<Process> {
        self.component(
            "kube-scheduler",
            &[
                format!("--config={}", config.display()),
                "--secure-port=0".into(),
                format!("--v={verbosity}"),
            ],
        )
    }

    /// Starts the asset `binary` with `args`, its output in a log of its
    /// own in the plane's directory.
    fn component(&self, binary: &str, args: &[String]) -> anyhow::Result<Process> {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let mut command = Command::new(self.assets.binary(binary));
        command.args(args);
        let log = self.dir.join(format!(
            "{binary}-{}.log",
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        Ok(Process::spawn(binary, command, &log, None)?)
    }

    /// Compacts etcd's history up to its current revision (what etcd's
    /// periodic compaction does), so a watch from an older resourceVersion
    /// that reaches etcd answers 410 Gone. Returns the revision.
    pub async fn compact_etcd(&self) -> anyhow::Result<i64> {
        // etcd's JSON gateway: a range read gives the current revision in
        // its header; "AA==" is the key "\0".
        let range = etcd_post(self.etcd_port, "/v3/kv/range", &json!({"key": "AA=="})).await?;
        let revision: i64 = range["header"]["revision"]
            .as_str()
            .context("no revision in etcd's answer")?
            .parse()?;
        etcd_post(
            self.etcd_port,
            "/v3/kv/compaction",
            &json!({"revision": revision.to_string(), "physical": true}),
        )
        .await?;
        Ok(revision)
    }

    /// Writes `<user>.kubeconfig` whole or not at all: tests on a shared
    /// plane ask for the same account's kubeconfig at once, and one read a
    /// file another was still writing ("failed to determine current
    /// context"). Each writes a file of its own and renames it into place,
    /// which readers see atomically.
    fn write_kubeconfig(&self, user: &str, token: &str) -> anyhow::Result<PathBuf> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = self.dir.join(format!("{user}.kubeconfig"));
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let partial = self
            .dir
            .join(format!("{user}.kubeconfig.{}-{n}", std::process::id()));
        std::fs::write(
            &partial,
            kubeconfig_text(&self.dir, self.apiserver_port, user, token),
        )?;
        std::fs::rename(&partial, &path)?;
        Ok(path)
    }

    /// The running API server's process id.
    pub fn apiserver_id(&self) -> Option<u32> {
        self.apiserver.lock().unwrap().as_ref().map(Process::id)
    }

    /// The etcd process (to stop or pause it for an outage below the API
    /// server).
    pub fn etcd(&self) -> std::sync::MutexGuard<'_, Process> {
        self.etcd.lock().unwrap()
    }
}

/// A control plane a test uses: the shared one, or one of its own (dropped
/// with it).
pub enum Plane {
    /// [`ControlPlane::shared_or_skip`]'s.
    Shared(&'static ControlPlane),
    /// [`ControlPlane::start_or_skip`]'s.
    Own(Box<ControlPlane>),
}

impl Plane {
    /// The shared plane; `None` (the test reported skipped) without assets.
    pub fn shared_or_skip(test: &str) -> Option<Plane> {
        ControlPlane::shared_or_skip(test).map(Plane::Shared)
    }

    /// A plane of the test's own; `None` (reported skipped) without assets.
    pub async fn own_or_skip(test: &str) -> Option<Plane> {
        let plane = ControlPlane::start_or_skip(test).await?;
        Some(Plane::Own(Box::new(plane)))
    }
}

impl std::ops::Deref for Plane {
    type Target = ControlPlane;
    fn deref(&self) -> &ControlPlane {
        match self {
            Plane::Shared(plane) => plane,
            Plane::Own(plane) => plane,
        }
    }
}

/// A second API server (see [`ControlPlane::extra_apiserver`]), stopped on
/// drop.
pub struct ExtraApiServer {
    _process: Process,
    kubeconfig: PathBuf,
}

impl ExtraApiServer {
    /// An admin client of this API server.
    pub async fn client(&self) -> kube::Client {
        client_from(&self.kubeconfig).await.expect("client")
    }
}

/// The CA, the API server's serving certificate (for 127.0.0.1 and
/// localhost), the service-account signing key and the token file.
fn write_credentials(dir: &Path) -> anyhow::Result<()> {
    let ca = TestCa::new("tether-testenv-ca");
    std::fs::write(dir.join("ca.crt"), ca.pem())?;
    let (cert, key) = ca.issue("kube-apiserver", &["127.0.0.1", "localhost"]);
    std::fs::write(dir.join("apiserver.crt"), cert)?;
    std::fs::write(dir.join("apiserver.key"), key)?;
    // The API server signs service-account tokens with this key and checks
    // them with its public half.
    let signing = rcgen::KeyPair::generate()?;
    std::fs::write(dir.join("sa.key"), signing.serialize_pem())?;
    std::fs::write(dir.join("sa.pub"), signing.public_key_pem())?;
    std::fs::write(
        dir.join("tokens.csv"),
        format!("{ADMIN_TOKEN},tether-testenv-admin,admin-uid,\"system:masters\"\n"),
    )?;
    Ok(())
}

fn kubeconfig_text(dir: &Path, port: u16, user: &str, token: &str) -> String {
    let ca = dir.join("ca.crt");
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testenv", "cluster": {
            "server": format!("https://127.0.0.1:{port}"),
            "certificate-authority": ca.display().to_string(),
        }}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "testenv", "context": {"cluster": "testenv", "user": user}}],
        "current-context": "testenv",
    })
    .to_string()
}

/// The HTTP code a watch of `api` from `version` fails with (410 Gone for a
/// version the API server no longer has), or `None` if it starts.
pub async fn watch_error_code<K>(api: &Api<K>, version: &str) -> Option<u16>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt;
    let params = kube::api::WatchParams::default().timeout(5);
    let mut stream = match api.watch(&params, version).await {
        Err(kube::Error::Api(e)) => return Some(e.code),
        Err(e) => panic!("watch: {e}"),
        Ok(stream) => stream.boxed(),
    };
    match stream.next().await {
        Some(Ok(kube::api::WatchEvent::Error(e))) => Some(e.code),
        Some(Err(kube::Error::Api(e))) => Some(e.code),
        _ => None,
    }
}

/// Every YAML document of the file at `path` (empty ones skipped).
pub fn yaml_documents(path: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
        .with_context(|| format!("parsing {}", path.display()))?;
    Ok(documents.into_iter().filter(|d| !d.is_null()).collect())
}

/// A client from a kubeconfig file, as a component given `--kubeconfig`
/// makes one.
pub async fn client_from(path: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(path)?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// etcd, whose watchdog also removes the plane's directory when the test
/// process dies (a plane that is dropped removes it itself).
fn start_etcd(assets: &Assets, dir: &Path, port: u16) -> anyhow::Result<Process> {
    let peer_port = unused_port();
    let data = dir.join(format!("etcd-{port}"));
    let mut command = Command::new(assets.binary("etcd"));
    command
        .arg("--name=testenv")
        .arg(format!("--data-dir={}", data.display()))
        .arg(format!("--listen-client-urls=http://127.0.0.1:{port}"))
        .arg(format!("--advertise-client-urls=http://127.0.0.1:{port}"))
        .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"))
        .arg(format!(
            "--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"
        ))
        .arg(format!(
            "--initial-cluster=testenv=http://127.0.0.1:{peer_port}"
        ))
        .arg("--initial-cluster-state=new")
        .arg("--unsafe-no-fsync");
    Ok(Process::spawn(
        "etcd",
        command,
        &dir.join(format!("etcd-{port}.log")),
        Some(dir),
    )?)
}

/// Waits until the API server of `kubeconfig` answers `/readyz` with 200
/// and has the `default` namespace; `exited` says whether (and why) it died.
async fn wait_ready(
    kubeconfig: &Path,
    mut exited: impl FnMut() -> Option<String>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_DEADLINE;
    let client = client_from(kubeconfig).await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut last: String;
    loop {
        if let Some(why) = exited() {
            bail!("{why}");
        }
        let readyz = http::Request::get("/readyz").body(Vec::new())?;
        match client.request_text(readyz).await {
            Ok(_) => match namespaces.get_opt("default").await {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => last = "no default namespace yet".into(),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        if Instant::now() > deadline {
            bail!("the API server was not ready within {START_DEADLINE:?}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One JSON POST to etcd's gateway over plain HTTP/1.0, whose answer is its
/// body up to the close, never chunked (a request or two in a test: not
/// worth an HTTP client crate).
async fn etcd_post(
    port: u16,
    path: &str,
    body: &serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!(
                "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .context("etcd's answer has no body")?;
    if head.split_whitespace().nth(1) != Some("200") {
        bail!("etcd {path}: {head}\n{body}");
    }
    Ok(serde_json::from_str(body.trim())?)
}
