//! The one error type of the HTTP edge, and the middleware that renders it.
//!
//! Handlers return [`ApiError`]; it carries an [`ErrorBody`] in the response's extensions, and
//! [`render_errors`] serializes it as CBOR on the fleet API and JSON on the admin API.
//! Responses axum makes itself (unknown route, wrong method) get the same body shape.
//! Internal causes are logged, never returned.

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use starling_core::codec;
use starling_core::fedavg::UpdateError;
use starling_core::round::UploadRejection;
use starling_core::round::secure::SecAggRejection;
use starling_core::wire::{CBOR_MEDIA_TYPE, ErrorBody, ErrorCode};

use crate::driver::DriverError;
use crate::store::StoreError;

/// An error answer: status, code and a message that names the problem.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
    retry_after: Option<std::time::Duration>,
}

impl ApiError {
    /// An error with an explicit status and code.
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError { status, body: ErrorBody { code, message: message.into() }, retry_after: None }
    }

    /// 429 with `Retry-After` (whole seconds, rounded up).
    pub fn rate_limited(wait: std::time::Duration, who: &str) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::RateLimited,
            format!("too many requests from {who}; retry in {:.1} s", wait.as_secs_f64()),
        )
        .retry_after(wait)
    }

    /// The same error with a `Retry-After` header (whole seconds, rounded up).
    pub fn retry_after(mut self, wait: std::time::Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// 400 malformed body.
    pub fn malformed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorCode::MalformedBody, message)
    }

    /// 422: a field of a well-formed body fails validation.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidField, message)
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorCode::NotFound, message)
    }

    /// 503; the request may be retried.
    pub fn unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unavailable,
            "the store is unavailable; retry later",
        )
    }

    /// 503 from a replica for what only the leading coordinator serves (the admin API, the
    /// aggregator tier): the client retries, through an address that reaches the leader.
    pub fn not_leader() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unavailable,
            "this coordinator is a replica: it serves devices' check-ins, downloads and uploads, and the leading coordinator serves the rest; retry (it takes over if the leader stops)",
        )
        .retry_after(std::time::Duration::from_secs(5))
    }

    /// The HTTP status, code, message and `Retry-After` (whole seconds) this error answers
    /// with: what a leader relays back to the replica that asked.
    pub fn parts(&self) -> (StatusCode, ErrorCode, &str, Option<u64>) {
        let retry = self.retry_after.map(|wait| wait.as_secs_f64().ceil().max(1.0) as u64);
        (self.status, self.body.code, &self.body.message, retry)
    }

    /// 500 with the cause logged, not returned.
    pub fn internal(cause: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "internal error; see the coordinator's log",
        )
    }

    /// The status.
    pub fn status_code(&self) -> StatusCode {
        self.status
    }

    /// The error code.
    pub fn code(&self) -> ErrorCode {
        self.body.code
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = self.status.into_response();
        if let Some(wait) = self.retry_after {
            let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res.extensions_mut().insert(self.body);
        res
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(cause) => {
                tracing::warn!(error = %cause, "store unavailable");
                ApiError::unavailable()
            }
            StoreError::Conflict => {
                ApiError::new(StatusCode::CONFLICT, ErrorCode::Conflict, "already exists")
            }
            StoreError::InvalidToken => {
                ApiError::unauthorized("enrollment token is invalid, expired or used up")
            }
            // Moments after a commit, before its model's bytes land (see `ModelBytes::Later`).
            e @ StoreError::ModelPending { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::Unavailable,
                e.to_string(),
            )
            .retry_after(std::time::Duration::from_secs(1)),
            // Gone for good: the run writes its models every few versions (a device asking for
            // it gives its task up; an evaluator skips it; an operator exports one written).
            e @ StoreError::ModelNotKept { .. } => {
                ApiError::new(StatusCode::GONE, ErrorCode::ModelNotKept, e.to_string())
            }
            StoreError::Fenced { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::Unavailable,
                "another coordinator leads now; retry against it",
            ),
            e => ApiError::internal(&e),
        }
    }
}

