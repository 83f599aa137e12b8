//! A small, protocol-faithful fake of the Kubernetes API for Pods and Nodes,
//! which the real `kube::Client` (and kube-runtime's watcher) talks to over
//! HTTP.
//!
//! Only the churn test (`bridge.rs`) still uses it; every other bridge test
//! runs against a real kube-apiserver (`real_apiserver.rs`). It is kept for
//! what a real API server cannot be made to do on demand: answer each list
//! page slowly while objects change between pages ([`FakeApi::set_list_delay`]),
//! and cut every watch and close connections mid-request with no answer at
//! all ([`FakeApi::outage`]), at a chosen moment in a 2,000-pod churn.
//!
//! What it implements, after the API's documented behaviour:
//! - `GET /api/v1/{pods,nodes}` lists with a collection `resourceVersion`,
//!   paginated as the API paginates (`ListMeta.continue` in the API
//!   reference, and KEP-365 "Paginated API Lists"): `limit=N` gives at most
//!   N items and a `continue` token. The next pages, asked for with
//!   `continue`, come from the same snapshot as the first, and carry the
//!   first page's `resourceVersion`. So an object created or deleted
//!   between pages shows up only in the next list. kube-runtime's watcher
//!   asks for pages of 500 (the churn test counts the continued pages).
//!   [`FakeApi::set_list_delay`] makes each page slow.
//! - `?watch=true&resourceVersion=N` streams (chunked JSON lines) replaying
//!   every change after N, then live changes, with BOOKMARK events; a
//!   resourceVersion older than the compaction point gets the API server's
//!   answer, an `ERROR` event with a `410 Gone` Status.
//! - `GET /api/v1/nodes/{name}` and `GET /api/v1/namespaces/{ns}/pods/{name}`
//!   (404 Status when absent).
//! - Outages ([`FakeApi::outage`]): every open watch is cut and, until the
//!   outage ends, every request's connection is closed without an answer
//!   (no 410): what a client sees while the API server or the network to it
//!   is down.
//!
//! What it does not: label/field selectors, namespaced list paths, writes
//! through the API (tests change objects with methods), authentication,
//! protobuf, server-side apply, expiry of continue tokens.
//!
//! It speaks HTTP/1.1 on raw sockets rather than through axum (which serves
//! every Tether binary, `tether-http`) because its outages must close a
//! connection without any answer, mid-request or mid-watch, and cut chunked
//! watch streams at will: faults a framework is built to prevent.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;

/// One stored change.
#[derive(Clone)]
struct Change {
    rv: u64,
    resource: &'static str,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(&'static str, String), Value>,
    log: Vec<Change>,
    compacted_below: u64,
    /// Paginated lists in progress: continue token → (kind, revision of the
    /// snapshot, the items not sent yet).
    pages: BTreeMap<String, (&'static str, u64, Vec<Value>)>,
    next_token: u64,
}

/// The fake API server.
pub struct FakeApi {
    store: Mutex<Store>,
    changes: broadcast::Sender<()>,
    /// Bumped to end every open watch stream.
    generation: Mutex<u64>,
    /// Until when requests are dropped unanswered (an outage).
    down_until: Mutex<Option<tokio::time::Instant>>,
    /// How long each list page takes.
    list_delay: Mutex<Duration>,
    /// Requests served, by kind ("list", "continued list" (a page after
    /// the first), "watch", "get"), for tests.
    pub requests: Mutex<BTreeMap<&'static str, u64>>,
    /// The URL to give `kube::Config::new`.
    pub url: String,
}

