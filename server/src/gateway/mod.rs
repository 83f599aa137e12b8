//! The HTTP/JSON API: every method of the public gRPC services, served on
//! the HTTP port as `POST /v1/{service}/{method}` with the proto3 JSON
//! mapping of the same messages (see [`json`]), as etcd serves its gRPC
//! API over JSON. One implementation behind both transports: a route
//! builds the `tonic::Request` the gRPC server would have built (the
//! headers become its metadata, the connection's [`PeerInfo`] its
//! extension) and calls the same service method, so authentication,
//! roles, validation, request ids and metrics are the gRPC handlers' own.
//!
//! - Paths: the service without `Service`, lower case, then the method in
//!   kebab case: `LockService.ForceRelease` is `POST /v1/lock/force-release`.
//!   [`openapi`] describes every route (`GET /openapi.json`), each with the
//!   gRPC method's full name as its `operationId`.
//! - A unary method answers `200` with the response message; a method
//!   whose gRPC response is a stream (`Acquire`, `Watch`,
//!   `ExportSnapshot`) answers `200` with newline-delimited JSON, one
//!   `{"result": message}` per response and, if the call fails on the
//!   way, a last `{"error": {...}}` line. Closing the connection ends the
//!   call as cancelling it over gRPC does (an acquire's wait is given up).
//! - `LeaseService.KeepAlive`, a stream both ways over gRPC, is one
//!   request and one answer per renewal here.
//! - Errors: the HTTP status of the gRPC code (as gRPC-gateway maps them)
//!   and `{"code": "UNAVAILABLE", "message": "..."}`; the metadata the
//!   gRPC answer would carry (`x-tether-leader-id`, ...) comes as headers.
//!   A body over `--max-request-bytes` is answered `413` (code
//!   `RESOURCE_EXHAUSTED`, the limit in the message) before the body is
//!   asked for when the client waits for `100 Continue`, else once the
//!   body has been read and thrown away, so that the client reads it.
//! - Every answer names the answering replica (`x-tether-node-id`) and,
//!   once known, its cluster (`x-tether-cluster-id`); a request with
//!   `x-tether-expect-cluster` naming another cluster is refused before
//!   anything runs, as over gRPC.
//! - Authentication as over gRPC: `authorization: Bearer <token>` with a
//!   token file, or the client certificate with `--tls-dir` (the HTTP port
//!   then serves HTTPS and asks for a certificate without requiring one,
//!   so probes work; the API refuses a caller without one).

pub mod json;
pub mod openapi;

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse as _, Response};
use axum::routing::{MethodRouter, post};
use futures::{Stream, StreamExt as _};
use tether_proto as pb;
use tether_proto::cluster_service_server::ClusterService as _;
use tether_proto::lease_service_server::LeaseService as _;
use tether_proto::lock_service_server::LockService as _;
use tether_proto::node_service_server::NodeService as _;
use tether_proto::pin_service_server::PinService as _;
use tether_proto::watch_service_server::WatchService as _;
use tether_tls::PeerInfo;
use tonic::{Code, Status};

use crate::api::Ctx;
use crate::api::cluster::ClusterApi;
use crate::api::lease::LeaseApi;
use crate::api::lock::LockApi;
use crate::api::node::NodeApi;
use crate::api::pin::PinApi;
use crate::api::watch::WatchApi;
use crate::error::code_name;

/// Header naming the replica that answered.
pub const NODE_ID_HEADER: &str = "x-tether-node-id";

/// The services a route calls, over one replica's context.
pub struct Services {
    ctx: Arc<Ctx>,
    lock: LockApi,
    lease: LeaseApi,
    pin: PinApi,
    node: NodeApi,
    watch: WatchApi,
    cluster: ClusterApi,
}

impl Services {
    /// The gRPC services of `ctx`, to be called in process.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self {
            lock: LockApi::new(ctx.clone()),
            lease: LeaseApi::new(ctx.clone()),
            pin: PinApi::new(ctx.clone()),
            node: NodeApi::new(ctx.clone()),
            watch: WatchApi::new(ctx.clone()),
            cluster: ClusterApi::new(ctx.clone()),
            ctx,
        }
    }
}

/// How a method answers over HTTP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// One JSON message.
    Unary,
    /// Newline-delimited JSON: a line per response.
    Stream,
}

