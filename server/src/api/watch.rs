//! `WatchService`: the event stream and history, read from the events column
//! family. A watcher reads at its own pace from RocksDB and is only woken by
//! applies, so a slow watcher never holds up the state machine; order and
//! gap-freedom follow from reading revisions in key order.

use crate::auth::{Action, Caller};
use std::sync::Arc;
use std::time::Duration;

use tether_proto as pb;
use tether_proto::watch_service_server::WatchService;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::convert::{event_to, revision_to};
use super::{Ctx, Sent, send_or_cut};
use crate::error::{ApiError, Result};
use crate::sm::Revision;

/// Events read from RocksDB per batch.
const BATCH: usize = 256;
/// A watcher that does not take a batch within this long is ended, with the
/// revision to resume from.
const SLOW_WATCHER_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest key prefix accepted.
const MAX_PREFIX: usize = 512;
/// Default and largest history answer.
const HISTORY_LIMIT: usize = 1000;

/// The `WatchService` implementation.
pub struct WatchApi {
    ctx: Arc<Ctx>,
}

impl WatchApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }
}

type WatchItem = std::result::Result<pb::WatchResponse, Status>;

fn compacted(start: Revision, first: u64) -> Status {
    let mut status = Status::out_of_range(format!(
        "revision {}.{} is compacted: events before log index {first} have been deleted; re-list \
         the state, then watch from revision {first}",
        start.index, start.sub
    ));
    if let Ok(value) = first.to_string().parse() {
        status
            .metadata_mut()
            .insert(pb::COMPACT_REVISION_METADATA, value);
    }
    status
}

/// Whom a watch counts against for `--max-watchers-per-client`: the
/// authenticated identity, else the caller's IP address.
fn watcher_owner<T>(caller: &Caller, request: &tonic::Request<T>) -> String {
    if caller.authenticated() {
        return caller.identity.clone();
    }
    request
        .extensions()
        .get::<tether_tls::PeerInfo>()
        .and_then(|peer| peer.remote_addr)
        .map_or_else(|| "unknown".to_string(), |addr| addr.ip().to_string())
}

/// One open watch of one owner; gives its place back when dropped.
struct WatcherSlot {
    ctx: Arc<Ctx>,
    owner: String,
}

impl WatcherSlot {
    fn take(ctx: &Arc<Ctx>, owner: String) -> Result<WatcherSlot, ApiError> {
        let limit = ctx.core.config.max_watchers_per_client;
        let mut open = ctx.watchers.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(owner.clone()).or_insert(0);
        if *count >= limit {
            return Err(ApiError::TooLarge(format!(
                "{owner} already has {count} watches open on this replica, the limit (tetherd \
                 --max-watchers-per-client {limit}); close one, or share one watch with a wider \
                 filter"
            )));
        }
        *count += 1;
        Ok(WatcherSlot {
            ctx: ctx.clone(),
            owner,
        })
    }
}

impl Drop for WatcherSlot {
    fn drop(&mut self) {
        let mut open = self.ctx.watchers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.owner) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.owner);
            }
        }
    }
}

/// Whether a wire event passes the watch filters.
fn wanted(event: &pb::Event, kinds: &[String], prefix: &str) -> bool {
    (kinds.is_empty() || kinds.iter().any(|k| k == &event.kind)) && event.key.starts_with(prefix)
}

/// Streams events from `next` on until the caller leaves, the replica shuts
/// down, the watcher is too slow, or its position is compacted away.
async fn follow(
    ctx: Arc<Ctx>,
    mut next: Revision,
    kinds: Vec<String>,
    prefix: String,
    mut wake: broadcast::Receiver<crate::sm::Event>,
    mut installs: tokio::sync::watch::Receiver<u64>,
    tx: mpsc::Sender<WatchItem>,
) {
    loop {
        let batch = match ctx.core.read_events(next, BATCH) {
            Ok(batch) => batch,
            Err(err) => {
                let _ = tx.send(Err(err.into())).await;
                return;
            }
        };
        // Checked after the read: the compaction point is raised before
        // events are deleted, so a read that met a deletion sees it here.
        let first = ctx.core.state.events_first();
        if next.index < first {
            let _ = tx.send(Err(compacted(next, first))).await;
            return;
        }
        if let Some(last) = batch.last() {
            next = Revision {
                index: last.revision.index,
                sub: last.revision.sub + 1,
            };
            let events: Vec<pb::Event> = batch
                .iter()
                .map(event_to)
                .filter(|e| wanted(e, &kinds, &prefix))
                .collect();
            if events.is_empty() {
                continue;
            }
            let response = pb::WatchResponse {
                events,
                next: Some(revision_to(next)),
                header: Some(ctx.header(false)),
            };
            let too_slow = || {
                ApiError::TooLarge(format!(
                    "watcher too slow: it did not read for {SLOW_WATCHER_TIMEOUT:?}; resume \
                     from revision {}.{}",
                    next.index, next.sub
                ))
            };
            match send_or_cut(&tx, response, SLOW_WATCHER_TIMEOUT, too_slow).await {
                Sent::Sent => continue,
                Sent::Left | Sent::Cut => return,
            }
        }
        // Caught up: sleep until something is applied, or a snapshot is
        // installed (no events; it may have compacted this position away).
        tokio::select! {
            // Any message, or "lagged", means new events exist.
            _ = wake.recv() => {}
            _ = installs.changed() => {}
            _ = ctx.core.shutting_down() => {
                let err = ApiError::Unavailable(format!(
                    "this replica is shutting down; watch again from revision {}.{} on another replica",
                    next.index, next.sub
                ));
                let _ = tx.send(Err(err.into())).await;
                return;
            }
            _ = tx.closed() => return,
        }
    }
}

