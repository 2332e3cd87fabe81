//! What operators watch: Prometheus metrics, the live event stream behind the dashboard, the
//! device population sampled over time, and per-round upload counters.
//!
//! Everything here is in memory and per coordinator process: counters restart at zero with the
//! process (as Prometheus expects), and the durable facts (rounds, models, evaluations) stay in
//! the store, which the dashboard reads through the admin API.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::Serialize;
use starling_core::{Millis, RoundIdx, RunId};
use tokio::sync::broadcast;

/// How many population samples are kept (one every [`POPULATION_SAMPLE_MS`]: one hour).
const POPULATION_HISTORY: usize = 1800;
/// How often the population is sampled.
pub const POPULATION_SAMPLE_MS: i64 = 2_000;
/// A device is online for this long after it was last heard from.
pub const ONLINE_WINDOW_MS: i64 = 60_000;
/// Live events buffered per subscriber; a subscriber that falls further behind is told to
/// reload instead of being waited for.
const EVENT_BUFFER: usize = 256;

/// One thing the dashboard should know about now.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LiveEvent {
    /// A run was created, finished or stopped.
    Run {
        /// The run.
        run_id: i64,
        /// `running`, `finished` or `stopped`.
        state: String,
    },
    /// A round opened or closed.
    Round {
        /// The run.
        run_id: i64,
        /// The round.
        round_idx: i64,
        /// `open`, `committed` or `failed`.
        state: String,
    },
    /// An evaluation report arrived for a model version.
    Evaluation {
        /// The run.
        run_id: i64,
        /// The model version evaluated.
        version: i64,
    },
    /// A population sample.
    Population(PopulationSample),
}

/// Devices online, eligible and participating at one moment.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct PopulationSample {
    /// Sample time.
    pub at_ms: i64,
    /// Heard from within the last minute.
    pub online: u64,
    /// Online, and their last check-in found a running run of their population.
    pub eligible: u64,
    /// Selected in an open round and not yet reported.
    pub participating: u64,
}

