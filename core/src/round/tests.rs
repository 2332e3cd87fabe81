//! Round state machine tests: snapshot traces of the actions for each scenario, grouped by
//! behaviour in the modules below; this file is their shared harness (a one-parameter
//! schema, a default config, and `Trace`, which drives a machine and records each action).

use expect_test::{Expect, expect};

use std::sync::Arc;

use super::*;
use crate::compression::Compression;
use crate::fedavg::{Aggregate, AggregateError, ValidatedPartial, ValidatedUpdate, validate_parts};
use crate::tensor::{DType, TensorSchema, TensorSpec};
use crate::tier::PartialReport;

fn one_parameter() -> TensorSchema {
    TensorSchema {
        tensors: vec![TensorSpec { name: "w".into(), shape: vec![1], dtype: DType::F32 }],
    }
}

/// A one-parameter update weighing `examples`.
fn update(examples: u64) -> ValidatedUpdate {
    validate_parts(&one_parameter(), Compression::F32, vec![0; 4], examples, Default::default())
        .unwrap()
}

/// An aggregator's partial for one-parameter updates of `devices`, weighing 100 examples each
/// per the first aggregator's id (so traces tell partials apart).
fn partial(request: RequestId, aggregators: &[u32], devices: &[i64]) -> Input {
    let report = PartialReport {
        model_version: ModelVersion(0),
        schema_id: one_parameter().schema_id(),
        aggregators: aggregators.iter().copied().map(AggregatorId).collect(),
        devices: devices.iter().copied().map(DeviceId).collect(),
        total_weight: devices.len() as u64 * 100 * u64::from(aggregators[0]),
        sum_hi: vec![0; 8],
        sum_lo: vec![0; 8],
        metrics: Default::default(),
    };
    let sums: ValidatedPartial = report.validate(&one_parameter()).unwrap();
    Input::Partial {
        request,
        round_idx: RoundIdx(0),
        report: Arc::new(report),
        sums: Arc::new(sums),
    }
}

fn config() -> RoundConfig {
    RoundConfig {
        cohort_size: 2,
        target_selected: 3,
        min_quorum: 2,
        selection_timeout_ms: 1_000,
        reporting_timeout_ms: 5_000,
        total_rounds: 2,
        eligibility: Default::default(),
        secure: None,
        evaluation_only: false,
        each_update_direct: false,
        poisson_rate: None,
        min_population: None,
        selection: crate::plan::SelectionPolicy::FirstCome,
        asynchronous: None,
        max_failed_rounds: 0,
        participation_rule: None,
    }
}

/// Drives a machine and records every action as one line.
struct Trace {
    m: RunMachine,
    now: Millis,
    next_request: u64,
    lines: Vec<String>,
}

/// An input as a trace line: its `Debug`, but a check-in's device conditions only when it
/// reports any (most traces are about rounds, not eligibility).
fn describe(input: &Input) -> String {
    match input {
        Input::CheckIn { request, device, attributes, online }
            if *attributes == crate::eligibility::DeviceAttributes::default() =>
        {
            format!("CheckIn {{ request: {request:?}, device: {device:?}, online: {online} }}")
        }
        // Most rounds' refusals name no culprits: their lines stay as they were.
        Input::RoundClosed { round_idx, committed, refused_by } if refused_by.is_empty() => {
            format!("RoundClosed {{ round_idx: {round_idx:?}, committed: {committed} }}")
        }
        other => format!("{other:?}"),
    }
}

impl Trace {
    fn new() -> Self {
        Self::with(config())
    }

    fn with(config: RoundConfig) -> Self {
        let m = RunMachine::start(RunId(1), config, 0, [0; 32]);
        let mut t = Trace { m, now: 0, next_request: 0, lines: vec![] };
        t.drain();
        t
    }

    fn drain(&mut self) {
        while let Some(a) = self.m.poll_action() {
            self.lines.push(format!("  {a:?}"));
        }
    }

    fn input(&mut self, input: Input) -> RequestId {
        self.lines.push(format!("t={} {}", self.now, describe(&input)));
        self.m.handle(self.now, input);
        self.drain();
        RequestId(self.next_request)
    }

    fn req(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    fn check_in(&mut self, device: i64) {
        let request = self.req();
        self.input(Input::CheckIn {
            request,
            device: DeviceId(device),
            attributes: Default::default(),
            online: 10,
        });
    }

    /// An upload weighing as many examples as the device's id, so traces show whose update a
    /// fold carries.
    fn upload(&mut self, device: i64, round: i64) -> RequestId {
        let request = self.req();
        let model_version = self.m.model_version();
        self.input(Input::Upload {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(round),
            model_version,
            update: update(device as u64),
        });
        request
    }

    /// An upload trained on `model_version` (a late device's in an asynchronous run, or a
    /// stale one).
    fn upload_trained_on(&mut self, device: i64, round: i64, model_version: i64) -> RequestId {
        let request = self.req();
        self.input(Input::Upload {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(round),
            model_version: ModelVersion(model_version),
            update: update(device as u64),
        });
        request
    }

    /// An evaluation-only run's upload: metrics and an example count, no delta.
    fn upload_evaluation(&mut self, device: i64, round: i64) -> RequestId {
        let request = self.req();
        let metrics = [("accuracy".to_owned(), 0.5)].into();
        self.input(Input::Upload {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(round),
            model_version: self.m.model_version(),
            update: validate_parts(
                &TensorSchema { tensors: vec![] },
                Compression::F32,
                vec![],
                7,
                metrics,
            )
            .unwrap(),
        });
        request
    }

    fn persisted(&mut self, request: RequestId, ok: bool) {
        self.input(Input::Persisted { request, ok });
    }

    fn closed(&mut self, round: i64, committed: bool) {
        self.input(Input::RoundClosed {
            round_idx: RoundIdx(round),
            committed,
            refused_by: vec![],
        });
    }

    fn advance_to(&mut self, now: Millis) {
        self.now = now;
        self.lines.push(format!("t={now} timeout (poll_timeout was {:?})", self.m.poll_timeout()));
        self.m.handle_timeout(now);
        self.drain();
    }

    fn check(self, expect: Expect) {
        expect.assert_eq(&(self.lines.join("\n") + "\n"));
    }
}

mod closing;
mod pacing;
mod recovery;
mod secure_rounds;
mod selection;
mod tiered;
