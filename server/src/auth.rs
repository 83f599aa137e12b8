//! Who is calling and what they may do.
//!
//! With TLS on, the caller is the verified client certificate and its role
//! is the name it carries (`tether:` URI SAN, else the common name; see
//! `tether_tls::identity_of`). In development without TLS, a token file can
//! give roles to bearer tokens. With neither, everyone may do everything
//! (the single-node default, which says so loudly at start).
//!
//! Roles:
//! - `admin`: everything but Raft traffic; force-releases are recorded
//!   with the identity.
//! - `replica`: everything (the other replicas: Raft, and the StatefulSet
//!   join, which changes membership).
//! - `scheduler`: acquire, release, assign and release pins, TTL leases,
//!   every read and watch.
//! - `device-plugin:<node>`: read and release the locks named `<node>` (in
//!   any scope); read pins, and assign or release pins on `<node>` only (the
//!   node's device claims, which it corrects to what the kubelet chose);
//!   cluster status. Nothing else: a compromised device plugin cannot touch
//!   another node's binds or claims.
//! - `bridge`: pod and node reports, pod revokes, reads and watches.
//! - `reader`: reads and watches.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use anyhow::Context as _;
use tether_tls::PeerInfo;
use tonic::Request;
use tonic::metadata::{Ascii, MetadataValue};

use crate::error::ApiError;
use crate::sm::LockKey;

/// What a caller may be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Operators: everything but Raft traffic.
    Admin,
    /// Another replica.
    Replica,
    /// A scheduler (extender) binding pods.
    Scheduler,
    /// The device plugin of one node.
    DevicePlugin {
        /// The node it runs on.
        node: String,
    },
    /// The Kubernetes bridge.
    Bridge,
    /// Dashboards and other read-only users.
    Reader,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Admin => f.write_str("admin"),
            Role::Replica => f.write_str("replica"),
            Role::Scheduler => f.write_str("scheduler"),
            Role::DevicePlugin { node } => write!(f, "device-plugin:{node}"),
            Role::Bridge => f.write_str("bridge"),
            Role::Reader => f.write_str("reader"),
        }
    }
}

/// The role names, for messages.
pub const ROLE_NAMES: &str = "admin, replica, scheduler, device-plugin:<node>, bridge, reader";

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "admin" => Ok(Role::Admin),
            "replica" => Ok(Role::Replica),
            "scheduler" => Ok(Role::Scheduler),
            "bridge" => Ok(Role::Bridge),
            "reader" => Ok(Role::Reader),
            _ => match name.strip_prefix("device-plugin:") {
                Some(node) => {
                    crate::api::validate::dns1123_subdomain("device plugin node", node)
                        .map_err(|e| e.to_string())?;
                    Ok(Role::DevicePlugin {
                        node: node.to_string(),
                    })
                }
                None => Err(format!("{name:?} is not a Tether role ({ROLE_NAMES})")),
            },
        }
    }
}

/// A request's author.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// Who, for audit records: the certificate subject, `token:<name>`, or
    /// `anonymous` when authentication is off.
    pub identity: String,
    /// What they may do; `None` when authentication is off (everything).
    pub role: Option<Role>,
}

impl Caller {
    /// The caller when authentication is off.
    pub fn anonymous() -> Self {
        Self {
            identity: "anonymous".to_string(),
            role: None,
        }
    }

    /// Whether a real identity stands behind the call.
    pub fn authenticated(&self) -> bool {
        self.role.is_some()
    }

    /// `Ok` when the caller may do `action`, else `PERMISSION_DENIED` naming
    /// the roles that may.
    pub fn require(&self, action: Action<'_>) -> Result<(), ApiError> {
        let Some(role) = &self.role else {
            return Ok(());
        };
        if allowed(role, &action) {
            return Ok(());
        }
        Err(ApiError::PermissionDenied(format!(
            "{} (role {role}) may not {}; that needs role {}",
            self.identity,
            action.describe(),
            action.roles_needed()
        )))
    }
}

