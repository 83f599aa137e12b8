//! Noticing that an HTTP client went away before its answer.
//!
//! kube-scheduler gives an extender call `httpTimeout` (5 s by default) and
//! then closes the connection. A bind that is still queued for its node's
//! lock must then leave the queue, and a grant that raced the close must be
//! given back: nobody will bind the pod.
//!
//! hyper closes an HTTP/1 connection whose client sent EOF while its
//! request was being handled (`h1_half_close` is off by default) and drops
//! the handler's future. [`detect_departure`] turns that drop into a signal:
//! it puts a [`Departure`] into the request's extensions and raises it when
//! it is dropped before the handler answered. The work that must notice the
//! departure therefore runs in a task of its own (see
//! [`Departure::run_detached`]), which outlives the dropped handler.

use std::future::Future;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use tokio::sync::watch;

/// Tells a handler that its client closed the connection (it will not read
/// the answer).
#[derive(Clone, Debug)]
pub struct Departure(watch::Receiver<bool>);

impl Departure {
    /// A departure that never comes: for handlers called directly (tests)
    /// and requests served without [`detect_departure`].
    pub fn never() -> Self {
        let (tx, rx) = watch::channel(false);
        // The receiver keeps `false` once its sender is gone, and `wait`
        // then stays pending.
        drop(tx);
        Self(rx)
    }

    /// Whether the client has gone.
    pub fn is_gone(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves when the client has gone; pending forever while it stays.
    pub async fn wait(&self) {
        let mut gone = self.0.clone();
        if gone.wait_for(|g| *g).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Runs `work` in a task of its own and answers with its result. If the
    /// client goes away meanwhile the handler is dropped, but `work` runs
    /// on and sees this departure raised.
    pub async fn run_detached<T: Send + 'static>(
        work: impl Future<Output = T> + Send + 'static,
    ) -> T {
        match tokio::spawn(work).await {
            Ok(answer) => answer,
            Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
            Err(err) => panic!("a detached handler task was cancelled: {err}"),
        }
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Departure {
    type Rejection = std::convert::Infallible;

    /// The request's departure, or [`Departure::never`] where the route has
    /// no [`detect_departure`] layer.
    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<Departure>()
            .cloned()
            .unwrap_or_else(Departure::never))
    }
}

/// Raises the departure when dropped before [`Raiser::answered`].
struct Raiser(Option<watch::Sender<bool>>);

impl Raiser {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for Raiser {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(true);
        }
    }
}

/// Middleware (`axum::middleware::from_fn(detect_departure)`): gives each
/// request a [`Departure`], raised if the request is dropped unanswered.
pub async fn detect_departure(mut request: Request, next: Next) -> Response {
    let (tx, rx) = watch::channel(false);
    request.extensions_mut().insert(Departure(rx));
    let raiser = Raiser(Some(tx));
    let response = next.run(request).await;
    raiser.answered();
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use axum::Router;
    use axum::routing::post;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    #[tokio::test]
    async fn a_client_closing_the_connection_raises_the_departure_of_detached_work() {
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
        let router = Router::new()
            .route(
                "/bind",
                post(move |departure: Departure| {
                    let seen_tx = seen_tx.clone();
                    Departure::run_detached(async move {
                        let _ = seen_tx.send("started");
                        departure.wait().await;
                        let _ = seen_tx.send("client gone");
                    })
                }),
            )
            .layer(axum::middleware::from_fn(detect_departure));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(crate::serve(listener, router, std::future::pending()));

        let mut stream = TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            .await
            .unwrap();
        let within = Duration::from_secs(30);
        let started = tokio::time::timeout(within, seen.recv()).await;
        assert_eq!(
            started.expect("the handler starts within 30 s"),
            Some("started")
        );
        drop(stream);
        let gone = tokio::time::timeout(within, seen.recv()).await;
        assert_eq!(
            gone.expect("the departure is seen within 30 s"),
            Some("client gone")
        );
    }

    #[tokio::test]
    async fn an_answered_request_never_departs() {
        let departure = {
            let (tx, rx) = watch::channel(false);
            Raiser(Some(tx)).answered();
            Departure(rx)
        };
        assert!(!departure.is_gone());
        assert!(
            tokio::time::timeout(Duration::from_millis(50), departure.wait())
                .await
                .is_err()
        );
        assert!(!Departure::never().is_gone());
    }
}