impl WatchApi {
    fn do_watch(
        &self,
        owner: String,
        req: pb::WatchRequest,
    ) -> Result<ReceiverStream<WatchItem>, Status> {
        if req.key_prefix.len() > MAX_PREFIX {
            return Err(ApiError::InvalidArgument(format!(
                "key prefix is longer than {MAX_PREFIX} bytes"
            ))
            .into());
        }
        let ctx = &self.ctx;
        let slot = WatcherSlot::take(ctx, owner)?;
        // Subscribe before reading so an apply (or a snapshot install)
        // between the read and the wait still wakes the watcher.
        let wake = ctx.core.state.subscribe();
        let installs = ctx.core.state.snapshot_installs();
        let start = match req.start {
            Some(r) if r.index > 0 => Revision {
                index: r.index,
                sub: r.sub,
            },
            _ => {
                let applied = ctx.core.state.read().last_applied.map_or(0, |l| l.index);
                Revision {
                    index: applied + 1,
                    sub: 0,
                }
            }
        };
        // Refused once this replica is shutting down.
        ctx.core.db()?;
        let first = ctx.core.state.events_first();
        if start.index < first {
            return Err(compacted(start, first));
        }
        // 16 responses buffered, and a slot for a too-slow error
        // (send_or_cut).
        let (tx, rx) = mpsc::channel(17);
        tokio::spawn(async move {
            follow(
                slot.ctx.clone(),
                start,
                req.kinds,
                req.key_prefix,
                wake,
                installs,
                tx,
            )
            .await;
            drop(slot);
        });
        Ok(ReceiverStream::new(rx))
    }

    fn do_history(&self, req: pb::HistoryRequest) -> Result<pb::HistoryResponse> {
        if req.key.is_empty() || req.key.len() > MAX_PREFIX {
            return Err(ApiError::InvalidArgument(
                "history needs a key such as lock/gpu-bind/node-7, pin/slurm/set-a/3 or node/node-7".into(),
            ));
        }
        let limit = match req.limit as usize {
            0 => HISTORY_LIMIT,
            n => n.min(HISTORY_LIMIT),
        };
        // Refused once this replica is shutting down.
        self.ctx.core.db()?;
        let first = self.ctx.core.state.events_first();
        let from = req
            .from
            .map_or(Revision { index: 0, sub: 0 }, |r| Revision {
                index: r.index,
                sub: r.sub,
            });
        let to = req.to.map(|r| Revision {
            index: r.index,
            sub: r.sub,
        });
        let until = if req.until_ms == 0 {
            u64::MAX
        } else {
            req.until_ms
        };
        let mut events = Vec::new();
        let mut cursor = from;
        'scan: loop {
            let batch = self.ctx.core.read_events(cursor, BATCH)?;
            let Some(last) = batch.last() else { break };
            cursor = Revision {
                index: last.revision.index,
                sub: last.revision.sub + 1,
            };
            for event in &batch {
                // Committed time only grows with the revision: past `until`,
                // nothing later can match.
                if to.is_some_and(|to| event.revision > to) || event.time_ms > until {
                    break 'scan;
                }
                if event.time_ms < req.since_ms {
                    continue;
                }
                let wire = event_to(event);
                if wire.key == req.key {
                    events.push(wire);
                    if events.len() >= limit {
                        break 'scan;
                    }
                }
            }
        }
        Ok(pb::HistoryResponse {
            events,
            oldest_retained: Some(pb::Revision {
                index: first,
                sub: 0,
            }),
            header: Some(self.ctx.header(false)),
        })
    }
}

#[tonic::async_trait]
impl WatchService for WatchApi {
    type WatchStream = ReceiverStream<WatchItem>;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let result = match self.ctx.auth.check(&request, Action::Watch) {
            Ok(caller) => {
                let who = watcher_owner(&caller, &request);
                self.do_watch(who, request.into_inner())
            }
            Err(err) => Err(Status::from(err)),
        };
        self.ctx
            .core
            .metrics
            .request("Watch", if result.is_ok() { "ok" } else { "refused" });
        result.map(Response::new)
    }

    async fn history(
        &self,
        request: Request<pb::HistoryRequest>,
    ) -> Result<Response<pb::HistoryResponse>, Status> {
        self.ctx
            .serve(
                "History",
                request,
                Some(Action::Watch),
                |_, req| async move { self.do_history(req) },
            )
            .await
    }
}
