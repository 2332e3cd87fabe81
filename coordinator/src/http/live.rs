//! Routes for watching the coordinator: Prometheus `/metrics`, the live event stream and the
//! population history behind the dashboard, and the dashboard's files themselves.
//!
//! All of them except the dashboard's static files need the operator credential; the files
//! hold no data, and the dashboard asks for the credential before it fetches any.

use std::convert::Infallible;
use std::path::Path;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect};
use axum::routing::get;
use futures_util::Stream;
use tokio::sync::broadcast::error::RecvError;
use tower_http::services::ServeDir;

use super::admin::AppJson;
use super::error::ApiError;
use super::{AppState, Operator};
use crate::observe::PopulationSample;
use starling_core::wire::ErrorBody;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The observability routes, each with its OpenAPI operation.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(metrics))
        .routes(routes!(events))
        .routes(routes!(population))
}

/// The dashboard's files (not part of the API), from `dashboard_dir` when given.
pub fn dashboard(dashboard_dir: Option<&Path>) -> Router<AppState> {
    let router =
        Router::new().route("/dashboard", get(|| async { Redirect::permanent("/dashboard/") }));
    match dashboard_dir {
        Some(dir) => router
            .nest_service("/dashboard/", ServeDir::new(dir).append_index_html_on_directories(true)),
        None => router
            .route("/dashboard/", get(no_dashboard))
            .route("/dashboard/{*path}", get(no_dashboard)),
    }
}

async fn no_dashboard() -> ApiError {
    ApiError::not_found(
        "this coordinator serves no dashboard: build web-dashboard/ (npm run build) and start \
         it with --dashboard-dir web-dashboard/dist",
    )
}

/// Prometheus metrics, OpenMetrics text format.
#[utoipa::path(get, path = "/metrics", tag = "observability", security(("operator" = [])),
    responses((status = 200, description = "OpenMetrics text", content_type = "application/openmetrics-text", body = String), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody)))]
async fn metrics(State(state): State<AppState>, _op: Operator) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        state.observer().render_metrics(),
    )
}

/// Server-sent events: one `update` event (JSON) per [`crate::observe::LiveEvent`]; a `reload`
/// event when this subscriber fell behind and should refetch everything.
#[utoipa::path(get, path = "/v1/admin/events", tag = "observability", security(("operator" = [])),
    responses((status = 200, description = "server-sent events: `update` (JSON) per change, `reload` after falling behind", content_type = "text/event-stream", body = String), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody)))]
async fn events(
    State(state): State<AppState>,
    _op: Operator,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let rx = state.observer().subscribe();
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let event = match rx.recv().await {
            Ok(ev) => match Event::default().event("update").json_data(&ev) {
                Ok(event) => event,
                Err(_) => Event::default().event("reload").data("encoding failed"),
            },
            Err(RecvError::Lagged(_)) => Event::default().event("reload").data("fell behind"),
            Err(RecvError::Closed) => return None,
        };
        Some((Ok(event), rx))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Population samples of the last hour, oldest first.
#[utoipa::path(get, path = "/v1/admin/population", tag = "observability", security(("operator" = [])),
    responses((status = 200, description = "population samples of the last hour, oldest first", body = Vec<PopulationSample>), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody)))]
async fn population(
    State(state): State<AppState>,
    _op: Operator,
) -> AppJson<Vec<PopulationSample>> {
    AppJson(state.observer().population_history())
}