impl FakeApi {
    /// Starts the server on a loopback port.
    pub async fn start() -> Arc<FakeApi> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (changes, _) = broadcast::channel(1024);
        let api = Arc::new(FakeApi {
            store: Mutex::default(),
            changes,
            generation: Mutex::new(0),
            down_until: Mutex::new(None),
            list_delay: Mutex::new(Duration::ZERO),
            requests: Mutex::default(),
            url,
        });
        let server = api.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                // Watch events are small writes: without NODELAY, Nagle and
                // delayed ACKs add ~40 ms to each.
                let _ = stream.set_nodelay(true);
                let api = server.clone();
                tokio::spawn(async move {
                    let _ = api.connection(stream).await;
                });
            }
        });
        api
    }

    /// A kube client for this server.
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(kube::Config::new(self.url.parse().unwrap())).unwrap()
    }

    fn record(&self, resource: &'static str, kind: &'static str, key: String, mut object: Value) {
        let mut store = self.store.lock().unwrap();
        store.rv += 1;
        let rv = store.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        if kind == "DELETED" {
            store.objects.remove(&(resource, key));
        } else {
            store.objects.insert((resource, key), object.clone());
        }
        store.log.push(Change {
            rv,
            resource,
            kind,
            object,
        });
        drop(store);
        let _ = self.changes.send(());
    }

    /// Creates or updates a pod (ADDED / MODIFIED).
    pub fn put_pod(&self, pod: Value) {
        let key = format!(
            "{}/{}",
            pod["metadata"]["namespace"].as_str().unwrap(),
            pod["metadata"]["name"].as_str().unwrap()
        );
        let exists = self
            .store
            .lock()
            .unwrap()
            .objects
            .contains_key(&("pods", key.clone()));
        self.record("pods", if exists { "MODIFIED" } else { "ADDED" }, key, pod);
    }

    /// Deletes a pod (DELETED with its last state).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let key = format!("{namespace}/{name}");
        let last = self
            .store
            .lock()
            .unwrap()
            .objects
            .get(&("pods", key.clone()))
            .cloned()
            .expect("pod exists");
        self.record("pods", "DELETED", key, last);
    }

    /// Deletes a pod without any watch event reaching anyone: as if it was
    /// deleted while every watcher was disconnected and the history since
    /// was compacted.
    pub fn delete_pod_silently(&self, namespace: &str, name: &str) {
        {
            let mut store = self.store.lock().unwrap();
            store
                .objects
                .remove(&("pods", format!("{namespace}/{name}")));
            store.rv += 1;
        }
        self.compact();
        self.break_watches();
    }

    /// Creates or updates a node.
    pub fn put_node(&self, node: Value) {
        let key = node["metadata"]["name"].as_str().unwrap().to_string();
        let exists = self
            .store
            .lock()
            .unwrap()
            .objects
            .contains_key(&("nodes", key.clone()));
        self.record(
            "nodes",
            if exists { "MODIFIED" } else { "ADDED" },
            key,
            node,
        );
    }

    /// Deletes a node.
    pub fn delete_node(&self, name: &str) {
        let last = self
            .store
            .lock()
            .unwrap()
            .objects
            .get(&("nodes", name.to_string()))
            .cloned()
            .expect("node exists");
        self.record("nodes", "DELETED", name.to_string(), last);
    }

    /// Forgets the change history: watches from older versions get 410.
    pub fn compact(&self) {
        let mut store = self.store.lock().unwrap();
        store.compacted_below = store.rv + 1;
        store.log.clear();
    }

    /// Ends every open watch stream (the clients re-watch from their last
    /// resourceVersion).
    pub fn break_watches(&self) {
        *self.generation.lock().unwrap() += 1;
        let _ = self.changes.send(());
    }

    /// Cuts every watch and drops every request for `duration`.
    pub fn outage(&self, duration: Duration) {
        *self.down_until.lock().unwrap() = Some(tokio::time::Instant::now() + duration);
        self.break_watches();
    }

    /// Each list page takes `delay` from now on.
    pub fn set_list_delay(&self, delay: Duration) {
        *self.list_delay.lock().unwrap() = delay;
    }

    fn down(&self) -> bool {
        self.down_until
            .lock()
            .unwrap()
            .is_some_and(|until| tokio::time::Instant::now() < until)
    }

    fn count(&self, what: &'static str) {
        *self.requests.lock().unwrap().entry(what).or_default() += 1;
    }

    async fn connection(&self, mut stream: TcpStream) -> std::io::Result<()> {
        loop {
            let Some((method, target)) = read_head(&mut stream).await? else {
                return Ok(());
            };
            if self.down() {
                // No answer at all: the connection just ends.
                return Ok(());
            }
            let (path, query) = target.split_once('?').unwrap_or((&target, ""));
            let params: BTreeMap<&str, &str> = query
                .split('&')
                .filter_map(|kv| kv.split_once('='))
                .collect();
            let resource = match path {
                "/api/v1/pods" => Some("pods"),
                "/api/v1/nodes" => Some("nodes"),
                _ => None,
            };
            match (method.as_str(), resource) {
                ("GET", Some(resource))
                    if params
                        .get("watch")
                        .is_some_and(|w| *w == "true" || *w == "1") =>
                {
                    let from: u64 = params
                        .get("resourceVersion")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    let timeout: u64 = params
                        .get("timeoutSeconds")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(290);
                    return self
                        .watch(stream, resource, from, Duration::from_secs(timeout))
                        .await;
                }
                ("GET", Some(resource)) => {
                    self.count("list");
                    let delay = *self.list_delay.lock().unwrap();
                    tokio::time::sleep(delay).await;
                    let limit = params.get("limit").and_then(|l| l.parse().ok());
                    let token = params.get("continue").map(|t| t.to_string());
                    if token.is_some() {
                        self.count("continued list");
                    }
                    let body = self.list(resource, limit, token);
                    respond(&mut stream, "200 OK", &body).await?;
                }
                ("GET", None) if object_path(path).is_some() => {
                    self.count("get");
                    let (resource, key) = object_path(path).expect("checked");
                    let found = self
                        .store
                        .lock()
                        .unwrap()
                        .objects
                        .get(&(resource, key.clone()))
                        .cloned();
                    match found {
                        Some(object) => respond(&mut stream, "200 OK", &object).await?,
                        None => {
                            let name = key.rsplit('/').next().unwrap_or_default();
                            respond(
                                &mut stream,
                                "404 Not Found",
                                &status(
                                    404,
                                    "NotFound",
                                    &format!("{resource} \"{name}\" not found"),
                                ),
                            )
                            .await?
                        }
                    }
                }
                _ => {
                    respond(
                        &mut stream,
                        "404 Not Found",
                        &status(404, "NotFound", "the fake serves pods and nodes only"),
                    )
                    .await?
                }
            }
        }
    }

    /// One page of a list: the first (`token` None) snapshots the
    /// collection; later ones continue that snapshot.
    fn list(&self, resource: &'static str, limit: Option<usize>, token: Option<String>) -> Value {
        let mut store = self.store.lock().unwrap();
        let (rv, mut items) = match token.and_then(|t| store.pages.remove(&t)) {
            Some((_, rv, rest)) => (rv, rest),
            None => {
                let items: Vec<Value> = store
                    .objects
                    .iter()
                    .filter(|((r, _), _)| *r == resource)
                    .map(|(_, v)| v.clone())
                    .collect();
                (store.rv, items)
            }
        };
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if let Some(limit) = limit.filter(|l| *l > 0 && *l < items.len()) {
            let rest = items.split_off(limit);
            store.next_token += 1;
            let token = format!("page-{}", store.next_token);
            store.pages.insert(token.clone(), (resource, rv, rest));
            metadata["continue"] = json!(token);
        }
        let kind = if resource == "pods" {
            "PodList"
        } else {
            "NodeList"
        };
        json!({"apiVersion": "v1", "kind": kind, "metadata": metadata, "items": items})
    }

    async fn watch(
        &self,
        mut stream: TcpStream,
        resource: &'static str,
        from: u64,
        timeout: Duration,
    ) -> std::io::Result<()> {
        self.count("watch");
        let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
        stream.write_all(head.as_bytes()).await?;
        let mut wake = self.changes.subscribe();
        let generation = *self.generation.lock().unwrap();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut sent = from;
        let too_old = {
            let store = self.store.lock().unwrap();
            from != 0 && from < store.compacted_below.saturating_sub(1)
        };
        if too_old {
            let gone = json!({"type": "ERROR", "object": status(410, "Expired", &format!("too old resource version: {from}"))});
            write_chunk(&mut stream, &gone).await?;
            return finish(&mut stream).await;
        }
        let kind = if resource == "pods" { "Pod" } else { "Node" };
        loop {
            let pending: Vec<Change> = {
                let store = self.store.lock().unwrap();
                // The log is in resourceVersion order.
                let start = store.log.partition_point(|c| c.rv <= sent);
                store.log[start..]
                    .iter()
                    .filter(|c| c.resource == resource)
                    .cloned()
                    .collect()
            };
            for change in pending {
                write_chunk(
                    &mut stream,
                    &json!({"type": change.kind, "object": change.object}),
                )
                .await?;
                sent = change.rv;
            }
            let broken = *self.generation.lock().unwrap() != generation;
            if broken {
                return finish(&mut stream).await;
            }
            tokio::select! {
                _ = wake.recv() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    // A bookmark may only claim a version once every change
                    // of this resource up to it has been sent.
                    let bookmark_rv = {
                        let store = self.store.lock().unwrap();
                        let pending = store.log.iter().any(|c| c.resource == resource && c.rv > sent);
                        (!pending).then_some(store.rv.max(sent))
                    };
                    if let Some(rv) = bookmark_rv {
                        let bookmark = json!({"type": "BOOKMARK", "object": {"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": rv.to_string()}}});
                        write_chunk(&mut stream, &bookmark).await?;
                        sent = rv;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return finish(&mut stream).await,
            }
        }
    }
}

