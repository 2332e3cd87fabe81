//! The load generator's devices: enrolled in bulk, played by M connections that each carry one
//! device's visit at a time, visits arriving as fast as the connections go or at a set rate
//! with exponential gaps (a Poisson process: devices that come when they come). The
//! connections speak HTTP through [`LeanConnection`], not the SDK's client: see there why.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::Connection as _;
use starling_core::compression::Compression;
use starling_core::rng::SplitMix64;
use starling_core::wire::{CBOR_MEDIA_TYPE, CheckInRequest, CheckInResponse, TICKET_HEADER, path};
use starling_core::{ModelVersion, RoundIdx, RunId, codec};
use tokio::sync::Mutex;

use crate::lean_http::{Body, LeanConnection};
use crate::measure::{Latencies, ms_since};

/// The credential of bulk-enrolled device `i`.
fn credential(i: usize) -> String {
    format!("bench-{i}")
}

/// Enrolls devices `0..n` by writing their rows straight into the coordinator's store (the
/// credential's SHA-256, as enrollment stores it; no population restriction, no identity key):
/// a million devices in seconds, where a million enrollment requests would take the bench's
/// whole budget and measure enrollment instead.
pub async fn enroll_in_bulk(database_url: &str, n: usize) -> anyhow::Result<()> {
    let mut conn = sqlx::PgConnection::connect(database_url).await?;
    sqlx::query(
        "INSERT INTO devices (credential_hash, enrolled_at_ms, revoked)
         SELECT encode(sha256(convert_to('bench-' || i, 'UTF8')), 'hex'), 0, FALSE
         FROM generate_series(0, $1 - 1) AS i",
    )
    .bind(n as i64)
    .execute(&mut conn)
    .await
    .context("enrolling devices in bulk")?;
    Ok(())
}

/// What a visit does.
pub enum Visit {
    /// Check in, expect a task for `model_version`, download the model, upload the body of
    /// the device's variant (device `i` sends `bodies[i % bodies.len()]`) where the task says:
    /// to the coordinator, or to the aggregator it names. A model download shorter than
    /// `model_bytes` (the values' size in the download's encoding) is an error.
    Train {
        run: RunId,
        round: i64,
        model_version: ModelVersion,
        model_bytes: u64,
        bodies: Vec<bytes::Bytes>,
    },
    /// Check in as a random one of `devices` and take whatever answer comes.
    CheckIn { devices: usize },
}

/// What a batch of visits returned.
#[derive(Default)]
pub struct Played {
    pub latencies: Latencies,
    /// Check-ins answered with a task.
    pub tasks: usize,
    /// Uploads acknowledged.
    pub acknowledged: usize,
    /// Visits that ran, and over how long (first start to last end).
    pub visits: usize,
    pub elapsed: Duration,
}

/// M connections to the coordinator (or its replicas), each carrying one visit at a time, so
/// the coordinator sees exactly M connections however many devices they play. They stay open
/// from one round to the next, as a fleet's would.
pub struct Connections {
    connections: Vec<Arc<Mutex<Connection>>>,
    model_download: Compression,
    /// A check-in's body, the same for every device.
    check_in: Arc<Vec<u8>>,
}

/// One of the M: its socket to a coordinator, and one to each aggregator a task has named.
struct Connection {
    coordinator: LeanConnection,
    aggregators: HashMap<String, LeanConnection>,
}

impl Connections {
    /// M connections spread over `urls` in turn (one coordinator, or its replicas).
    pub fn open(urls: &[String], m: usize, model_download: Compression) -> anyhow::Result<Self> {
        let connections = (0..m)
            .map(|k| {
                let coordinator = LeanConnection::new(&urls[k % urls.len()])?;
                Ok(Arc::new(Mutex::new(Connection { coordinator, aggregators: HashMap::new() })))
            })
            .collect::<anyhow::Result<_>>()?;
        let request =
            CheckInRequest { population: "default".to_owned(), attributes: Default::default() };
        let check_in = Arc::new(codec::to_vec(&request)?);
        Ok(Connections { connections, model_download, check_in })
    }

