//! Request rate limits per device and per client IP: token buckets, answered with 429 and
//! `Retry-After` before any work is done. The SDK treats 429 as transient and retries.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;

/// A sustained rate with a burst allowance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Requests per second, sustained.
    pub per_sec: f64,
    /// Requests allowed at once after a quiet period.
    pub burst: f64,
}

/// Buckets kept before idle (full) ones are dropped: bounds memory under many keys.
const MAX_BUCKETS: usize = 100_000;

/// One token bucket per key.
#[derive(Debug)]
pub struct Limiter<K> {
    limit: RateLimit,
    buckets: Mutex<HashMap<K, (f64, Instant)>>,
}

impl<K: Hash + Eq> Limiter<K> {
    /// A limiter enforcing `limit` per key.
    pub fn new(limit: RateLimit) -> Self {
        Limiter { limit, buckets: Mutex::new(HashMap::new()) }
    }

    /// Takes a token for `key` at `now`, or says how long until one is there.
    pub fn check(&self, key: K, now: Instant) -> Result<(), Duration> {
        let RateLimit { per_sec, burst } = self.limit;
        let mut buckets = self.buckets.lock().expect("limiter lock");
        if buckets.len() >= MAX_BUCKETS {
            buckets.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * per_sec < burst
            });
        }
        let (tokens, at) = buckets.entry(key).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * per_sec).min(burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / per_sec))
        }
    }
}

/// Middleware: refuses a client IP over its rate (when a per-IP limit is configured).
pub async fn limit_ip(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let ip: IpAddr = peer.ip();
    if let Some(limiter) = state.ip_limiter()
        && let Err(wait) = limiter.check(ip, Instant::now())
    {
        return ApiError::rate_limited(wait, "this address").into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let limiter = Limiter::new(RateLimit { per_sec: 2.0, burst: 3.0 });
        let t0 = Instant::now();
        for _ in 0..3 {
            limiter.check("a", t0).unwrap();
        }
        let wait = limiter.check("a", t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        // Another key has its own bucket.
        limiter.check("b", t0).unwrap();
        // Half a second later one token is back, and only one.
        let t1 = t0 + Duration::from_millis(500);
        limiter.check("a", t1).unwrap();
        assert!(limiter.check("a", t1).is_err());
    }
}
