//! The HTTP side of the comparators' extenders: kube-scheduler's `POST
//! .../filter` and `POST .../bind`, decoded and answered the same way for
//! each.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::post;
use tether_embed::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
};

/// An extender's two verbs.
pub trait Verbs: Send + Sync + 'static {
    /// The filter verb.
    fn filter(&self, args: ExtenderArgs) -> impl Future<Output = ExtenderFilterResult> + Send;
    /// The bind verb.
    fn bind(&self, args: ExtenderBindingArgs)
    -> impl Future<Output = ExtenderBindingResult> + Send;
}

/// `POST .../filter` and `POST .../bind` over `verbs`.
pub fn router<V: Verbs>(verbs: Arc<V>) -> Router {
    Router::new()
        .route("/{*verb}", post(verb::<V>))
        .with_state(verbs)
}

async fn verb<V: Verbs>(
    State(verbs): State<Arc<V>>,
    Path(path): Path<String>,
    body: Bytes,
) -> Response {
    if path.ends_with("bind") {
        let result = match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
            Ok(args) => verbs.bind(args).await,
            Err(e) => ExtenderBindingResult {
                error: format!("malformed ExtenderBindingArgs: {e}"),
            },
        };
        tether_http::json(StatusCode::OK, &result)
    } else {
        let result = match serde_json::from_slice::<ExtenderArgs>(&body) {
            Ok(args) => verbs.filter(args).await,
            Err(e) => ExtenderFilterResult {
                error: format!("malformed ExtenderArgs: {e}"),
                ..Default::default()
            },
        };
        tether_http::json(StatusCode::OK, &result)
    }
}
