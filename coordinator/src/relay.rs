//! Fleet traffic on every replica: a coordinator that does not lead serves devices by relaying
//! the requests that need a round decision to the leader through the store.
//!
//! A replica is a coordinator started while another holds the leadership lock (any number of
//! them share one Postgres). It serves the fleet API itself as far as the durable state allows
//! (enrollment, credentials, model, base-model and tokenizer downloads, evaluations, duplicate
//! checks) and relays the rest — check-ins, upload admission, uploads, secure-aggregation
//! messages and polls — as rows of `relayed_requests`: the leader takes each, hands it to its
//! driver exactly as its own HTTP edge would, and writes the answer back; the replica reads it
//! and answers the device. So every decision stays with the leader's round machines and every
//! answer means what it means from the leader: an upload's 200 says the update is durable in
//! the leader's round, and a request the leader never answered was never acknowledged (the
//! device retries, and a retried upload the leader had taken meets `duplicate_upload`).
//!
//! The request is in the store before anyone waits for it, so a request relayed while the
//! leader is being replaced is answered by the next leader: it takes again what its predecessor
//! took and never answered ([`SqlStore::retake_unanswered_relayed`]). Nothing in the table is
//! state (Postgres keeps it unlogged, without WAL or fsync): a request lost with Postgres is one
//! nobody answered, which the device retries.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use starling_core::codec;
use starling_core::eligibility::DeviceAttributes;
use starling_core::fedavg::validate_parts;
use starling_core::wire::{CheckInResponse, ErrorCode, SecAggInstruction, SecAggUpload, UploadAck};
use starling_core::{DeviceId, ModelVersion, RoundIdx, RunId};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::clock::now_ms;
use crate::driver::{DriverError, DriverHandle, Event, Hold};
use crate::http::{ApiError, AppState, MAX_CONCURRENT_UPLOADS};
use crate::store::{RelayedRequestRow, SqlStore};

/// How long a replica holds a device's check-in for the leader's answer; then the device is
/// told to come back after [`COME_BACK_AFTER_SECS`] (the leader is away, or being replaced).
pub const CHECK_IN_WAIT: Duration = Duration::from_secs(20);
/// How long a replica waits for the leader's answer to any other relayed request; then 503.
/// Longer than a takeover (lease, standby poll, recovery), so that a request relayed while the
/// leader is replaced is answered by its successor.
pub const ANSWER_WAIT: Duration = Duration::from_secs(60);
/// What a device whose check-in found no leader is told.
pub const COME_BACK_AFTER_SECS: u32 = 5;
/// Relayed requests a leader works on at once: as many as the uploads it admits itself
/// ([`MAX_CONCURRENT_UPLOADS`]), since a relayed upload holds a model's worth of memory too.
pub const LEADER_CONCURRENCY: usize = MAX_CONCURRENT_UPLOADS;
/// How often a replica looks for answers while it waits for some, and a busy leader for
/// requests; an idle leader backs off to [`IDLE_POLL`].
pub const BUSY_POLL: Duration = Duration::from_millis(5);
/// The slowest an idle leader looks for relayed requests.
pub const IDLE_POLL: Duration = Duration::from_millis(100);
/// Rows older than this are dropped by the leader: their replicas stopped waiting long ago.
pub const EXPIRE_AFTER: Duration = Duration::from_secs(600);

/// A fleet request as a replica relays it: the driver event without its reply channel.
#[derive(Debug, Serialize, Deserialize)]
enum RelayedRequest {
    CheckIn {
        device: DeviceId,
        population: String,
        attributes: DeviceAttributes,
    },
    AdmitPayload {
        device: DeviceId,
        run_id: RunId,
        round_idx: RoundIdx,
        secure: bool,
    },
    /// An update the replica validated; the leader validates its parts again as it rebuilds
    /// it (as recovery does from a stored update).
    Upload {
        device: DeviceId,
        run_id: RunId,
        round_idx: RoundIdx,
        model_version: ModelVersion,
        example_count: u64,
        metrics: BTreeMap<String, f64>,
        #[serde(with = "serde_bytes")]
        delta: Vec<u8>,
    },
    SecAgg {
        device: DeviceId,
        run_id: RunId,
        round_idx: RoundIdx,
        message: SecAggUpload,
    },
    SecAggPoll {
        device: DeviceId,
        run_id: RunId,
        round_idx: RoundIdx,
    },
}

