//! How a node talks to the rest of the tier: CBOR requests that carry the cluster secret (to
//! the coordinator, or to its group's leader), and the partial report to the coordinator, with
//! retries. Both the service and the group use it; it uses neither.

use std::time::Duration;

use axum::http::{StatusCode, header};
use starling_core::backoff::Backoff;
use starling_core::codec;
use starling_core::tier::PartialReport;
use starling_core::wire::{CBOR_MEDIA_TYPE, ErrorBody, path};
use starling_core::{RoundIdx, RunId};

/// A node's link to its coordinator and group: the HTTP client (https-only under TLS), where
/// the coordinator is, and the cluster secret.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    /// The client (its TLS settings are the node's).
    pub(crate) http: reqwest::Client,
    /// The coordinator's base URL.
    pub(crate) coordinator_url: String,
    /// The secret shared with the coordinator and the group.
    pub(crate) secret: String,
}

impl Link {
    /// A CBOR request carrying the cluster secret.
    pub(crate) fn cbor_request(
        &self,
        method: reqwest::Method,
        url: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .request(method, url)
            .bearer_auth(&self.secret)
            .header(header::CONTENT_TYPE, CBOR_MEDIA_TYPE)
    }

    /// The coordinator's URL for `path`.
    pub(crate) fn coordinator(&self, path: &str) -> String {
        format!("{}{path}", self.coordinator_url.trim_end_matches('/'))
    }
}

/// How the coordinator answered a partial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Durable there.
    Accepted,
    /// Refused for good (closed round, duplicate, invalid): retrying will not help.
    Refused,
    /// Not delivered after every retry.
    GaveUp,
}

/// Reports one partial to the coordinator, retrying transient failures.
pub(crate) async fn send_partial(
    link: &Link,
    (run_id, round_idx): (RunId, RoundIdx),
    report: PartialReport,
) -> Sent {
    let n = report.devices.len();
    let aggregators = report.aggregators.len();
    let body = match tokio::task::spawn_blocking(move || codec::to_vec(&report)).await {
        Ok(Ok(body)) => body,
        _ => return Sent::GaveUp,
    };
    let url = link.coordinator(&path::partial(run_id, round_idx));
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    for attempt in 1..=8 {
        let res = link.cbor_request(reqwest::Method::POST, &url).body(body.clone()).send().await;
        match res {
            Ok(r) if r.status().is_success() => {
                tracing::info!(run = %run_id, round = %round_idx, devices = n, aggregators, "partial reported");
                return Sent::Accepted;
            }
            Ok(r)
                if r.status() == StatusCode::CONFLICT
                    || r.status() == StatusCode::UNPROCESSABLE_ENTITY =>
            {
                // A duplicate means an earlier attempt got through.
                let why = error_text(r).await;
                tracing::warn!(run = %run_id, round = %round_idx, %why, "partial refused");
                return Sent::Refused;
            }
            Ok(r) => {
                tracing::warn!(run = %run_id, round = %round_idx, status = %r.status(), attempt, "reporting the partial failed; retrying")
            }
            Err(e) => {
                tracing::warn!(run = %run_id, round = %round_idx, error = %e, attempt, "reporting the partial failed; retrying")
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
    tracing::error!(run = %run_id, round = %round_idx, "gave up reporting the partial; its devices drop out");
    Sent::GaveUp
}

/// An error answer's status and message, for logs.
pub(crate) async fn error_text(res: reqwest::Response) -> String {
    let status = res.status();
    let why = res.bytes().await.ok().and_then(|b| codec::decode::<ErrorBody>(&b).ok());
    format!("{status}: {}", why.map_or_else(String::new, |w| w.message))
}