/// `(resource, key)` of a single-object path: `/api/v1/nodes/{name}` or
/// `/api/v1/namespaces/{ns}/pods/{name}`.
fn object_path(path: &str) -> Option<(&'static str, String)> {
    if let Some(name) = path.strip_prefix("/api/v1/nodes/") {
        return (!name.is_empty() && !name.contains('/')).then(|| ("nodes", name.to_string()));
    }
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let (namespace, rest) = rest.split_once('/')?;
    let name = rest.strip_prefix("pods/")?;
    (!name.is_empty() && !name.contains('/')).then(|| ("pods", format!("{namespace}/{name}")))
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code})
}

async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<(String, String)>> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await? == 0 {
            return Ok(None);
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut first = head.lines().next().unwrap_or_default().split_whitespace();
    Ok(Some((
        first.next().unwrap_or_default().to_string(),
        first.next().unwrap_or_default().to_string(),
    )))
}

async fn respond(stream: &mut TcpStream, status_line: &str, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 {status_line}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await
}

async fn write_chunk(stream: &mut TcpStream, value: &Value) -> std::io::Result<()> {
    let line = format!("{value}\n");
    stream
        .write_all(format!("{:x}\r\n{line}\r\n", line.len()).as_bytes())
        .await?;
    stream.flush().await
}

