//! gRPC handlers: decode, validate, authorize, call the replica core
//! ([`crate::replica`]) and convert. Errors map to `Status` in one place
//! (`crate::error`).

pub mod cluster;
pub mod convert;
pub mod lease;
pub mod lock;
pub mod node;
pub mod pin;
pub mod sessions;
pub mod validate;
pub mod watch;

use std::sync::Arc;

use tether_proto::ResponseHeader;

use crate::error::{ApiError, Result};
use crate::replica::Replica;
use crate::sm::RequestId;

pub use crate::replica::unexpected;

/// What [`send_or_cut`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// The item is in the stream.
    Sent,
    /// The reader has left.
    Left,
    /// The reader took nothing for the timeout: it was sent the error and
    /// the stream must end.
    Cut,
}

/// Sends `item` to a streaming reader, waiting at most `timeout` for it to
/// take what is queued; a reader too slow gets `too_slow()` as the stream's
/// last item instead. Give the channel one slot more than it should buffer:
/// an item goes in only while two slots are free, so the error always has
/// room (a full channel would drop it and the reader would see the stream
/// end without a reason).
pub async fn send_or_cut<T>(
    tx: &tokio::sync::mpsc::Sender<std::result::Result<T, tonic::Status>>,
    item: T,
    timeout: std::time::Duration,
    too_slow: impl FnOnce() -> ApiError,
) -> Sent {
    match tokio::time::timeout(timeout, tx.reserve_many(2)).await {
        Ok(Ok(mut permits)) => {
            permits.next().expect("two permits").send(Ok(item));
            Sent::Sent
        }
        Ok(Err(_)) => Sent::Left,
        Err(_) => {
            let _ = tx.try_send(Err(too_slow().into()));
            Sent::Cut
        }
    }
}

/// What every handler needs: the replica core, who may call, and the
/// watches open per caller.
pub struct Ctx {
    /// The replica core every call goes through.
    pub core: Arc<Replica>,
    /// How callers are identified and what their roles allow.
    pub auth: Arc<crate::auth::Auth>,
    /// Open watches per owner (identity or IP), for
    /// `--max-watchers-per-client`.
    pub watchers: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

impl Ctx {
    /// The handlers' context over `core`, authenticating with `auth`.
    pub fn new(core: Arc<Replica>, auth: Arc<crate::auth::Auth>) -> Self {
        Self {
            core,
            auth,
            watchers: Default::default(),
        }
    }

    /// A request's id as the state machine keys it
    /// ([`validate::request_id`]), admitted if it would open a new session
    /// ([`sessions::admit_in`]: the caller's identity under its quota, the
    /// table's reserved places only for the roles that need them).
    pub fn request_id(
        &self,
        caller: &crate::auth::Caller,
        id: Option<&tether_proto::RequestId>,
    ) -> Result<Option<RequestId>> {
        let id = validate::request_id(caller, id)?;
        if let Some(id) = &id {
            let limits = sessions::SessionLimits {
                per_identity: self.core.config.max_sessions_per_identity as usize,
                reserved: self.core.config.reserved_sessions as usize,
            };
            let applied = self.core.state.read();
            sessions::admit_in(&applied.state, caller, &id.client_id, limits)
                .map_err(ApiError::QuotaExceeded)?;
        }
        Ok(id)
    }

    /// `taking` for the node objects the caller saw (those with a UID);
    /// unchecked while another member is known to read only older formats
    /// than 10 (an upgrade from an older build), or when the caller named
    /// none. A member not heard from since this replica started (a new
    /// leader's first moments) does not turn the check off: a taking let
    /// through unchecked then would sit under the old object's
    /// registration and end with its `Gone` (the chaos workload caught
    /// that).
    pub fn taking_for(
        &self,
        seen: Vec<crate::sm::command::SeenNode>,
        taking: crate::sm::command::NodeTaking,
    ) -> crate::sm::Command {
        let seen: Vec<_> = seen.into_iter().filter(|n| !n.uid.is_empty()).collect();
        if seen.is_empty()
            || self
                .core
                .member_known_older_than(crate::sm::command::NODE_OBJECT_FORMAT_VERSION)
        {
            return taking.into_command();
        }
        crate::sm::Command::ForNodeObjects(crate::sm::command::ForNodeObjects {
            nodes: seen,
            command: taking,
        })
    }

    /// Header for a response.
    pub fn header(&self, linearizable: bool) -> ResponseHeader {
        let (applied_index, leader_id) = self.core.applied_and_leader();
        ResponseHeader {
            applied_index,
            node_id: self.core.id,
            leader_id: leader_id.unwrap_or(0),
            linearizable,
            cluster_id: self.core.cluster_id.get().unwrap_or_default(),
        }
    }

    /// Serves one unary call the same way for every method: who calls (and,
    /// given `allow`, whether their role may do that action; handlers that
    /// authorize per key get the caller and check themselves), then
    /// `handle` with the caller and the request, then the result recorded
    /// in metrics under `method` and converted.
    pub async fn serve<Req, Resp, Fut>(
        &self,
        method: &'static str,
        request: tonic::Request<Req>,
        allow: Option<crate::auth::Action<'_>>,
        handle: impl FnOnce(crate::auth::Caller, Req) -> Fut,
    ) -> Result<tonic::Response<Resp>, tonic::Status>
    where
        Fut: std::future::Future<Output = Result<Resp>>,
    {
        let caller = match allow {
            Some(action) => self.auth.check(&request, action),
            None => self.auth.caller(&request),
        };
        let result = match caller {
            Ok(caller) => handle(caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.finish(method, result).map(tonic::Response::new)
    }

    /// Records a call's result in metrics and converts errors to `Status`.
    pub fn finish<T>(&self, method: &'static str, result: Result<T>) -> Result<T, tonic::Status> {
        match result {
            Ok(value) => {
                self.core.metrics.request(method, "ok");
                Ok(value)
            }
            Err(err) => {
                self.core.metrics.request(method, err.metric_label());
                Err(err.into())
            }
        }
    }
}