/// The leader's answer to a relayed request.
#[derive(Debug, Serialize, Deserialize)]
enum RelayedAnswer {
    CheckIn(Box<CheckInResponse>),
    Done,
    Upload(UploadAck),
    SecAggPoll(SecAggInstruction),
    /// What the leader's HTTP edge would have answered instead.
    Refused {
        status: u16,
        code: ErrorCode,
        message: String,
        retry_after_secs: Option<u64>,
    },
}

/// Where a relayed request's answer goes on the replica.
enum Reply {
    CheckIn(oneshot::Sender<Result<CheckInResponse, DriverError>>),
    Done(oneshot::Sender<Result<(), DriverError>>),
    Upload(oneshot::Sender<Result<UploadAck, DriverError>>),
    SecAggPoll(oneshot::Sender<Result<SecAggInstruction, DriverError>>),
}

impl Reply {
    fn answer(self, answer: Result<RelayedAnswer, DriverError>) {
        let refused = |answer| match answer {
            Ok(RelayedAnswer::Refused { status, code, message, retry_after_secs }) => {
                DriverError::Refused { status, code, message, retry_after_secs }
            }
            Ok(other) => {
                tracing::error!(answer = ?other, "the leader answered a relayed request with an answer of another kind");
                DriverError::Unavailable
            }
            Err(e) => e,
        };
        match (self, answer) {
            (Reply::CheckIn(reply), Ok(RelayedAnswer::CheckIn(res))) => drop(reply.send(Ok(*res))),
            (Reply::Done(reply), Ok(RelayedAnswer::Done)) => drop(reply.send(Ok(()))),
            (Reply::Upload(reply), Ok(RelayedAnswer::Upload(ack))) => drop(reply.send(Ok(ack))),
            (Reply::SecAggPoll(reply), Ok(RelayedAnswer::SecAggPoll(i))) => drop(reply.send(Ok(i))),
            (Reply::CheckIn(reply), answer) => drop(reply.send(Err(refused(answer)))),
            (Reply::Done(reply), answer) => drop(reply.send(Err(refused(answer)))),
            (Reply::Upload(reply), answer) => drop(reply.send(Err(refused(answer)))),
            (Reply::SecAggPoll(reply), answer) => drop(reply.send(Err(refused(answer)))),
        }
    }

    /// When the leader did not answer in time: a check-in is told to come back; anything
    /// else is 503, to be retried.
    fn unanswered(self) {
        match self {
            Reply::CheckIn(reply) => drop(reply.send(Ok(CheckInResponse::ComeBackLater {
                retry_after_secs: COME_BACK_AFTER_SECS,
            }))),
            reply => reply.answer(Err(DriverError::Unavailable)),
        }
    }
}