/// Upload counters of one round, since this process started.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct RoundCounters {
    /// Uploads refused, for any reason.
    pub rejected: u64,
    /// Bytes of acknowledged uploads.
    pub upload_bytes: u64,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabel {
    run: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The coordinator's Prometheus metrics.
struct Metrics {
    registry: Registry,
    rounds: Family<OutcomeLabel, Counter>,
    selected: Counter,
    accepted: Counter,
    dropouts: Counter,
    rejected: Family<ReasonLabel, Counter>,
    upload_bytes: Counter,
    aggregation: Histogram,
    phases: HistogramFamily<PhaseLabel>,
    store: HistogramFamily<OpLabel>,
    devices: Family<StateLabel, Gauge>,
    epsilon: Family<RunLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    aggregators: Gauge,
}

impl Metrics {
    fn new() -> Self {
        let m = Metrics {
            rounds: Family::default(),
            selected: Counter::default(),
            accepted: Counter::default(),
            dropouts: Counter::default(),
            rejected: Family::default(),
            upload_bytes: Counter::default(),
            aggregation: seconds_histogram(),
            phases: Family::new_with_constructor(seconds_histogram),
            store: Family::new_with_constructor(seconds_histogram),
            devices: Family::default(),
            epsilon: Family::default(),
            aggregators: Gauge::default(),
            registry: Registry::with_prefix("starling"),
        };
        let mut m = m;
        let registry = &mut m.registry;
        registry.register("rounds", "Rounds closed, by outcome", m.rounds.clone());
        registry.register(
            "participants_selected",
            "Devices selected into rounds",
            m.selected.clone(),
        );
        registry.register("updates_accepted", "Updates acknowledged (durable)", m.accepted.clone());
        registry.register(
            "dropouts",
            "Selected devices that did not report before their round closed",
            m.dropouts.clone(),
        );
        registry.register("uploads_rejected", "Uploads refused, by error code", m.rejected.clone());
        registry.register("upload_bytes", "Bytes of acknowledged uploads", m.upload_bytes.clone());
        registry.register(
            "aggregation_seconds",
            "Time to aggregate and commit a round's model",
            m.aggregation.clone(),
        );
        registry.register(
            "round_phase_seconds",
            "Round phase durations: open (opened to closed) and aggregation (closed to committed)",
            m.phases.clone(),
        );
        registry.register(
            "store_seconds",
            "Store operation latency, by operation",
            m.store.clone(),
        );
        registry.register(
            "devices",
            "Devices online, eligible and participating (latest sample)",
            m.devices.clone(),
        );
        registry.register(
            "privacy_epsilon",
            "ε spent by each differentially private run at its plan's δ, after its committed rounds",
            m.epsilon.clone(),
        );
        registry.register(
            "aggregators_live",
            "Aggregator nodes of the tier polling within their liveness window",
            m.aggregators.clone(),
        );
        m
    }
}

#[derive(Debug, Default)]
struct Population {
    /// Last time each device was heard from, and whether a running run wanted it then.
    last_seen: HashMap<i64, (Millis, bool)>,
    history: VecDeque<PopulationSample>,
}

/// Shared by the driver and the HTTP edge.
#[derive(Clone)]
pub struct Observer {
    inner: Arc<Inner>,
}

struct Inner {
    metrics: Metrics,
    events: broadcast::Sender<LiveEvent>,
    population: Mutex<Population>,
    rounds: Mutex<BTreeMap<(i64, i64), RoundCounters>>,
}

impl Default for Observer {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl Observer {
    /// A fresh observer with zeroed metrics.
    pub fn new() -> Self {
        Observer {
            inner: Arc::new(Inner {
                metrics: Metrics::new(),
                events: broadcast::channel(EVENT_BUFFER).0,
                population: Mutex::default(),
                rounds: Mutex::default(),
            }),
        }
    }

    /// The metrics in the OpenMetrics text format.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.inner.metrics.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// A receiver of every live event from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<LiveEvent> {
        self.inner.events.subscribe()
    }

    fn publish(&self, event: LiveEvent) {
        // No subscriber is not an error.
        let _ = self.inner.events.send(event);
    }

    /// A run was created, finished or stopped.
    pub fn run_state(&self, run_id: RunId, state: &str) {
        self.publish(LiveEvent::Run { run_id: run_id.0, state: state.to_owned() });
    }

    fn publish_round(&self, run_id: RunId, round_idx: RoundIdx, state: &str) {
        self.publish(LiveEvent::Round {
            run_id: run_id.0,
            round_idx: round_idx.0,
            state: state.to_owned(),
        });
    }

    /// A round opened.
    pub fn round_opened(&self, run_id: RunId, round_idx: RoundIdx) {
        self.publish_round(run_id, round_idx, "open");
    }

    /// A round closed with `outcome` (`committed`, `too_few_selected`, ...) after `open_ms`
    /// open and `aggregation_ms` aggregating (when it was committed).
    pub fn round_closed(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        outcome: &str,
        n_dropped: u32,
        open_ms: i64,
        aggregation_ms: Option<f64>,
    ) {
        let m = &self.inner.metrics;
        m.rounds.get_or_create(&OutcomeLabel { outcome: outcome.to_owned() }).inc();
        m.dropouts.inc_by(u64::from(n_dropped));
        let phase = |p: &str| m.phases.get_or_create(&PhaseLabel { phase: p.to_owned() }).clone();
        phase("open").observe(open_ms.max(0) as f64 / 1e3);
        if let Some(ms) = aggregation_ms {
            m.aggregation.observe(ms / 1e3);
            phase("aggregation").observe(ms / 1e3);
        }
        let state = match outcome {
            "committed" | "evaluated" => outcome,
            _ => "failed",
        };
        self.publish_round(run_id, round_idx, state);
    }

    /// A run was stopped with `round_idx` open; the round fails.
    pub fn round_stopped(&self, run_id: RunId, round_idx: RoundIdx) {
        let m = &self.inner.metrics;
        m.rounds.get_or_create(&OutcomeLabel { outcome: "stopped".to_owned() }).inc();
        self.publish_round(run_id, round_idx, "failed");
    }

    /// A device was selected.
    pub fn selected(&self) {
        self.inner.metrics.selected.inc();
    }

    /// An upload of `bytes` was acknowledged.
    pub fn upload_accepted(&self, run_id: RunId, round_idx: RoundIdx, bytes: u64) {
        let m = &self.inner.metrics;
        m.accepted.inc();
        m.upload_bytes.inc_by(bytes);
        self.round_counters(run_id, round_idx, |c| c.upload_bytes += bytes);
    }

    /// An upload was refused with error code `reason`.
    pub fn upload_rejected(&self, run_id: RunId, round_idx: RoundIdx, reason: &str) {
        let m = &self.inner.metrics;
        m.rejected.get_or_create(&ReasonLabel { reason: reason.to_owned() }).inc();
        self.round_counters(run_id, round_idx, |c| c.rejected += 1);
    }

    fn round_counters(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        f: impl FnOnce(&mut RoundCounters),
    ) {
        let mut rounds = self.inner.rounds.lock().expect("observer lock");
        // Bounded: rounds are created by the coordinator, not by requests; keep the latest.
        if rounds.len() >= 100_000 {
            rounds.pop_first();
        }
        f(rounds.entry((run_id.0, round_idx.0)).or_default());
    }

    /// Upload counters of a run's rounds (those seen since this process started).
    pub fn run_round_counters(&self, run_id: RunId) -> BTreeMap<i64, RoundCounters> {
        let rounds = self.inner.rounds.lock().expect("observer lock");
        rounds
            .range((run_id.0, i64::MIN)..=(run_id.0, i64::MAX))
            .map(|(&(_, r), &c)| (r, c))
            .collect()
    }

    /// An evaluation report for `version` arrived.
    pub fn evaluation(&self, run_id: RunId, version: i64) {
        self.publish(LiveEvent::Evaluation { run_id: run_id.0, version });
    }

    /// A differentially private run has spent `epsilon` (at its plan's δ).
    pub fn privacy_spent(&self, run_id: RunId, epsilon: f64) {
        let label = RunLabel { run: run_id.0.to_string() };
        self.inner.metrics.epsilon.get_or_create(&label).set(epsilon);
    }

    /// A store operation took `seconds`.
    pub fn store_latency(&self, op: &str, seconds: f64) {
        self.inner.metrics.store.get_or_create(&OpLabel { op: op.to_owned() }).observe(seconds);
    }

    /// A device was heard from at `now`; `wanted` when a running run of its population would
    /// select it. Returns how many devices were heard from lately (pace steering's population).
    pub fn device_seen(&self, device: i64, now: Millis, wanted: bool) -> u32 {
        let mut p = self.inner.population.lock().expect("observer lock");
        p.last_seen.insert(device, (now, wanted));
        // Since the last sample pruned it: devices seen in the last minute or two.
        u32::try_from(p.last_seen.len()).unwrap_or(u32::MAX)
    }

    /// The aggregator nodes now live.
    pub fn aggregators_live(&self, n: usize) {
        self.inner.metrics.aggregators.set(n as i64);
    }

    /// Takes a population sample at `now`, given how many devices hold unfinished tasks.
    pub fn sample_population(&self, now: Millis, participating: u64) -> PopulationSample {
        let sample = {
            let mut p = self.inner.population.lock().expect("observer lock");
            p.last_seen.retain(|_, (seen, _)| now - *seen < ONLINE_WINDOW_MS);
            let online = p.last_seen.len() as u64;
            let eligible = p.last_seen.values().filter(|(_, wanted)| *wanted).count() as u64;
            let sample = PopulationSample { at_ms: now, online, eligible, participating };
            if p.history.len() == POPULATION_HISTORY {
                p.history.pop_front();
            }
            p.history.push_back(sample);
            sample
        };
        let devices = &self.inner.metrics.devices;
        for (state, n) in [
            ("online", sample.online),
            ("eligible", sample.eligible),
            ("participating", sample.participating),
        ] {
            devices.get_or_create(&StateLabel { state: state.to_owned() }).set(n as i64);
        }
        self.publish(LiveEvent::Population(sample));
        sample
    }

    /// The population samples kept, oldest first.
    pub fn population_history(&self) -> Vec<PopulationSample> {
        self.inner.population.lock().expect("observer lock").history.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_the_counters_that_were_touched() {
        let o = Observer::new();
        o.round_closed(RunId(1), RoundIdx(0), "committed", 2, 1500, Some(12.0));
        o.upload_rejected(RunId(1), RoundIdx(0), "stale_model");
        o.upload_accepted(RunId(1), RoundIdx(0), 400);
        let text = o.render_metrics();
        assert!(text.contains("starling_rounds_total{outcome=\"committed\"} 1"), "{text}");
        assert!(text.contains("starling_dropouts_total 2"), "{text}");
        assert!(
            text.contains("starling_uploads_rejected_total{reason=\"stale_model\"} 1"),
            "{text}"
        );
        assert!(text.contains("starling_upload_bytes_total 400"), "{text}");
        assert_eq!(
            o.run_round_counters(RunId(1))[&0],
            RoundCounters { rejected: 1, upload_bytes: 400 }
        );
        assert!(o.run_round_counters(RunId(2)).is_empty());
    }

    #[test]
    fn population_counts_recent_devices_only() {
        let o = Observer::new();
        let mut events = o.subscribe();
        o.device_seen(1, 0, true);
        o.device_seen(2, 50_000, false);
        o.device_seen(3, 70_000, true);
        let s = o.sample_population(80_000, 1);
        assert_eq!((s.online, s.eligible, s.participating), (2, 1, 1));
        assert_eq!(events.try_recv().unwrap(), LiveEvent::Population(s));
        assert_eq!(o.population_history(), [s]);
    }
}