/// Something a caller asks to do.
#[derive(Clone, Copy, Debug)]
pub enum Action<'a> {
    /// Take a lock or queue for it.
    Acquire(&'a LockKey),
    /// Release one's own hold.
    Release(&'a LockKey),
    /// Read a lock's holder, payload and queue.
    ReadLock(&'a LockKey),
    /// List locks (payloads of every node).
    ListLocks,
    /// Release someone else's hold.
    ForceRelease(&'a LockKey),
    /// Assign or release pins on these nodes (an assign's candidates; the
    /// node of the pin a release ends, none if there is no such pin).
    WritePins(&'a [String]),
    /// Read pins.
    ReadPins,
    /// Grant, keep alive or revoke TTL leases.
    Leases,
    /// Revoke everything a pod holds.
    RevokePod,
    /// Report pod phases and node states.
    Report,
    /// Read nodes.
    ReadNodes,
    /// Watch events or read history.
    Watch,
    /// Read the cluster's status.
    ClusterStatus,
    /// Change membership, move leadership, take or export snapshots.
    ClusterAdmin,
    /// Replica-to-replica Raft messages.
    Raft,
}

impl Action<'_> {
    fn describe(&self) -> String {
        match self {
            Action::Acquire(key) => format!("acquire lock {key}"),
            Action::Release(key) => format!("release lock {key}"),
            Action::ReadLock(key) => format!("read lock {key}"),
            Action::ListLocks => "list locks".to_string(),
            Action::ForceRelease(key) => format!("force-release lock {key}"),
            Action::WritePins([]) => "assign or release pins".to_string(),
            Action::WritePins(nodes) => {
                format!("assign or release pins on node {}", nodes.join(", "))
            }
            Action::ReadPins => "read pins".to_string(),
            Action::Leases => "manage TTL leases".to_string(),
            Action::RevokePod => "revoke pods".to_string(),
            Action::Report => "report pods and nodes".to_string(),
            Action::ReadNodes => "read nodes".to_string(),
            Action::Watch => "watch events or read history".to_string(),
            Action::ClusterStatus => "read the cluster status".to_string(),
            Action::ClusterAdmin => "change membership, leadership or snapshots".to_string(),
            Action::Raft => "send Raft messages".to_string(),
        }
    }

    fn roles_needed(&self) -> String {
        let candidates = [
            Role::Admin,
            Role::Replica,
            Role::Scheduler,
            Role::Bridge,
            Role::Reader,
        ];
        let mut names: Vec<String> = candidates
            .iter()
            .filter(|role| allowed(role, self))
            .map(|role| role.to_string())
            .collect();
        if let Action::ReadLock(key) | Action::Release(key) = self {
            names.push(format!("device-plugin:{}", key.name));
        }
        if let Action::WritePins([node]) = self {
            names.push(format!("device-plugin:{node}"));
        }
        if let Action::ReadPins = self {
            names.push("device-plugin:<node>".to_string());
        }
        names.join(", ")
    }
}

/// The permission table.
pub fn allowed(role: &Role, action: &Action<'_>) -> bool {
    use Action as A;
    let read = matches!(
        action,
        A::ReadLock(_) | A::ListLocks | A::ReadPins | A::ReadNodes | A::Watch | A::ClusterStatus
    );
    match role {
        Role::Replica => true,
        Role::Admin => !matches!(action, A::Raft),
        Role::Scheduler => {
            read || matches!(
                action,
                A::Acquire(_) | A::Release(_) | A::WritePins(_) | A::Leases
            )
        }
        Role::DevicePlugin { node } => match action {
            A::ReadLock(key) | A::Release(key) => key.name == *node,
            // Its node's device claims. A release of a pin that does not
            // exist (no node) changes nothing, so it is let through.
            A::WritePins(nodes) => nodes.iter().all(|n| n == node),
            A::ReadPins | A::ClusterStatus => true,
            _ => false,
        },
        Role::Bridge => read || matches!(action, A::RevokePod | A::Report),
        Role::Reader => read,
    }
}

/// How callers are identified.
#[derive(Debug)]
pub enum Auth {
    /// Nobody is asked (the insecure development default).
    Open,
    /// From the verified client certificate.
    Certificates,
    /// From a bearer token (development without TLS).
    Tokens(BTreeMap<String, Caller>),
}

/// The metadata key of bearer tokens.
pub const AUTHORIZATION: &str = "authorization";

impl Auth {
    /// Reads a token file: one `TOKEN ROLE [NAME]` per line, `#` comments.
    pub fn from_token_file(path: &Path) -> anyhow::Result<Auth> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the token file {}", path.display()))?;
        let mut tokens = BTreeMap::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (token, role, name) = match fields.as_slice() {
                [token, role] => (*token, *role, *role),
                [token, role, name] => (*token, *role, *name),
                _ => anyhow::bail!(
                    "{}:{}: expected `TOKEN ROLE [NAME]`",
                    path.display(),
                    number + 1
                ),
            };
            let role: Role = role
                .parse()
                .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), number + 1))?;
            anyhow::ensure!(
                token.len() >= 16,
                "{}:{}: tokens must be at least 16 characters",
                path.display(),
                number + 1
            );
            let caller = Caller {
                identity: format!("token:{name}"),
                role: Some(role),
            };
            anyhow::ensure!(
                tokens.insert(token.to_string(), caller).is_none(),
                "{}:{}: this token appears twice",
                path.display(),
                number + 1
            );
        }
        anyhow::ensure!(!tokens.is_empty(), "{} holds no token", path.display());
        Ok(Auth::Tokens(tokens))
    }

    /// What this replica sends its peers as `authorization`: with tokens,
    /// the token file's first `replica` token (every replica reads the same
    /// file, so a peer knows it); None otherwise (certificates identify
    /// replicas, and an open cluster asks nobody).
    pub fn peer_authorization(&self) -> Option<MetadataValue<Ascii>> {
        let Auth::Tokens(tokens) = self else {
            return None;
        };
        tokens
            .iter()
            .find(|(_, caller)| caller.role == Some(Role::Replica))
            .and_then(|(token, _)| format!("Bearer {token}").parse().ok())
    }

    /// The caller of `request`, or why it is refused.
    pub fn caller<T>(&self, request: &Request<T>) -> Result<Caller, ApiError> {
        match self {
            Auth::Open => Ok(Caller::anonymous()),
            Auth::Certificates => {
                let identity = request
                    .extensions()
                    .get::<PeerInfo>()
                    .and_then(|peer| peer.identity.clone())
                    .ok_or_else(|| ApiError::Unauthenticated("no client certificate".to_string()))?
                    .map_err(|why| ApiError::PermissionDenied(why.to_string()))?;
                let role = identity.name.parse::<Role>().map_err(|why| {
                    ApiError::PermissionDenied(format!(
                        "the client certificate ({}) names no role: {why}",
                        identity.subject
                    ))
                })?;
                Ok(Caller {
                    identity: identity.subject,
                    role: Some(role),
                })
            }
            Auth::Tokens(tokens) => {
                let value = request
                    .metadata()
                    .get(AUTHORIZATION)
                    .ok_or_else(|| {
                        ApiError::Unauthenticated(
                            "no bearer token: send `authorization: Bearer <token>`".to_string(),
                        )
                    })?
                    .to_str()
                    .map_err(|_| {
                        ApiError::Unauthenticated("the authorization header is not text".into())
                    })?;
                let token = value.strip_prefix("Bearer ").ok_or_else(|| {
                    ApiError::Unauthenticated(
                        "the authorization header must be `Bearer <token>`".to_string(),
                    )
                })?;
                tokens
                    .get(token.trim())
                    .cloned()
                    .ok_or_else(|| ApiError::Unauthenticated("unknown bearer token".to_string()))
            }
        }
    }

    /// The caller of `request`, if allowed to do `action`.
    pub fn check<T>(&self, request: &Request<T>, action: Action<'_>) -> Result<Caller, ApiError> {
        let caller = self.caller(request)?;
        caller.require(action)?;
        Ok(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> LockKey {
        LockKey::new("gpu-bind", name)
    }

    fn caller(role: &str) -> Caller {
        Caller {
            identity: format!("CN={role}"),
            role: Some(role.parse().unwrap()),
        }
    }

    #[test]
    fn a_device_plugin_reaches_only_its_own_node() {
        let plugin = caller("device-plugin:node-a");
        let (own, other) = (key("node-a"), key("node-b"));
        let (own_node, other_node) = (["node-a".to_string()], ["node-b".to_string()]);
        let both = ["node-a".to_string(), "node-b".to_string()];
        assert!(plugin.require(Action::ReadLock(&own)).is_ok());
        assert!(plugin.require(Action::Release(&own)).is_ok());
        assert!(plugin.require(Action::ClusterStatus).is_ok());
        assert!(plugin.require(Action::ReadPins).is_ok());
        assert!(plugin.require(Action::WritePins(&own_node)).is_ok());
        assert!(plugin.require(Action::WritePins(&[])).is_ok());
        for action in [
            Action::ReadLock(&other),
            Action::Release(&other),
            Action::ForceRelease(&own),
            Action::ForceRelease(&other),
            Action::Acquire(&own),
            Action::ListLocks,
            Action::Watch,
            Action::WritePins(&other_node),
            Action::WritePins(&both),
            Action::RevokePod,
            Action::ClusterAdmin,
            Action::Raft,
        ] {
            let err = plugin.require(action).unwrap_err();
            assert!(matches!(err, ApiError::PermissionDenied(_)), "{action:?}");
        }
        let message = plugin
            .require(Action::Release(&other))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("release lock gpu-bind/node-b")
                && message.contains("device-plugin:node-b")
                && message.contains("scheduler"),
            "{message}"
        );
    }

    #[test]
    fn each_role_gets_its_table_row() {
        let k = key("n");
        let elsewhere = ["m".to_string()];
        let all = [
            Action::Acquire(&k),
            Action::Release(&k),
            Action::ReadLock(&k),
            Action::ListLocks,
            Action::ForceRelease(&k),
            Action::WritePins(&elsewhere),
            Action::ReadPins,
            Action::Leases,
            Action::RevokePod,
            Action::Report,
            Action::ReadNodes,
            Action::Watch,
            Action::ClusterStatus,
            Action::ClusterAdmin,
            Action::Raft,
        ];
        let row = |role: &str| -> String {
            let role: Role = role.parse().unwrap();
            all.iter()
                .map(|a| if allowed(&role, a) { 'x' } else { '.' })
                .collect()
        };
        //                                 AcRlRdLsFrWpRpLeRvRpRnWaCsCaRf
        assert_eq!(row("admin"), "xxxxxxxxxxxxxx.");
        assert_eq!(row("replica"), "xxxxxxxxxxxxxxx");
        assert_eq!(row("scheduler"), "xxxx.xxx..xxx..");
        assert_eq!(row("bridge"), "..xx..x.xxxxx..");
        assert_eq!(row("reader"), "..xx..x...xxx..");
        assert_eq!(row("device-plugin:n"), ".xx...x.....x..");
        let on_n = ["n".to_string()];
        assert!(allowed(
            &"device-plugin:n".parse().unwrap(),
            &Action::WritePins(&on_n)
        ));
    }

    #[test]
    fn role_names_parse_and_bad_ones_say_what_exists() {
        assert_eq!(
            "device-plugin:gpu-7.zone-a".parse::<Role>().unwrap(),
            Role::DevicePlugin {
                node: "gpu-7.zone-a".into()
            }
        );
        let err = "root".parse::<Role>().unwrap_err();
        assert!(err.contains("scheduler"), "{err}");
        assert!("device-plugin:".parse::<Role>().is_err());
        assert!("device-plugin:Node_A".parse::<Role>().is_err());
    }

    #[test]
    fn with_authentication_off_everything_is_allowed() {
        let open = Caller::anonymous();
        assert!(!open.authenticated());
        assert!(open.require(Action::Raft).is_ok());
        assert!(open.require(Action::ForceRelease(&key("x"))).is_ok());
    }

    #[test]
    fn the_token_file_is_checked_line_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(
            &path,
            "# dev tokens\n0123456789abcdef scheduler\nfedcba9876543210 device-plugin:node-a plugin-a\n",
        )
        .unwrap();
        let Auth::Tokens(tokens) = Auth::from_token_file(&path).unwrap() else {
            panic!("tokens")
        };
        assert_eq!(tokens["fedcba9876543210"].identity, "token:plugin-a");
        for (text, why) in [
            ("short scheduler\n", "at least 16"),
            ("0123456789abcdef root\n", "not a Tether role"),
            ("0123456789abcdef\n", "TOKEN ROLE"),
            ("0123456789abcdef reader\n0123456789abcdef admin\n", "twice"),
            ("# nothing\n", "no token"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = format!("{:#}", Auth::from_token_file(&path).unwrap_err());
            assert!(err.contains(why), "{text:?}: {err}");
        }
    }
}