/// Splits a driver event into what is relayed, where its answer goes and what its edge holds
/// (an upload's permit, held here until the leader answers); an event only the leader serves
/// is answered [`DriverError::NotLeader`] here.
fn relayed(event: Event) -> Option<(RelayedRequest, Reply, Option<Hold>)> {
    let not_leader = DriverError::NotLeader;
    Some(match event {
        Event::CheckIn { device, population, attributes, reply } => (
            RelayedRequest::CheckIn { device, population, attributes },
            Reply::CheckIn(reply),
            None,
        ),
        Event::AdmitPayload { device, run_id, round_idx, secure, reply } => (
            RelayedRequest::AdmitPayload { device, run_id, round_idx, secure },
            Reply::Done(reply),
            None,
        ),
        Event::Upload { device, run_id, round_idx, model_version, update, hold, reply } => {
            return Some((
                RelayedRequest::Upload {
                    device,
                    run_id,
                    round_idx,
                    model_version,
                    example_count: update.example_count(),
                    metrics: update.metrics().clone(),
                    delta: update.delta_bytes().as_ref().clone(),
                },
                Reply::Upload(reply),
                hold,
            ));
        }
        Event::SecAgg { device, run_id, round_idx, message, reply } => (
            RelayedRequest::SecAgg { device, run_id, round_idx, message },
            Reply::Done(reply),
            None,
        ),
        Event::SecAggPoll { device, run_id, round_idx, reply } => (
            RelayedRequest::SecAggPoll { device, run_id, round_idx },
            Reply::SecAggPoll(reply),
            None,
        ),
        Event::AggregatorPoll { reply, .. } => {
            let _ = reply.send(Err(not_leader));
            return None;
        }
        Event::Partial { reply, .. } | Event::StopRun { reply, .. } => {
            let _ = reply.send(Err(not_leader));
            return None;
        }
        Event::CreateRun { reply, .. } => {
            let _ = reply.send(Err(not_leader));
            return None;
        }
    })
}

/// The replica's requests waiting for answers, by row id.
#[derive(Default)]
struct Waiting {
    by_id: std::sync::Mutex<WaitingIds>,
    /// Woken when a request starts waiting (the collector sleeps while none does).
    wake: Notify,
    /// Set when the replica's handles are gone: the collector stops once nothing waits.
    closed: AtomicBool,
}

#[derive(Default)]
struct WaitingIds {
    senders: HashMap<i64, oneshot::Sender<Vec<u8>>>,
    /// Answers read before their request started waiting (the leader answered between the
    /// row's insert and the wait), with when they were read.
    early: HashMap<i64, (Vec<u8>, std::time::Instant)>,
}

impl Waiting {
    fn wait_for(&self, id: i64) -> oneshot::Receiver<Vec<u8>> {
        let (tx, rx) = oneshot::channel();
        let mut ids = self.by_id.lock().expect("waiting set poisoned");
        match ids.early.remove(&id) {
            Some((answer, _)) => drop(tx.send(answer)),
            None => drop(ids.senders.insert(id, tx)),
        }
        drop(ids);
        self.wake.notify_one();
        rx
    }

    fn stop_waiting(&self, id: i64) {
        self.by_id.lock().expect("waiting set poisoned").senders.remove(&id);
    }

    fn is_idle(&self) -> bool {
        self.by_id.lock().expect("waiting set poisoned").senders.is_empty()
    }

    fn deliver(&self, answers: Vec<(i64, Vec<u8>)>) {
        let now = std::time::Instant::now();
        let mut ids = self.by_id.lock().expect("waiting set poisoned");
        ids.early.retain(|_, (_, read)| now.duration_since(*read) < ANSWER_WAIT);
        for (id, answer) in answers {
            match ids.senders.remove(&id) {
                Some(tx) => drop(tx.send(answer)),
                None => drop(ids.early.insert(id, (answer, now))),
            }
        }
    }
}

/// A replica's driver handle: every event it gets is relayed to the leader through `store`
/// (or refused, for what only the leader serves).
pub fn replica_handle(store: SqlStore) -> DriverHandle {
    let (handle, events) = DriverHandle::relaying();
    let mut replica = [0u8; 8];
    getrandom::fill(&mut replica).expect("the OS random source failed");
    let replica = i64::from_le_bytes(replica);
    let waiting = Arc::new(Waiting::default());
    tokio::spawn(collect_answers(store.clone(), replica, waiting.clone()));
    tokio::spawn(forward_events(store, replica, waiting, events));
    handle
}

async fn forward_events(
    store: SqlStore,
    replica: i64,
    waiting: Arc<Waiting>,
    mut events: mpsc::Receiver<Event>,
) {
    while let Some(event) = events.recv().await {
        if let Some((request, reply, hold)) = relayed(event) {
            let waiting = waiting.clone();
            tokio::spawn(relay_one(store.clone(), replica, waiting, request, reply, hold));
        }
    }
    waiting.closed.store(true, Ordering::SeqCst);
    waiting.wake.notify_one();
}