async fn finish(stream: &mut TcpStream) -> std::io::Result<()> {
    stream.write_all(b"0\r\n\r\n").await?;
    stream.shutdown().await
}

/// A pod object.
pub fn pod(name: &str, uid: &str, phase: &str, started: bool) -> Value {
    let statuses = if started {
        json!([{"name": "main", "image": "i", "imageID": "", "ready": true, "restartCount": 0, "started": true,
                "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}])
    } else {
        json!([])
    };
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "ml", "uid": uid},
           "spec": {"containers": [{"name": "main", "image": "i"}]},
           "status": {"phase": phase, "containerStatuses": statuses}})
}

/// A pod object bound to `node` (`spec.nodeName` set, as the scheduler's
/// bind sets it).
pub fn bound_pod(name: &str, uid: &str, node: &str, phase: &str, started: bool) -> Value {
    let mut pod = pod(name, uid, phase, started);
    pod["spec"]["nodeName"] = json!(node);
    pod
}

/// A node object with the UID `uid-{name}`.
pub fn node(name: &str, ready: bool, zone: &str) -> Value {
    node_with_uid(name, &format!("uid-{name}"), ready, zone)
}

/// A node object.
pub fn node_with_uid(name: &str, uid: &str, ready: bool, zone: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "uid": uid, "labels": {"topology.kubernetes.io/zone": zone}},
           "spec": {},
           "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}