impl From<DriverError> for ApiError {
    fn from(e: DriverError) -> Self {
        use ErrorCode as C;
        use StatusCode as S;
        match e {
            DriverError::RunNotRunning(run) => {
                ApiError::new(S::CONFLICT, C::RoundClosed, format!("run {run} is not running"))
            }
            DriverError::Upload(r) => match r {
                UploadRejection::UnknownRound => {
                    ApiError::new(S::NOT_FOUND, C::NotFound, "no such round")
                }
                UploadRejection::RoundClosed => ApiError::new(
                    S::CONFLICT,
                    C::RoundClosed,
                    "the round no longer accepts uploads",
                ),
                UploadRejection::NotSelected => ApiError::new(
                    S::FORBIDDEN,
                    C::NotSelected,
                    "device was not selected for this round",
                ),
                UploadRejection::Duplicate => ApiError::new(
                    S::CONFLICT,
                    C::DuplicateUpload,
                    "device already uploaded in this round",
                ),
                UploadRejection::StaleModel { expected } => ApiError::new(
                    S::CONFLICT,
                    C::StaleModel,
                    format!(
                        "update was computed on another model version; the round trains version {expected}"
                    ),
                ),
                UploadRejection::Unavailable => ApiError::unavailable(),
                UploadRejection::SecureRun => ApiError::new(
                    S::CONFLICT,
                    C::Conflict,
                    "the run aggregates securely: take part through /v1/runs/{run}/rounds/{round}/secagg, never upload a plain delta",
                ),
                UploadRejection::UseAggregator { aggregator } => ApiError::new(
                    S::CONFLICT,
                    C::Conflict,
                    format!(
                        "this device uploads to aggregator {aggregator} (its task's upload_to), not to the coordinator"
                    ),
                ),
                UploadRejection::NotAssigned => ApiError::invalid(
                    "the partial names a device not assigned to its aggregators, one already reported, or an aggregator without devices in the round",
                ),
            },
            DriverError::SecAgg(r) => match r {
                SecAggRejection::Round(r) => DriverError::Upload(r).into(),
                SecAggRejection::WrongStage(why) => ApiError::new(S::CONFLICT, C::Conflict, why),
                SecAggRejection::Invalid(why) => ApiError::invalid(why),
            },
            DriverError::Unavailable => ApiError::unavailable(),
            DriverError::PopulationBusy(why) => ApiError::new(S::CONFLICT, C::Conflict, why),
            DriverError::TierOff => ApiError::not_found(
                "this coordinator has no aggregator tier (start it with --aggregator-secret)",
            ),
            DriverError::ShuttingDown => ApiError::new(
                S::SERVICE_UNAVAILABLE,
                C::Unavailable,
                "coordinator is shutting down; retry later",
            ),
            DriverError::Refused { status, code, message, retry_after_secs } => {
                let status = S::from_u16(status).unwrap_or(S::INTERNAL_SERVER_ERROR);
                let refused = ApiError::new(status, code, message);
                match retry_after_secs {
                    Some(secs) => refused.retry_after(std::time::Duration::from_secs(secs)),
                    None => refused,
                }
            }
            DriverError::NotLeader => ApiError::not_leader(),
        }
    }
}

impl From<UpdateError> for ApiError {
    fn from(e: UpdateError) -> Self {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string())
    }
}

/// How an error body is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorFormat {
    /// `application/cbor` (fleet API).
    Cbor,
    /// `application/json` (admin API).
    Json,
}

/// Writes the [`ErrorBody`] of any error response, synthesizing one when axum made the response.
pub async fn render_errors(format: ErrorFormat, req: Request, next: Next) -> Response {
    render(format, next.run(req).await)
}

/// Writes an error response's [`ErrorBody`] in `format` (one axum made gets one synthesized);
/// any other response passes untouched.
pub fn render(format: ErrorFormat, res: Response) -> Response {
    let status = res.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let (mut parts, _body) = res.into_parts();
    let body = parts.extensions.remove::<ErrorBody>().unwrap_or_else(|| ErrorBody {
        code: match status {
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => ErrorCode::NotFound,
            StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::BodyTooLarge,
            StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
            s if s.is_server_error() => ErrorCode::Internal,
            _ => ErrorCode::MalformedBody,
        },
        message: status.canonical_reason().unwrap_or("error").to_lowercase(),
    });
    let (bytes, media) = match format {
        ErrorFormat::Cbor => (codec::to_vec(&body).expect("error body encodes"), CBOR_MEDIA_TYPE),
        ErrorFormat::Json => {
            (serde_json::to_vec(&body).expect("error body encodes"), "application/json")
        }
    };
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media));
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model committed by its hash whose bytes are still on their way is a 503 the
    /// client retries after a second, not a missing model or an internal error.
    #[test]
    fn a_model_whose_bytes_are_being_written_is_retried_later() {
        let e = ApiError::from(StoreError::ModelPending { run_id: 3, version: 7 });
        assert_eq!(
            (e.status_code(), e.code()),
            (StatusCode::SERVICE_UNAVAILABLE, ErrorCode::Unavailable)
        );
        let res = e.into_response();
        assert_eq!(res.headers().get(header::RETRY_AFTER).map(|v| v.to_str().unwrap()), Some("1"));
        let body = res.extensions().get::<ErrorBody>().expect("an error body");
        assert!(body.message.contains("model version 7 of run 3"), "{}", body.message);
    }

    /// A model a run's checkpoint interval gave up is gone for good: a 410 with its
    /// own code (clients skip it rather than fail) that says why, with nothing to retry.
    #[test]
    fn a_model_not_kept_is_gone_and_says_why() {
        let e = ApiError::from(StoreError::ModelNotKept { run_id: 3, version: 7 });
        assert_eq!((e.status_code(), e.code()), (StatusCode::GONE, ErrorCode::ModelNotKept));
        let res = e.into_response();
        assert!(res.headers().get(header::RETRY_AFTER).is_none());
        let body = res.extensions().get::<ErrorBody>().expect("an error body");
        assert!(body.message.contains("checkpoint_interval"), "{}", body.message);
    }
}