/// Writes one request for the leader and answers it with what the leader says, or as
/// [`Reply::unanswered`] when it says nothing in time.
async fn relay_one(
    store: SqlStore,
    replica: i64,
    waiting: Arc<Waiting>,
    request: RelayedRequest,
    reply: Reply,
    _hold: Option<Hold>,
) {
    let wait = match request {
        RelayedRequest::CheckIn { .. } => CHECK_IN_WAIT,
        _ => ANSWER_WAIT,
    };
    let bytes = match codec::to_vec(&request) {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::error!(error = %e, "a relayed request does not encode");
            return reply.answer(Err(DriverError::Unavailable));
        }
    };
    drop(request);
    let id = match store.relay_request(replica, &bytes, now_ms()).await {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(error = %e, "relaying a request to the leader failed");
            return reply.answer(Err(DriverError::Unavailable));
        }
    };
    drop(bytes);
    match tokio::time::timeout(wait, waiting.wait_for(id)).await {
        Ok(Ok(answer)) => {
            let answer = codec::decode::<RelayedAnswer>(&answer).map_err(|e| {
                tracing::error!(error = %e, "the leader's answer to a relayed request does not decode");
                DriverError::Unavailable
            });
            reply.answer(answer);
        }
        Ok(Err(_)) | Err(_) => {
            waiting.stop_waiting(id);
            if let Err(e) = store.withdraw_relayed(id).await {
                tracing::warn!(error = %e, id, "withdrawing an unanswered relayed request failed");
            }
            reply.unanswered();
        }
    }
}

/// Reads the leader's answers for this replica while any request waits for one.
async fn collect_answers(store: SqlStore, replica: i64, waiting: Arc<Waiting>) {
    loop {
        if waiting.is_idle() {
            if waiting.closed.load(Ordering::SeqCst) {
                return;
            }
            // A request that starts waiting wakes this (a wake before this await is kept).
            let _ = tokio::time::timeout(Duration::from_secs(1), waiting.wake.notified()).await;
            continue;
        }
        match store.collect_relayed_answers(replica).await {
            Ok(answers) if !answers.is_empty() => waiting.deliver(answers),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "reading the leader's answers failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        tokio::time::sleep(BUSY_POLL).await;
    }
}

/// The leader's side: takes relayed requests from the store, hands each to the driver as the
/// HTTP edge would, and writes the answer back. Runs until aborted (the leader's serving ends).
pub async fn serve_relayed(state: AppState) {
    match state.store().retake_unanswered_relayed().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            requests = n,
            "taking again the relayed requests an earlier leader left unanswered"
        ),
        Err(e) => tracing::warn!(error = %e, "retaking unanswered relayed requests failed"),
    }
    let permits = Arc::new(Semaphore::new(LEADER_CONCURRENCY));
    let (answers, to_write) = mpsc::unbounded_channel();
    // Ends when every sender is gone: this task's (aborted with it) and the answering tasks'.
    tokio::spawn(write_answers(state.store().clone(), to_write));
    let mut idle = BUSY_POLL;
    let mut expired_at = std::time::Instant::now();
    loop {
        // Taken only as fast as they are answered: at most LEADER_CONCURRENCY in memory.
        let first = permits.clone().acquire_owned().await.expect("the semaphore is never closed");
        let room = 1 + permits.available_permits() as i64;
        let rows = match state.store().take_relayed(room, now_ms()).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "taking relayed requests failed");
                drop(first);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut first = Some(first);
        let found = !rows.is_empty();
        for row in rows {
            let permit = match first.take() {
                Some(permit) => permit,
                None => permits.clone().acquire_owned().await.expect("never closed"),
            };
            tokio::spawn(answer_one(state.clone(), row, answers.clone(), permit));
        }
        drop(first);
        idle = if found { BUSY_POLL } else { (idle * 2).min(IDLE_POLL) };
        if !found {
            tokio::time::sleep(idle).await;
        }
        if expired_at.elapsed() > Duration::from_secs(60) {
            expired_at = std::time::Instant::now();
            let before = now_ms() - EXPIRE_AFTER.as_millis() as i64;
            match state.store().expire_relayed(before).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(rows = n, "dropped relayed requests nobody waits for"),
                Err(e) => tracing::warn!(error = %e, "dropping old relayed requests failed"),
            }
        }
    }
}