/// One route of the API: the gRPC method it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The service's name in `tether.v1`, e.g. `LockService`.
    pub service: &'static str,
    /// The method's name, e.g. `ForceRelease`.
    pub method: &'static str,
    /// How it answers.
    pub shape: Shape,
    /// The request message's full name, e.g. `tether.v1.ReleaseRequest`.
    pub input: String,
    /// The response message's full name (of each line, for a stream).
    pub output: String,
}

impl Route {
    /// `/v1/lock/force-release` for `LockService.ForceRelease`.
    pub fn path(&self) -> String {
        let service = self
            .service
            .trim_end_matches("Service")
            .to_ascii_lowercase();
        format!("/v1/{service}/{}", kebab_case(self.method))
    }

    /// `LockService.ForceRelease`: the `operationId` in the OpenAPI
    /// document.
    pub fn operation_id(&self) -> String {
        format!("{}.{}", self.service, self.method)
    }
}

/// `ForceRelease` → `force-release`.
fn kebab_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('-');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

type Handler = MethodRouter<Arc<Services>>;

/// A route of [`table`]: `call!(unary LockService.Release =>
/// lock.release(ReleaseRequest))` serves `LockService.Release` by calling
/// the `release` method of the services' `lock` with a
/// `tonic::Request<pb::ReleaseRequest>`.
macro_rules! call {
    ($shape:ident $service:ident . $method:ident => $api:ident . $call:ident ($request:ident)) => {
        $shape(
            stringify!($service),
            stringify!($method),
            |s: Arc<Services>, r: tonic::Request<pb::$request>| async move { s.$api.$call(r).await },
        )
    };
}

/// Every route with its handler. The order is the order of the services
/// and methods in the `.proto` files.
pub fn table() -> Vec<(Route, Handler)> {
    vec![
        call!(stream LockService.Acquire => lock.acquire(AcquireRequest)),
        call!(unary LockService.Release => lock.release(ReleaseRequest)),
        call!(unary LockService.Holder => lock.holder(HolderRequest)),
        call!(unary LockService.Get => lock.get(GetLockRequest)),
        call!(unary LockService.List => lock.list(ListLocksRequest)),
        call!(unary LockService.ForceRelease => lock.force_release(ForceReleaseRequest)),
        call!(unary LockService.Withdraw => lock.withdraw(WithdrawRequest)),
        call!(unary LeaseService.RevokePod => lease.revoke_pod(RevokePodRequest)),
        call!(unary LeaseService.Grant => lease.grant(LeaseGrantRequest)),
        call!(unary LeaseService.KeepAlive => lease.keep_alive_once(LeaseKeepAliveRequest)),
        call!(unary LeaseService.Revoke => lease.revoke(LeaseRevokeRequest)),
        call!(unary LeaseService.ReportPod => lease.report_pod(ReportPodRequest)),
        call!(unary PinService.Assign => pin.assign(AssignRequest)),
        call!(unary PinService.Release => pin.release(ReleasePinRequest)),
        call!(unary PinService.Get => pin.get(GetPinRequest)),
        call!(unary PinService.List => pin.list(ListPinsRequest)),
        call!(unary PinService.Reclaim => pin.reclaim(ReclaimRequest)),
        call!(unary NodeService.Report => node.report(ReportNodeRequest)),
        call!(unary NodeService.List => node.list(ListNodesRequest)),
        call!(stream WatchService.Watch => watch.watch(WatchRequest)),
        call!(unary WatchService.History => watch.history(HistoryRequest)),
        call!(unary ClusterService.Status => cluster.status(StatusRequest)),
        call!(unary ClusterService.AddLearner => cluster.add_learner(AddLearnerRequest)),
        call!(unary ClusterService.ChangeMembership => cluster.change_membership(ChangeMembershipRequest)),
        call!(unary ClusterService.TransferLeader => cluster.transfer_leader(TransferLeaderRequest)),
        call!(unary ClusterService.Snapshot => cluster.snapshot(SnapshotRequest)),
        call!(stream ClusterService.ExportSnapshot => cluster.export_snapshot(ExportSnapshotRequest)),
    ]
}

/// The routes alone, for the OpenAPI document and its checks.
pub fn routes() -> Vec<Route> {
    table().into_iter().map(|(route, _)| route).collect()
}

