//! Keeps a [`crate::Client`] to one Tether cluster.
//!
//! Every replica names its cluster's id on each response
//! ([`tether_proto::CLUSTER_ID_METADATA`]). The first id a client sees is
//! its cluster's; from then on it names that id on every request
//! ([`tether_proto::EXPECT_CLUSTER_METADATA`]), and a replica of another
//! cluster refuses the request before doing anything. An answer that
//! names another id anyway (a replica of an older build that does not
//! check) is refused here. Both refusals become [`crate::Error::WrongCluster`]:
//! two clusters answer at the client's addresses (a StatefulSet split in
//! two, a Service selecting the wrong pods), and following the other one's
//! leader would mean fencing tokens from another sequence.

use std::sync::{Arc, Mutex};

use tonic::Status;
use tonic::codegen::{BoxFuture, Context, Poll, Service, http};

/// The cluster id one client (and all its clones) has seen; None until the
/// first answer that names one.
pub type SeenCluster = Arc<Mutex<Option<String>>>;

/// A connection to one replica that names the client's cluster on each
/// request and checks it on each answer.
#[derive(Clone)]
pub struct ClusterGuard<S> {
    inner: S,
    addr: Arc<str>,
    seen: SeenCluster,
}

impl<S> ClusterGuard<S> {
    /// Guards `inner`, the connection to `addr`, with the client's `seen`.
    pub fn new(inner: S, addr: &str, seen: SeenCluster) -> Self {
        Self {
            inner,
            addr: addr.into(),
            seen,
        }
    }
}

/// Checks the cluster id an answer names against the one seen (taking it
/// when none was seen yet); the refusal to hand back instead of the answer.
fn check_answer(seen: &SeenCluster, addr: &str, named: Option<&str>) -> Result<(), Status> {
    let Some(named) = named else {
        return Ok(());
    };
    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
    match seen.as_deref() {
        None => {
            *seen = Some(named.to_string());
            Ok(())
        }
        Some(ours) if ours == named => Ok(()),
        Some(ours) => {
            let mut refusal = Status::failed_precondition(format!(
                "{addr} answers for Tether cluster {named}, but this client has been using \
                 cluster {ours}: two clusters answer at its addresses; not following it"
            ));
            if let Ok(value) = named.parse() {
                refusal
                    .metadata_mut()
                    .insert(tether_proto::WRONG_CLUSTER_METADATA, value);
            }
            Err(refusal)
        }
    }
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for ClusterGuard<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let expected = self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(value) = expected.and_then(|id| id.parse().ok()) {
            request
                .headers_mut()
                .insert(tether_proto::EXPECT_CLUSTER_METADATA, value);
        }
        let call = self.inner.call(request);
        let (seen, addr) = (self.seen.clone(), self.addr.clone());
        Box::pin(async move {
            let response = call.await?;
            let named = response
                .headers()
                .get(tether_proto::CLUSTER_ID_METADATA)
                .and_then(|v| v.to_str().ok());
            match check_answer(&seen, &addr, named) {
                Ok(()) => Ok(response),
                Err(refusal) => Ok(refusal.into_http()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_cluster_seen_is_kept_and_another_refused() {
        let seen = SeenCluster::default();
        check_answer(&seen, "a:1", None).unwrap();
        assert_eq!(*seen.lock().unwrap(), None, "an older build names none");
        check_answer(&seen, "a:1", Some("c1")).unwrap();
        check_answer(&seen, "b:1", Some("c1")).unwrap();
        let refusal = check_answer(&seen, "x:1", Some("c2")).unwrap_err();
        assert!(
            refusal
                .message()
                .contains("x:1 answers for Tether cluster c2")
                && refusal.message().contains("using cluster c1"),
            "{}",
            refusal.message()
        );
        assert_eq!(
            crate::Error::from(refusal).to_string(),
            crate::Error::WrongCluster(
                "x:1 answers for Tether cluster c2, but this client has been using cluster \
                 c1: two clusters answer at its addresses; not following it"
                    .into()
            )
            .to_string()
        );
        assert_eq!(seen.lock().unwrap().as_deref(), Some("c1"));
    }
}