/// Answers one relayed request through the driver and hands the answer to `answers`.
async fn answer_one(
    state: AppState,
    row: RelayedRequestRow,
    answers: mpsc::UnboundedSender<(i64, Vec<u8>)>,
    _permit: OwnedSemaphorePermit,
) {
    let RelayedRequestRow { id, request } = row;
    let decoded = codec::decode::<RelayedRequest>(&request);
    // An upload's bytes are model-sized: only the decoded request is kept while it is decided.
    drop(request);
    let answer = match decoded {
        Ok(request) => decide(&state, request).await,
        Err(e) => Err(ApiError::malformed(format!("a relayed request does not decode: {e}"))),
    };
    let answer = answer.unwrap_or_else(|e| {
        let (status, code, message, retry_after_secs) = e.parts();
        RelayedAnswer::Refused {
            status: status.as_u16(),
            code,
            message: message.to_owned(),
            retry_after_secs,
        }
    });
    let _ = answers.send((id, codec::to_vec(&answer).expect("answers encode")));
}

/// Writes the answers as they come, all that queued during a write in the next one: one
/// statement for many answers, so a busy leader's answers cost Postgres far less than one
/// statement each. An answer that cannot be written is dropped after a few tries: its replica
/// answers 503 when its wait ends, and the device's retry meets what was done.
async fn write_answers(store: SqlStore, mut answers: mpsc::UnboundedReceiver<(i64, Vec<u8>)>) {
    let mut batch = Vec::new();
    while answers.recv_many(&mut batch, 4096).await > 0 {
        for attempt in 0..3 {
            match store.answer_relayed(&batch, now_ms()).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(error = %e, answers = batch.len(), attempt, "writing relayed requests' answers failed");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        batch.clear();
    }
}

/// What the leader's driver decides about one relayed request.
async fn decide(state: &AppState, request: RelayedRequest) -> Result<RelayedAnswer, ApiError> {
    let driver = state.driver();
    Ok(match request {
        RelayedRequest::CheckIn { device, population, attributes } => {
            RelayedAnswer::CheckIn(Box::new(
                driver
                    .call(|reply| Event::CheckIn { device, population, attributes, reply })
                    .await?,
            ))
        }
        RelayedRequest::AdmitPayload { device, run_id, round_idx, secure } => {
            driver
                .call(|reply| Event::AdmitPayload { device, run_id, round_idx, secure, reply })
                .await?;
            RelayedAnswer::Done
        }
        RelayedRequest::Upload {
            device,
            run_id,
            round_idx,
            model_version,
            example_count,
            metrics,
            delta,
        } => {
            let plan = state.plan(run_id).await?;
            let update = tokio::task::spawn_blocking(move || {
                validate_parts(
                    &plan.update_schema(),
                    plan.compression(),
                    delta,
                    example_count,
                    metrics,
                )
            })
            .await
            .map_err(|e| ApiError::internal(&e))??;
            let event = |reply| Event::Upload {
                device,
                run_id,
                round_idx,
                model_version,
                update,
                hold: None,
                reply,
            };
            RelayedAnswer::Upload(driver.call(event).await?)
        }
        RelayedRequest::SecAgg { device, run_id, round_idx, message } => {
            driver
                .call(|reply| Event::SecAgg { device, run_id, round_idx, message, reply })
                .await?;
            RelayedAnswer::Done
        }
        RelayedRequest::SecAggPoll { device, run_id, round_idx } => RelayedAnswer::SecAggPoll(
            driver.call(|reply| Event::SecAggPoll { device, run_id, round_idx, reply }).await?,
        ),
    })
}
