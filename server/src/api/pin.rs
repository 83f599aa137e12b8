//! `PinService`: assign, release, get, list pins.

use crate::auth::{Action, Caller};
use std::sync::Arc;

use tether_proto as pb;
use tether_proto::pin_service_server::PinService;
use tonic::{Request, Response, Status};

use super::convert::{key_of_pin, pin_to};
use super::{Ctx, unexpected, validate};
use crate::error::Result;
use crate::sm::command::{
    Assign, GIVE_BACK_FORMAT_VERSION, NodeTaking, Reclaim, ReleasePin, ReleasePinIf, SeenNode,
    TAKEOVER_FORMAT_VERSION,
};
use crate::sm::{Command, Reply};

/// The `PinService` implementation.
pub struct PinApi {
    ctx: Arc<Ctx>,
}

impl PinApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }

    /// The node of the pin `key` names, as this replica has it applied
    /// (none if there is no such pin), for the permission check of a
    /// release. Pins never move: a pin found on a node is released there,
    /// unless it ends and a new pin of the same key is assigned elsewhere
    /// between this read and the release's entry.
    fn node_of(&self, key: Option<&pb::PinKey>) -> Vec<String> {
        let Ok(key) = validate::pin_key(key) else {
            return Vec::new();
        };
        self.ctx
            .core
            .state
            .read()
            .state
            .pins
            .get(&key)
            .map(|p| p.node.clone())
            .into_iter()
            .collect()
    }

    async fn do_assign(
        &self,
        caller: &Caller,
        req: pb::AssignRequest,
    ) -> Result<pb::AssignResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::pin_key(req.key.as_ref())?;
        let candidates = validate::candidates(&req.candidates)?;
        if !req.pod_uid.is_empty() {
            validate::pod_uid(&req.pod_uid)?;
        }
        let labels = validate::labels("pin label", &req.labels, self.ctx.core.config.max_labels)?;
        let affinity = validate::affinity(req.affinity.as_ref())?;
        let mut seen = Vec::new();
        for (node, uid) in req.candidate_uids {
            if !candidates.contains(&node) {
                return Err(crate::error::ApiError::InvalidArgument(format!(
                    "candidate_uids names node {node:?}, which is not a candidate"
                )));
            }
            validate::node_uid(&node, &uid)?;
            seen.push(SeenNode { name: node, uid });
        }
        let command = self.ctx.taking_for(
            seen,
            NodeTaking::Assign(Assign {
                key: key.clone(),
                candidates,
                pod_uid: req.pod_uid,
                lifetime_ms: req.lifetime_ms,
                labels,
                affinity,
            }),
        );
        match self.ctx.core.write(request_id, command).await? {
            Reply::Pinned { pin, created } => {
                if created {
                    tracing::info!(pin = %key, node = pin.node, pod_uid = pin.pod_uid, "pin assigned");
                }
                Ok(pb::AssignResponse {
                    pin: Some(pin_to(&key, &pin)),
                    created,
                    header: Some(self.ctx.header(false)),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    async fn do_release(
        &self,
        caller: &Caller,
        req: pb::ReleasePinRequest,
    ) -> Result<pb::ReleasePinResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::pin_key(req.key.as_ref())?;
        validate::text("reason", &req.reason, false)?;
        let reason = if req.reason.is_empty() {
            "released".to_string()
        } else {
            req.reason
        };
        let command = if req.if_labels.is_empty() {
            Command::ReleasePin(ReleasePin {
                key: key.clone(),
                reason,
            })
        } else {
            let labels = validate::labels(
                "condition label",
                &req.if_labels,
                self.ctx.core.config.max_labels,
            )?;
            self.ctx.core.require_format(
                TAKEOVER_FORMAT_VERSION,
                "a pin release on condition of its labels",
                "finish the upgrade",
            )?;
            Command::ReleasePinIf(ReleasePinIf {
                key: key.clone(),
                reason,
                labels: labels.into(),
            })
        };
        match self.ctx.core.write(request_id, command).await? {
            Reply::PinReleased { pin } => Ok(pb::ReleasePinResponse {
                released: pin.as_ref().map(|p| pin_to(&key, p)),
                header: Some(self.ctx.header(false)),
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn do_reclaim(
        &self,
        caller: &Caller,
        req: pb::ReclaimRequest,
    ) -> Result<pb::ReclaimResponse> {
        let ctx = &self.ctx;
        let request_id = ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::pin_key(req.key.as_ref())?;
        validate::dns1123_subdomain("node", &req.node)?;
        validate::pod_uid(&req.pod_uid)?;
        let labels = validate::labels("pin label", &req.labels, ctx.core.config.max_labels)?;
        validate::text("exclusive prefix", &req.exclusive_prefix, false)?;
        ctx.core.require_format(
            GIVE_BACK_FORMAT_VERSION,
            "reclaim",
            "finish the upgrade, or release and assign again",
        )?;
        validate::node_uid(&req.node, &req.node_uid)?;
        let seen = vec![SeenNode {
            name: req.node.clone(),
            uid: req.node_uid,
        }];
        let command = ctx.taking_for(
            seen,
            NodeTaking::Reclaim(Reclaim {
                key: key.clone(),
                node: req.node,
                pod_uid: req.pod_uid,
                lifetime_ms: req.lifetime_ms,
                labels,
                exclusive_prefix: req.exclusive_prefix,
            }),
        );
        match ctx.core.write(request_id, command).await? {
            Reply::Reclaimed(done) => {
                if !done.taken_from.is_empty() || done.previous.as_ref() != Some(&done.pin) {
                    tracing::info!(pin = %key, node = done.pin.node, taken = ?done.taken_from, "pin reclaimed");
                }
                Ok(pb::ReclaimResponse {
                    pin: Some(pin_to(&key, &done.pin)),
                    previous: done.previous.as_ref().map(|p| pin_to(&key, p)),
                    taken: done
                        .taken_from
                        .iter()
                        .map(|(k, labels)| pb::TakenLabels {
                            key: Some(key_of_pin(k)),
                            labels: labels.clone(),
                        })
                        .collect(),
                    header: Some(ctx.header(false)),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    async fn do_get(&self, req: pb::GetPinRequest) -> Result<pb::GetPinResponse> {
        let key = validate::pin_key(req.key.as_ref())?;
        self.ctx.core.linearizable().await?;
        let pin = self
            .ctx
            .core
            .state
            .read()
            .state
            .pins
            .get(&key)
            .map(|p| pin_to(&key, p));
        Ok(pb::GetPinResponse {
            pin,
            header: Some(self.ctx.header(true)),
        })
    }

    fn do_list(&self, req: pb::ListPinsRequest) -> Result<pb::ListPinsResponse> {
        if !req.node.is_empty() {
            validate::dns1123_subdomain("node", &req.node)?;
        }
        let applied = self.ctx.core.state.read();
        let pins = &applied.state.pins;
        let in_set = |k: &crate::sm::PinKey| req.set.is_empty() || k.set == req.set;
        // Through the indexes: a node's pins, or a set's range of keys.
        let pins = if !req.node.is_empty() {
            pins.on_node(&req.node)
                .filter(|(k, _)| in_set(k))
                .map(|(k, p)| pin_to(k, p))
                .collect()
        } else if !req.set.is_empty() {
            pins.of_set(&req.set).map(|(k, p)| pin_to(k, p)).collect()
        } else {
            pins.iter().map(|(k, p)| pin_to(k, p)).collect()
        };
        Ok(pb::ListPinsResponse {
            pins,
            header: Some(self.ctx.header(false)),
        })
    }
}

#[tonic::async_trait]
impl PinService for PinApi {
    async fn assign(
        &self,
        request: Request<pb::AssignRequest>,
    ) -> Result<Response<pb::AssignResponse>, Status> {
        let checked = self
            .ctx
            .auth
            .check(&request, Action::WritePins(&request.get_ref().candidates));
        let result = match checked {
            Ok(caller) => self.do_assign(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Assign", result).map(Response::new)
    }

    async fn release(
        &self,
        request: Request<pb::ReleasePinRequest>,
    ) -> Result<Response<pb::ReleasePinResponse>, Status> {
        let node = self.node_of(request.get_ref().key.as_ref());
        self.ctx
            .serve(
                "ReleasePin",
                request,
                Some(Action::WritePins(&node)),
                |caller, req| async move { self.do_release(&caller, req).await },
            )
            .await
    }

    async fn get(
        &self,
        request: Request<pb::GetPinRequest>,
    ) -> Result<Response<pb::GetPinResponse>, Status> {
        self.ctx
            .serve(
                "GetPin",
                request,
                Some(Action::ReadPins),
                |_, req| async move { self.do_get(req).await },
            )
            .await
    }

    async fn list(
        &self,
        request: Request<pb::ListPinsRequest>,
    ) -> Result<Response<pb::ListPinsResponse>, Status> {
        self.ctx
            .serve(
                "ListPins",
                request,
                Some(Action::ReadPins),
                |_, req| async move { self.do_list(req) },
            )
            .await
    }

    async fn reclaim(
        &self,
        request: Request<pb::ReclaimRequest>,
    ) -> Result<Response<pb::ReclaimResponse>, Status> {
        let node = [request.get_ref().node.clone()];
        self.ctx
            .serve(
                "Reclaim",
                request,
                Some(Action::WritePins(&node)),
                |caller, req| async move { self.do_reclaim(&caller, req).await },
            )
            .await
    }
}
