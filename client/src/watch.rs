//! A resuming watch: follows the event stream across disconnects and leader
//! changes from the last revision seen, so the caller sees every event once,
//! in order — and when its position was compacted away, tells the caller to
//! re-list and carries on from the present.

use std::time::Duration;

use tether_proto as pb;
use tether_proto::watch_service_client::WatchServiceClient;
use tonic::Streaming;

use crate::client::{Client, replica_unusable};
use crate::error::{Error, Result};

/// What a watch delivers next.
#[derive(Debug, Clone)]
pub enum WatchUpdate {
    /// Matching events, in revision order (never empty).
    Events(Vec<pb::Event>),
    /// The watch position was compacted away (the watcher was down too long):
    /// events were missed. Re-list the state you mirror (list responses carry
    /// `header.applied_index`), then keep reading: the watch continues from
    /// `resume_at`, and events at or below your list's applied index are ones
    /// the list already includes.
    Relist {
        /// Where the watch continues.
        resume_at: pb::Revision,
        /// Oldest revision still retained when the gap was found.
        oldest_retained: u64,
    },
}

/// A watch on a Tether cluster. Call [`Watcher::next`] in a loop.
///
/// ```no_run
/// # async fn demo(client: tether_client::Client) -> Result<(), tether_client::Error> {
/// use tether_client::WatchUpdate;
/// // React to nodes joining (e.g. pre-pull images there).
/// let mut watch = client.watch(None, vec!["NodeJoined".into()], "node/").await?;
/// loop {
///     match watch.next().await? {
///         WatchUpdate::Events(events) => {
///             for event in events {
///                 println!("{} joined at revision {:?}", event.node, event.revision);
///             }
///         }
///         WatchUpdate::Relist { .. } => {
///             let nodes = client.list_nodes(false).await?; // start over from the registry
///             println!("re-listed {} nodes", nodes.len());
///         }
///     }
/// }
/// # }
/// ```
pub struct Watcher {
    client: Client,
    next: pb::Revision,
    kinds: Vec<String>,
    prefix: String,
    stream: Option<Streaming<pb::WatchResponse>>,
}

impl Watcher {
    pub(crate) fn new(
        client: Client,
        next: pb::Revision,
        kinds: Vec<String>,
        prefix: String,
    ) -> Self {
        Self {
            client,
            next,
            kinds,
            prefix,
            stream: None,
        }
    }

    /// The revision the next event will have at least: resume from here.
    pub fn position(&self) -> pb::Revision {
        self.next
    }

    /// The next batch of matching events, or a request to re-list after a
    /// gap. Reconnects, to any replica, from the last revision seen when a
    /// stream breaks.
    pub async fn next(&mut self) -> Result<WatchUpdate> {
        match self.next_events().await {
            Ok(events) => Ok(WatchUpdate::Events(events)),
            Err(Error::Compacted {
                oldest_retained, ..
            }) => {
                let status = self.client.leader_status().await?;
                self.next = pb::Revision {
                    index: status.applied_index + 1,
                    sub: 0,
                };
                self.stream = None;
                Ok(WatchUpdate::Relist {
                    resume_at: self.next,
                    oldest_retained,
                })
            }
            Err(err) => Err(err),
        }
    }

    async fn next_events(&mut self) -> Result<Vec<pb::Event>> {
        let mut backoff = Duration::from_millis(20);
        loop {
            if self.stream.is_none() {
                let request = pb::WatchRequest {
                    start: Some(self.next),
                    kinds: self.kinds.clone(),
                    key_prefix: self.prefix.clone(),
                };
                let stream = self
                    .client
                    .with_leader(Duration::ZERO, |channel| {
                        let request = request.clone();
                        async move {
                            Ok(WatchServiceClient::new(channel)
                                .watch(request)
                                .await?
                                .into_inner())
                        }
                    })
                    .await?;
                self.stream = Some(stream);
            }
            let stream = self.stream.as_mut().expect("opened above");
            match stream.message().await {
                Ok(Some(response)) => {
                    if let Some(next) = response.next {
                        self.next = next;
                    }
                    if !response.events.is_empty() {
                        return Ok(response.events);
                    }
                }
                Ok(None) => self.stream = None,
                Err(status) => {
                    let slow = status.code() == tonic::Code::ResourceExhausted;
                    if !slow && !replica_unusable(&status) {
                        return Err(Error::from(status));
                    }
                    // Replica gone, shutting down, or we were too slow:
                    // resume from the last revision, on any replica.
                    self.stream = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        }
    }
}