/// The API's routes and `GET /openapi.json`, to merge into the HTTP port's
/// router.
pub fn router(ctx: Arc<Ctx>) -> axum::Router {
    let table = table();
    let routes: Vec<Route> = table.iter().map(|(route, _)| route.clone()).collect();
    // Written once: the document does not change while the process runs.
    let document = axum::body::Bytes::from(openapi::document(&routes).to_string());
    let mut router = axum::Router::new();
    for (route, handler) in table {
        router = router.route(&route.path(), handler);
    }
    router
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let document = document.clone();
                async move {
                    ([(header::CONTENT_TYPE, "application/json")], document).into_response()
                }
            }),
        )
        .with_state(Arc::new(Services::new(ctx)))
}

/// A route to a unary gRPC method: its answer is one JSON message.
fn unary<Req, Resp, F, Fut>(
    service: &'static str,
    method: &'static str,
    call: F,
) -> (Route, Handler)
where
    Req: prost::Message + prost::Name + Default + Send + 'static,
    Resp: prost::Message + prost::Name + Send + 'static,
    F: Fn(Arc<Services>, tonic::Request<Req>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<tonic::Response<Resp>, Status>> + Send + 'static,
{
    route::<Req, Resp, Resp, F, Fut>(service, method, Shape::Unary, call, |services, response| {
        let body = Body::from(json::encode(&response).to_string());
        answer(services, StatusCode::OK, "application/json", body)
    })
}

/// A route to a gRPC method whose response is a stream: its answer is a
/// JSON line per response, and a last line for a failure on the way.
fn stream<Req, Resp, S, F, Fut>(
    service: &'static str,
    method: &'static str,
    call: F,
) -> (Route, Handler)
where
    Req: prost::Message + prost::Name + Default + Send + 'static,
    Resp: prost::Message + prost::Name + Send + 'static,
    S: Stream<Item = Result<Resp, Status>> + Send + 'static,
    F: Fn(Arc<Services>, tonic::Request<Req>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<tonic::Response<S>, Status>> + Send + 'static,
{
    route::<Req, Resp, S, F, Fut>(
        service,
        method,
        Shape::Stream,
        call,
        |services, responses| {
            let lines = responses
                .scan(false, |failed, item| {
                    if *failed {
                        return futures::future::ready(None);
                    }
                    let line = match item {
                        Ok(message) => serde_json::json!({ "result": json::encode(&message) }),
                        Err(status) => {
                            *failed = true;
                            serde_json::json!({ "error": error_body(&status) })
                        }
                    };
                    futures::future::ready(Some(Ok::<_, std::convert::Infallible>(format!(
                        "{line}\n"
                    ))))
                })
                .boxed();
            answer(
                services,
                StatusCode::OK,
                "application/x-ndjson",
                Body::from_stream(lines),
            )
        },
    )
}

/// A route to a gRPC method taking `Req` and answering `Resp` (as `T`: the
/// message, or a stream of them), whose success `respond` writes.
fn route<Req, Resp, T, F, Fut>(
    service: &'static str,
    method: &'static str,
    shape: Shape,
    call: F,
    respond: fn(&Services, T) -> Response,
) -> (Route, Handler)
where
    Req: prost::Message + prost::Name + Default + Send + 'static,
    Resp: prost::Name,
    T: Send + 'static,
    F: Fn(Arc<Services>, tonic::Request<Req>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<tonic::Response<T>, Status>> + Send + 'static,
{
    let route = Route {
        service,
        method,
        shape,
        input: Req::full_name(),
        output: Resp::full_name(),
    };
    let operation = route.operation_id();
    let handler = post(
        move |State(services): State<Arc<Services>>, request: Request| {
            let (call, operation) = (call.clone(), operation.clone());
            async move {
                let started = std::time::Instant::now();
                let (code, answer) = match prepare::<Req>(&services, request).await {
                    Ok(request) => match call(services.clone(), request).await {
                        Ok(response) => (Code::Ok, respond(&services, response.into_inner())),
                        Err(status) => (status.code(), refusal(&services, &status)),
                    },
                    Err(unprepared) => (unprepared.status.code(), unprepared.answer(&services)),
                };
                let metrics = &services.ctx.core.metrics;
                metrics.http_api_call(operation, code_name(code), started.elapsed());
                answer
            }
        },
    );
    (route, handler)
}

/// The gRPC request an HTTP request stands for: the body decoded, the
/// headers as metadata, the connection's peer as the extension the gRPC
/// server would have set; refused if meant for another cluster or if its
/// body is over `--max-request-bytes`.
async fn prepare<Req>(
    services: &Services,
    request: Request,
) -> Result<tonic::Request<Req>, Unprepared>
where
    Req: prost::Message + prost::Name + Default,
{
    let (parts, body) = request.into_parts();
    let limit = services.ctx.core.config.max_request_bytes;
    let body = read_body(&parts.headers, body, limit).await?;
    let metadata = tonic::metadata::MetadataMap::from_headers(parts.headers);
    crate::cluster_id::check_expected(&services.ctx.core.cluster_id, &metadata)?;
    let message = json::decode::<Req>(&body).map_err(Status::invalid_argument)?;
    let peer = parts
        .extensions
        .get::<ConnectInfo<HttpPeer>>()
        .map(|ConnectInfo(HttpPeer(peer))| peer.clone())
        .unwrap_or(PeerInfo {
            remote_addr: None,
            identity: None,
        });
    let mut request = tonic::Request::new(message);
    *request.metadata_mut() = metadata;
    request.extensions_mut().insert(peer);
    Ok(request)
}

/// How much of a body over the limit is read and thrown away before the
/// 413 is sent, and for how long at most. A client that sends its whole
/// body before reading the answer (curl without `Expect: 100-continue`,
/// most libraries) would otherwise have the connection reset under it
/// while still sending: the server closes a connection whose body it did
/// not read, the kernel answers the data still arriving with a reset, and
/// the reset can throw away the answer before the client reads it. Past
/// these bounds the answer is sent anyway and the connection closed.
const DRAIN_BYTES: usize = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// A request refused before its call: the status its body carries, the
/// HTTP status when it is not the code's own, and whether the connection
/// must close (part of the body is left unread).
struct Unprepared {
    status: Status,
    http: Option<StatusCode>,
    close: bool,
}

impl From<Status> for Unprepared {
    fn from(status: Status) -> Self {
        Self {
            status,
            http: None,
            close: false,
        }
    }
}

impl Unprepared {
    /// `413 Content Too Large` naming the limit (gRPC's own code for a
    /// message over the limit is `RESOURCE_EXHAUSTED`).
    fn too_large(declared: Option<u64>, limit: usize, close: bool) -> Self {
        let size = match declared {
            Some(bytes) => format!("the request body of {bytes} bytes"),
            None => "the request body".to_string(),
        };
        Self {
            status: Status::resource_exhausted(format!(
                "{size} is over the limit of {limit} bytes (tetherd --max-request-bytes); \
                 nothing was done"
            )),
            http: Some(StatusCode::PAYLOAD_TOO_LARGE),
            close,
        }
    }

    fn answer(&self, services: &Services) -> Response {
        let mut response = refusal(services, &self.status);
        if let Some(status) = self.http {
            *response.status_mut() = status;
        }
        if self.close {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// The body, if it is at most `limit` bytes. A body declared over the limit
/// by a client waiting for `100 Continue` is refused before the server asks
/// for it; any other body over the limit is read to its end (within
/// [`DRAIN_BYTES`] and [`DRAIN_TIME`]) and thrown away, so that the client,
/// done sending, reads the refusal.
async fn read_body(
    headers: &axum::http::HeaderMap,
    body: Body,
    limit: usize,
) -> Result<axum::body::Bytes, Unprepared> {
    let declared: Option<u64> = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse().ok());
    let over = |bytes: u64| bytes > limit as u64;
    let waits_for_continue = headers
        .get(header::EXPECT)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if waits_for_continue && declared.is_some_and(over) {
        // Not a byte of the body has been asked for: hyper sends `100
        // Continue` only once the body is read, so the client sends none.
        return Err(Unprepared::too_large(declared, limit, true));
    }
    let unreadable = |err: axum::Error| {
        Unprepared::from(Status::invalid_argument(format!(
            "the request body could not be read: {err}"
        )))
    };
    let mut chunks = body.into_data_stream();
    let mut kept = Vec::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
    let mut read = 0usize;
    if !declared.is_some_and(over) {
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(unreadable)?;
            read += chunk.len();
            if read > limit {
                break;
            }
            kept.extend_from_slice(&chunk);
        }
        if read <= limit {
            return Ok(kept.into());
        }
    }
    drop(kept);
    let drained = tokio::time::timeout(DRAIN_TIME, async {
        while read <= limit.saturating_add(DRAIN_BYTES) {
            match chunks.next().await {
                Some(Ok(chunk)) => read += chunk.len(),
                Some(Err(_)) => return false,
                None => return true,
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    Err(Unprepared::too_large(declared, limit, !drained))
}

/// What the HTTP port knows of a connection: its [`PeerInfo`], as the gRPC
/// port's requests carry it.
#[derive(Clone, Debug)]
pub struct HttpPeer(pub PeerInfo);

/// An answer with the headers every answer carries.
fn answer(services: &Services, status: StatusCode, content_type: &str, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(content_type) {
        headers.insert(header::CONTENT_TYPE, value);
    }
    headers.insert(
        HeaderName::from_static(NODE_ID_HEADER),
        HeaderValue::from(services.ctx.core.id),
    );
    if let Some(value) = services
        .ctx
        .core
        .cluster_id
        .get()
        .and_then(|id| HeaderValue::from_str(&id).ok())
    {
        headers.insert(HeaderName::from_static(crate::cluster_id::METADATA), value);
    }
    response
}

/// A refused or failed call: the HTTP status of its code, the code and the
/// message in the body, the gRPC answer's `x-tether-*` metadata as headers.
fn refusal(services: &Services, status: &Status) -> Response {
    let mut response = answer(
        services,
        http_status(status.code()),
        "application/json",
        Body::from(error_body(status).to_string()),
    );
    let headers = response.headers_mut();
    for entry in status.metadata().iter() {
        if let tonic::metadata::KeyAndValueRef::Ascii(key, value) = entry
            && key.as_str().starts_with("x-tether-")
            && let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(key.as_str().as_bytes()),
                HeaderValue::from_bytes(value.as_encoded_bytes()),
            )
        {
            headers.insert(name, value);
        }
    }
    response
}

/// `{"code": "NOT_FOUND", "message": "..."}`.
fn error_body(status: &Status) -> serde_json::Value {
    serde_json::json!({
        "code": code_name(status.code()),
        "message": status.message(),
    })
}

/// The HTTP status of a gRPC code, as gRPC-gateway maps them.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        // nginx's "client closed request"; gRPC-gateway uses it too.
        Code::Cancelled => StatusCode::from_u16(499).expect("499 is a valid status"),
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_the_service_and_the_method_in_kebab_case() {
        let route = |service, method| Route {
            service,
            method,
            shape: Shape::Unary,
            input: String::new(),
            output: String::new(),
        };
        assert_eq!(
            route("LockService", "ForceRelease").path(),
            "/v1/lock/force-release"
        );
        assert_eq!(
            route("ClusterService", "ExportSnapshot").path(),
            "/v1/cluster/export-snapshot"
        );
        assert_eq!(route("WatchService", "Watch").path(), "/v1/watch/watch");
        assert_eq!(
            route("LeaseService", "KeepAlive").operation_id(),
            "LeaseService.KeepAlive"
        );
    }

    /// Each route's messages are the gRPC method's, so the JSON a route
    /// takes is the mapping of what the method takes; and every method of
    /// every public service has its route.
    #[test]
    fn the_routes_are_the_public_grpc_methods_with_their_messages() {
        let routes = routes();
        let pool = json::pool();
        let mut served = Vec::new();
        for service in pool.services() {
            if service.name() == "RaftService" {
                continue; // between replicas only
            }
            for method in service.methods() {
                let id = format!("{}.{}", service.name(), method.name());
                let route = routes
                    .iter()
                    .find(|r| r.operation_id() == id)
                    .unwrap_or_else(|| panic!("{id} has no HTTP route"));
                assert_eq!(route.input, method.input().full_name(), "{id}");
                assert_eq!(route.output, method.output().full_name(), "{id}");
                let streams = method.is_server_streaming();
                // KeepAlive streams both ways over gRPC, once per call here.
                let expected = if streams && !method.is_client_streaming() {
                    Shape::Stream
                } else {
                    Shape::Unary
                };
                assert_eq!(route.shape, expected, "{id}");
                served.push(id);
            }
        }
        assert_eq!(served.len(), routes.len(), "a route serves no gRPC method");
    }

    #[test]
    fn every_code_has_a_name_and_a_status() {
        assert_eq!(code_name(Code::Unavailable), "UNAVAILABLE");
        assert_eq!(
            http_status(Code::Unavailable),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(http_status(Code::Unauthenticated), StatusCode::UNAUTHORIZED);
        assert_eq!(http_status(Code::PermissionDenied), StatusCode::FORBIDDEN);
        assert_eq!(http_status(Code::Cancelled).as_u16(), 499);
    }
}