    /// Plays `visits` visits, the k-th as device `k` (a round's cohort: every enrolled device
    /// once), starting when `rate` says (None: as soon as a connection is free).
    pub async fn play(
        &self,
        visit: Visit,
        visits: usize,
        rate: Option<f64>,
        seed: u64,
    ) -> anyhow::Result<Played> {
        let visit = Arc::new(visit);
        let next = Arc::new(AtomicUsize::new(0));
        let arrivals = Arc::new(rate.map(|rate| arrivals(visits, rate, seed)));
        let started = Instant::now();
        let workers: Vec<_> = self
            .connections
            .iter()
            .map(|connection| {
                let (connection, visit, next, arrivals, check_in) = (
                    connection.clone(),
                    visit.clone(),
                    next.clone(),
                    arrivals.clone(),
                    self.check_in.clone(),
                );
                let model_download = self.model_download;
                tokio::spawn(async move {
                    let mut connection = connection.lock().await;
                    let mut played = Played::default();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= visits {
                            return Ok::<_, anyhow::Error>(played);
                        }
                        if let Some(at) = arrivals.as_ref().as_ref().map(|a| a[k]) {
                            tokio::time::sleep_until((started + at).into()).await;
                        }
                        let device = match &*visit {
                            Visit::Train { .. } => k,
                            Visit::CheckIn { devices } => {
                                (SplitMix64(seed ^ k as u64).next_u64() % *devices as u64) as usize
                            }
                        };
                        let as_device = AsDevice {
                            authorization: format!("Bearer {}", credential(device)),
                            index: device,
                            check_in: &check_in,
                            model_download,
                        };
                        as_device
                            .visit(&mut connection, &visit, &mut played)
                            .await
                            .with_context(|| format!("device {device}"))?;
                        played.visits += 1;
                    }
                })
            })
            .collect();
        let mut played = Played::default();
        for worker in workers {
            let p = worker.await??;
            played.latencies.merge(p.latencies);
            played.tasks += p.tasks;
            played.acknowledged += p.acknowledged;
            played.visits += p.visits;
        }
        played.elapsed = started.elapsed();
        Ok(played)
    }
}

/// A device being played: who it is and what it sends.
struct AsDevice<'a> {
    authorization: String,
    index: usize,
    check_in: &'a [u8],
    model_download: Compression,
}

impl AsDevice<'_> {
    /// One visit over `connection`, its latencies and counts added to `played`.
    async fn visit(
        &self,
        connection: &mut Connection,
        visit: &Visit,
        played: &mut Played,
    ) -> anyhow::Result<()> {
        let authed = [("authorization", self.authorization.as_str())];
        let cbor =
            [("authorization", self.authorization.as_str()), ("content-type", CBOR_MEDIA_TYPE)];
        let started = Instant::now();
        let answer = connection
            .coordinator
            .request("POST", path::CHECK_IN, &cbor, self.check_in, Body::Keep)
            .await?;
        if !answer.is_success() {
            bail!("check-in refused: {}", answer.describe());
        }
        let answer: CheckInResponse = codec::decode(&answer.body)?;
        played.latencies.check_in.push(ms_since(started));
        let task = match answer {
            CheckInResponse::Task(task) => task,
            other => {
                if let Visit::Train { .. } = visit {
                    bail!("expected a task, got {other:?}");
                }
                return Ok(());
            }
        };
        played.tasks += 1;
        let Visit::Train { run, round, model_version, model_bytes, bodies } = visit else {
            return Ok(());
        };
        if task.model_version != *model_version {
            bail!("the task trains version {}, not {model_version}", task.model_version);
        }
        // Read to the end and let go of, not decoded: a device that does not train has no use
        // for the values, and decoding 4 GB of f32 models a round took the generator most of a
        // core.
        let started = Instant::now();
        let model = path::model_in(&task.model_hash, self.model_download);
        let answer =
            connection.coordinator.request("GET", &model, &authed, &[], Body::Discard).await?;
        if !answer.is_success() || answer.length < *model_bytes {
            bail!(
                "the model download answered {} with {} bytes (at least {model_bytes})",
                answer.status,
                answer.length
            );
        }
        played.latencies.download.push(ms_since(started));
        let started = Instant::now();
        let body = &bodies[self.index % bodies.len()];
        let upload = path::upload(*run, RoundIdx(*round));
        let answer = if let Some(target) = &task.upload_to {
            let aggregator = match connection.aggregators.entry(target.url.clone()) {
                std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::hash_map::Entry::Vacant(entry) => {
                    entry.insert(LeanConnection::new(&target.url)?)
                }
            };
            let headers =
                [(TICKET_HEADER, target.ticket.as_str()), ("content-type", CBOR_MEDIA_TYPE)];
            aggregator.request("POST", &upload, &headers, body, Body::Keep).await?
        } else {
            connection.coordinator.request("POST", &upload, &cbor, body, Body::Keep).await?
        };
        if !answer.is_success() {
            bail!("upload refused: {}", answer.describe());
        }
        played.latencies.upload.push(ms_since(started));
        played.acknowledged += 1;
        Ok(())
    }
}

/// When each of `n` visits arrives, from the start: exponential gaps of mean `1 / rate`.
fn arrivals(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = SplitMix64(seed);
    let mut at = 0.0;
    (0..n)
        .map(|_| {
            // A uniform in (0, 1]: 53 random bits, never 0, so its log is finite.
            let u = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
            at += -u.ln() / rate;
            Duration::from_secs_f64(at)
        })
        .collect()
}
