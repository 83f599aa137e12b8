//! A resuming watch: follows the event stream across disconnects and leader
//! changes from the last revision seen, so the caller sees every event once,
//! in order.

use std::time::Duration;

use tether_proto as pb;
use tether_proto::watch_service_client::WatchServiceClient;
use tonic::Streaming;

use crate::client::{Client, replica_unusable};
use crate::error::{Error, Result};

/// A watch on a Tether cluster. Call [`Watcher::next`] in a loop.
///
/// ```no_run
/// # async fn demo(client: tether_client::Client) -> Result<(), tether_client::Error> {
/// // React to nodes joining (e.g. pre-pull images there).
/// let mut watch = client.watch(None, vec!["NodeJoined".into()], "node/").await?;
/// loop {
///     for event in watch.next().await? {
///         println!("{} joined at revision {:?}", event.node, event.revision);
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

    /// The next batch of matching events (never empty). Reconnects, to any
    /// replica, from the last revision seen when a stream breaks. Fails with
    /// [`Error::Compacted`] if the position was compacted away meanwhile:
    /// re-list, then start a new watch.
    pub async fn next(&mut self) -> Result<Vec<pb::Event>> {
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
