//! What the load generator measures beside its own clock: request latencies, the CPU time of
//! itself, the coordinator (its replicas and aggregators) and Postgres, the coordinator's peak memory, and the coordinator's
//! live events and metrics.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use starling_core::RunId;
use starling_tests::OPERATOR_TOKEN;

/// How long a round may take to open or commit before the bench gives up.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The kernel's clock ticks per second in `/proc/*/stat` (USER_HZ, 100 on every Linux ABI).
const TICKS_PER_SECOND: f64 = 100.0;

/// Request latencies in milliseconds, by request.
#[derive(Debug, Default)]
pub struct Latencies {
    pub check_in: Vec<f32>,
    pub download: Vec<f32>,
    pub upload: Vec<f32>,
}

impl Latencies {
    pub fn merge(&mut self, other: Latencies) {
        self.check_in.extend(other.check_in);
        self.download.extend(other.download);
        self.upload.extend(other.upload);
    }
}

/// Milliseconds since `started`.
pub fn ms_since(started: Instant) -> f32 {
    started.elapsed().as_secs_f32() * 1e3
}

/// `p50 / p99 / max` of `values` in ms, or `-` when there are none.
pub fn percentiles(values: &mut [f32]) -> String {
    if values.is_empty() {
        return "-".into();
    }
    values.sort_by(f32::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    format!("{:.1} / {:.1} / {:.1}", at(0.5), at(0.99), at(1.0))
}

/// CPU seconds (user + system) spent so far by the bench itself, the coordinator, its
/// aggregators and Postgres's processes.
#[derive(Debug, Clone)]
pub struct CpuTimes {
    generator: f64,
    coordinator: f64,
    aggregators: f64,
    replicas: f64,
    /// Each Postgres process's, by pid: backends come and go, and one that exits between two
    /// readings must not count as time given back.
    postgres: std::collections::HashMap<u32, f64>,
    at: Instant,
}

impl CpuTimes {
    pub fn now(coordinator: u32, aggregators: &[u32], replicas: &[u32]) -> anyhow::Result<Self> {
        let sum = |pids: &[u32]| {
            pids.iter().map(|pid| Ok(process_cpu(&pid.to_string())?.1)).sum::<anyhow::Result<f64>>()
        };
        let postgres = std::fs::read_dir("/proc")?
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter_map(|pid| Some((pid, process_cpu(&pid.to_string()).ok()?)))
            .filter(|(_, (name, _))| name == "postgres")
            .map(|(pid, (_, secs))| (pid, secs))
            .collect();
        Ok(CpuTimes {
            generator: process_cpu("self")?.1,
            coordinator: process_cpu(&coordinator.to_string())?.1,
            aggregators: sum(aggregators)?,
            replicas: sum(replicas)?,
            postgres,
            at: Instant::now(),
        })
    }

    /// Cores each kept busy on average between `earlier` and `self`, said in words.
    pub fn cores_since(&self, earlier: &CpuTimes) -> String {
        let wall = (self.at - earlier.at).as_secs_f64();
        let aggregators = self.aggregators - earlier.aggregators;
        let replicas = self.replicas - earlier.replicas;
        // A process that started in between spent all its time in between.
        let postgres: f64 = self
            .postgres
            .iter()
            .map(|(pid, secs)| secs - earlier.postgres.get(pid).unwrap_or(&0.0))
            .sum();
        format!(
            "CPU cores busy: generator {:.2}, coordinator {:.2}, {}{}postgres {:.2}",
            (self.generator - earlier.generator) / wall,
            (self.coordinator - earlier.coordinator) / wall,
            if aggregators > 0.0 {
                format!("aggregators {:.2}, ", aggregators / wall)
            } else {
                String::new()
            },
            if replicas > 0.0 {
                format!("replicas {:.2}, ", replicas / wall)
            } else {
                String::new()
            },
            postgres / wall,
        )
    }
}

/// A process's name and CPU seconds (user + system) from `/proc/PID/stat`.
fn process_cpu(pid: &str) -> anyhow::Result<(String, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // `pid (name) state ...`: the name may hold spaces, so fields count from its `)`.
    let (head, rest) = stat.rsplit_once(')').context("no ')' in /proc/PID/stat")?;
    let name = head.split_once('(').map_or("", |(_, name)| name).to_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: f64 = fields
        .get(11..13)
        .context("short /proc/PID/stat")?
        .iter()
        .try_fold(0.0, |sum, f| -> anyhow::Result<f64> { Ok(sum + f.parse::<f64>()?) })?;
    Ok((name, ticks / TICKS_PER_SECOND))
}

/// A process's peak resident memory (`VmHWM`) in MiB.
pub fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    starling_tests::process_memory_mib(pid, "VmHWM")
}

/// The sum of the coordinator's `store_seconds` histogram for one operation.
pub async fn store_seconds(url: &str, op: &str) -> anyhow::Result<f64> {
    let metrics = starling_tests::http_client()
        .get(format!("{url}/metrics"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await?
        .text()
        .await?;
    let label = format!("op=\"{op}\"");
    metrics
        .lines()
        .find(|l| l.contains("store_seconds_sum") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .with_context(|| format!("no store_seconds_sum for {op} in /metrics"))
}

/// The coordinator's live events (`/v1/admin/events`, server-sent), read for round changes:
/// told of each round's opening and commit as it happens, as a fleet whose devices come back
/// at once would be (a poll would add its interval to every phase it waits for).
pub struct RoundEvents {
    stream: reqwest::Response,
    /// Text received and not yet parsed into whole events.
    pending: String,
}

impl RoundEvents {
    pub async fn subscribe(url: &str) -> anyhow::Result<Self> {
        let stream = starling_tests::http_client()
            .get(format!("{url}/v1/admin/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await?
            .error_for_status()?;
        Ok(RoundEvents { stream, pending: String::new() })
    }

    /// Reads events until round `round_idx` of `run` reaches `state` (`open`, `committed`).
    pub async fn wait(&mut self, run: RunId, round_idx: i64, state: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            while let Some(end) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..end + 2).collect();
                if event.lines().any(|l| l == "event: reload") {
                    bail!("fell behind the coordinator's live events");
                }
                let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                    continue;
                };
                let update: serde_json::Value = serde_json::from_str(data)?;
                if update["type"] == "round"
                    && update["run_id"] == run.0
                    && update["round_idx"] == round_idx
                {
                    match update["state"].as_str() {
                        Some(s) if s == state => return Ok(()),
                        Some("failed") => bail!("round {round_idx} failed"),
                        _ => {}
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let chunk = tokio::time::timeout(left, self.stream.chunk())
                .await
                .with_context(|| format!("timed out waiting for round {round_idx} {state}"))??
                .context("the live event stream ended")?;
            self.pending.push_str(std::str::from_utf8(&chunk)?);
        }
    }
}

/// The most descriptors the coordinator held open at once (its connections, plus a few dozen
/// for the store's pool and files), sampled every 100 ms until dropped.
pub struct OpenDescriptors {
    most: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    sampler: tokio::task::JoinHandle<()>,
}

impl OpenDescriptors {
    pub fn watch(pid: u32) -> Self {
        let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = most.clone();
        let sampler = tokio::spawn(async move {
            let dir = format!("/proc/{pid}/fd");
            loop {
                if let Ok(entries) = std::fs::read_dir(&dir) {
                    seen.fetch_max(entries.count(), std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        OpenDescriptors { most, sampler }
    }

    pub fn most(&self) -> usize {
        self.most.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for OpenDescriptors {
    fn drop(&mut self) {
        self.sampler.abort();
    }
}
