//! Differential privacy for federated rounds: DP-FedAvg (McMahan et al., "Learning
//! Differentially Private Recurrent Language Models", 2018) with adaptive clipping (Andrew et
//! al., "Differentially Private Learning with Adaptive Clipping", 2021), and the accountant that
//! says what ε a run has spent.
//!
//! **Mechanism (central DP, trusted coordinator).** Each update is clipped to L2 norm `C` and
//! counts once (unweighted, so one device changes the sum by at most `C`); the coordinator adds
//! Gaussian noise `N(0, (z_Δ·C)²)` to every coordinate of the sum and divides by the number of
//! updates. The noised mean is all that leaves the round: the server optimizer only
//! post-processes it. With adaptive clipping, the share of updates within `C` is released with
//! noise `N(0, σ_b²)` too and moves `C` geometrically toward the plan's target quantile;
//! the two releases together are accounted as one Gaussian mechanism with noise multiplier
//! `z = (z_Δ⁻² + (2σ_b)⁻²)^(-1/2)` (Andrew et al., Theorem 1), so the plan's `noise_multiplier`
//! is `z` and the update noise is derived from it.
//!
//! **Metrics.** By default a DP run releases nothing beside the noised model: devices send no
//! metrics or evaluations. With `metrics: noised` the cohort's training loss and pooled
//! evaluation are clipped per device and noised as one more part of the same Gaussian
//! mechanism ([`metrics`]), so the plan's `z` covers them too and the update noise `z_Δ` is
//! derived after their share.
//!
//! **Accounting matches the selection that runs.** Rounds compose in Rényi DP (Mironov 2017),
//! computed exactly as Google's `dp-accounting` `RdpAccountant` does over the same orders, and
//! ε at the plan's δ follows Canonne, Kamath and Steinke (2020). Which mechanism a round is
//! depends on how its cohort is drawn ([`Sampling`]):
//!
//! - `selection: poisson` draws each eligible device that checks in with probability
//!   `q = devices selected per round / population`, independently: the Poisson-subsampled
//!   Gaussian under add/remove adjacency (Mironov, Talwar and Zhang 2019). A device that does
//!   not check in has a smaller chance than q, which only helps it.
//! - `selection: random` (the default) waits out the selection window, counts the eligible
//!   devices that checked in (the round's measured population `N`) and draws exactly `m` of
//!   them uniformly without replacement: the sampled Gaussian under replace-one adjacency
//!   (Wang, Balle and Kasiviswanathan 2019, Theorem 27). Replacing one device's update moves
//!   the clipped sum by up to `2C`, so the accountant's noise multiplier is `z / 2`. A round
//!   that measures fewer than the plan's `population` selects no one and releases nothing, so
//!   every committed round's `m / N` is at most the `q = m / population` accounted: the ε shown
//!   is an upper bound of the one the rounds spent.
//!
//! With Poisson sampling the privacy loss distribution accountant ([`pld`], as
//! `dp-accounting`'s `PLDAccountant`) bounds ε too, usually tighter; the run reports the
//! tighter of the two. Budgets (`epsilon_budget`, [`noise_multiplier_for`]) use the RDP
//! bound, which only stops a run earlier.
//!
//! Only committed rounds release anything: a failed round's noised sum is never stored or
//! served.
//!
//! **With SecAgg** the coordinator only sees the masked sum, so devices clip to `C` themselves
//! before masking and every update weighs 1 (`secure_aggregation.max_examples = 1`). With
//! central noise the coordinator adds it to the unmasked sum before anything else reads it (so
//! it holds the un-noised sum for a moment); with distributed noise ([`distributed`]) each
//! device adds discrete Gaussian noise before masking and the coordinator never holds an
//! un-noised sum. Adaptive clipping needs each device's clip bit in the clear and is refused
//! with SecAgg.

use serde::{Deserialize, Serialize};

/// The plan's `strategy.differential_privacy`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DifferentialPrivacy {
    /// The mechanism's noise multiplier z (noise standard deviation over the clip norm),
    /// covering the update noise and, with adaptive clipping, the clip-count noise.
    pub noise_multiplier: f64,
    /// The L2 bound each update is clipped to; with adaptive clipping, where it starts.
    pub clip_norm: f64,
    /// The population the cohort is sampled from, `q = devices selected per round / population`.
    /// With `random` selection the coordinator measures each round's population (eligible
    /// devices that checked in during selection) and a round measuring fewer than this selects
    /// no one; with `poisson` selection q is each device's chance per round. Not with
    /// `blt_ftrl`, which assumes no sampling.
    #[serde(default)]
    pub population: u64,
    /// δ of the (ε, δ) guarantee; well below 1/population.
    pub delta: f64,
    /// Stop the run before a round would take ε above this.
    #[serde(default)]
    pub epsilon_budget: Option<f64>,
    /// Move the clip norm toward a quantile of the update norms.
    #[serde(default)]
    pub adaptive_clipping: Option<AdaptiveClipping>,
    /// Where the noise goes on: `central` (the coordinator's, on the sum; the default) or
    /// `distributed` (each device's, before masking: needs secure aggregation).
    #[serde(default)]
    pub noise: NoisePlacement,
    /// With distributed noise, the fewest survivors the guarantee counts on: each device adds
    /// the noise of 1/`min_survivors` of the sum's, and a round with fewer survivors fails
    /// before anything is unmasked.
    #[serde(default)]
    pub min_survivors: Option<u32>,
    /// What the run releases beside its noised model: `withheld` (nothing; the default) or
    /// `noised` (the cohort's training loss and pooled evaluation, clipped and noised inside
    /// the same accounting; [`metrics`]).
    #[serde(default)]
    pub metrics: MetricsRelease,
    /// The mechanism: `dp_fedavg` (the default: independent noise each round, its ε amplified
    /// by the cohort's sampling) or `blt_ftrl` (DP-FTRL with noise correlated across rounds and
    /// a participation rule the coordinator enforces; no sampling assumed: [`blt`]).
    #[serde(default)]
    pub mechanism: Mechanism,
    /// With `blt_ftrl`: committed rounds between two participations of one device, at least.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_separation: Option<u64>,
    /// With `blt_ftrl`: participations of one device in the run, at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_participations: Option<u64>,
}

/// A DP run's mechanism.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mechanism {
    /// DP-FedAvg: independent Gaussian noise each round, accounted with amplification by the
    /// cohort's sampling.
    #[default]
    DpFedavg,
    /// DP-FTRL with Buffered Linear Toeplitz noise and a participation rule ([`blt`]).
    BltFtrl,
}

/// The most rounds a `blt_ftrl` plan may have: choosing its strategy costs O(rounds ×
/// participations) per candidate, at plan time.
pub const MAX_BLT_ROUNDS: u32 = 2_000;

/// A `blt_ftrl` run's strategy and the participation rule it is accounted under.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BltPrivacy {
    /// The noise's strategy, chosen for the plan.
    pub strategy: blt::Blt,
    /// The rule and the run's length.
    pub schema: blt::Schema,
    /// The devices selected per round: the fixed denominator of each round's noisy sum (the
    /// count of updates is not released: one device changes it).
    pub cohort: u32,
}

impl BltPrivacy {
    /// μ of the μ-GDP guarantee of the first `rounds` rounds at noise multiplier `z`.
    pub fn mu_after(&self, rounds: u64, z: f64) -> f64 {
        let schema = blt::Schema { rounds: rounds.min(self.schema.rounds), ..self.schema };
        if schema.rounds == 0 { 0.0 } else { self.strategy.mu(&schema, z) }
    }
}

/// Where a DP run's noise goes on.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoisePlacement {
    /// The coordinator adds Gaussian noise to the sum (after unmasking, in a secure run).
    #[default]
    Central,
    /// Each device adds discrete Gaussian noise before masking (the distributed discrete
    /// Gaussian; [`distributed`]): the coordinator unmasks an already-noisy sum.
    Distributed,
}

/// Adaptive clipping's parameters (Andrew et al. 2021; their defaults).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveClipping {
    /// The share of updates that should fall within the clip norm, γ in [0, 1].
    #[serde(default = "default_quantile")]
    pub target_quantile: f64,
    /// Geometric step size η_C.
    #[serde(default = "default_clip_lr")]
    pub learning_rate: f64,
    /// Noise on the count of clipped updates, σ_b; default: devices selected per round / 20.
    #[serde(default)]
    pub count_stddev: Option<f64>,
}

fn default_quantile() -> f64 {
    0.5
}
fn default_clip_lr() -> f64 {
    0.2
}

/// How a DP round's cohort is drawn, which fixes the mechanism the accountant composes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampling {
    /// Each device independently with probability q; add/remove adjacency.
    Poisson,
    /// Exactly the selected count, uniformly without replacement from the round's measured
    /// population (at least the plan's); replace-one adjacency, sensitivity 2C.
    FixedSize,
}

impl Sampling {
    /// The accountant of one round of this sampling at rate `q` with noise multiplier `z`
    /// (noise over the clip norm).
    pub fn accountant(self, q: f64, z: f64) -> RdpAccountant {
        match self {
            Sampling::Poisson => RdpAccountant::new(q, z),
            // Replace-one: one device's update can move the clipped sum by 2C.
            Sampling::FixedSize => RdpAccountant::without_replacement(q, z / 2.0),
        }
    }

    /// What the run view says was accounted.
    pub fn describe(self) -> &'static str {
        match self {
            Sampling::Poisson => "Poisson sampling, add/remove adjacency (sensitivity C)",
            Sampling::FixedSize => {
                "fixed-size sampling without replacement from the measured population, replace-one adjacency (sensitivity 2C)"
            }
        }
    }
}

/// What a DP run's rounds hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Devices selected per round (with Poisson sampling, the expected number): q's numerator.
    pub selected: u32,
    /// The most devices a round's secure aggregation holds (a Poisson draw's cap), which the
    /// ring of distributed noise is sized for; `selected` otherwise.
    pub protocol: u32,
    /// The model's parameters.
    pub n_params: usize,
}

impl Sizes {
    /// A round of `selected` devices (no cap above it) training `n_params` parameters.
    pub fn of(selected: u32, n_params: usize) -> Self {
        Sizes { selected, protocol: selected, n_params }
    }
}

/// A plan's privacy settings, resolved against its cohort and checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Privacy {
    /// The plan's settings.
    pub plan: DifferentialPrivacy,
    /// How cohorts are drawn, and so what is accounted.
    pub sampling: Sampling,
    /// Sampling rate q accounted (with fixed-size sampling, the largest any round can have).
    pub sampling_rate: f64,
    /// Noise multiplier of the update sum, z_Δ (= z without adaptive clipping).
    pub update_noise_multiplier: f64,
    /// σ_b, with adaptive clipping.
    pub count_stddev: Option<f64>,
    /// σ_m, the noise on each sum of the metrics block, with `metrics: noised`.
    pub metrics_stddev: Option<f64>,
    /// Rounds the run may commit: the plan's, or fewer where the ε budget runs out.
    pub rounds_allowed: u32,
    /// With distributed noise, what devices add and the coordinator decodes.
    pub distributed: Option<DistributedNoise>,
    /// With `blt_ftrl`, its strategy and participation rule.
    pub blt: Option<BltPrivacy>,
}

impl DifferentialPrivacy {
    /// Checks the settings for a run of `sizes` drawing its cohorts by `sampling` over
    /// `rounds` rounds, and resolves the derived quantities. The message names the bad field.
    pub fn resolve(
        &self,
        sizes: Sizes,
        rounds: u32,
        sampling: Sampling,
    ) -> Result<Privacy, (&'static str, String)> {
        let selected = sizes.selected;
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !(positive(self.noise_multiplier) && self.noise_multiplier <= 1e4) {
            return Err(("noise_multiplier", "must be in (0, 1e4]".into()));
        }
        if !(positive(self.clip_norm) && self.clip_norm <= 1e6) {
            return Err(("clip_norm", "must be in (0, 1e6]".into()));
        }
        if self.mechanism == Mechanism::BltFtrl {
            return self.resolve_blt(sizes, rounds, sampling);
        }
        for (name, set) in [
            ("min_separation", self.min_separation.is_some()),
            ("max_participations", self.max_participations.is_some()),
        ] {
            if set {
                return Err((name, "is for mechanism: blt_ftrl".into()));
            }
        }
        if self.population < u64::from(selected) {
            return Err((
                "population",
                format!("must be at least the {selected} devices selected per round"),
            ));
        }
        if !(self.delta > 0.0 && self.delta < 1.0) {
            return Err(("delta", "must be in (0, 1)".into()));
        }
        let sampling_rate = f64::from(selected) / self.population as f64;
        // Poisson runs are shown the PLD accountant's ε beside the RDP one. Drawing everyone
        // is no sampling (its loss of adding a device is unbounded below: the PLD once panicked
        // at the first round's close on it): refused here, naming the field. A noise multiplier
        // too small for the PLD's grid is handled instead: its ε is the RDP bound alone.
        if sampling == Sampling::Poisson
            && pld::representable(sampling_rate, self.noise_multiplier, pld::INTERVAL)
                == Err(pld::RepresentError::SamplingRate)
        {
            return Err((
                "population",
                format!(
                    "must exceed the {selected} devices drawn per round with selection: poisson \
                     (a sampling rate of 1 samples nothing; select them all with selection: \
                     random)"
                ),
            ));
        }
        // z⁻² = z_Δ⁻² + (2σ_b)⁻² + (σ_m/2)⁻²: the clip count's and the metrics' noise each
        // spend part of the budget (Andrew et al. 2021, Theorem 1).
        let mut rest = self.noise_multiplier.powi(-2);
        let count_stddev = match self.adaptive_clipping {
            None => None,
            Some(a) => {
                if !(0.0..=1.0).contains(&a.target_quantile) {
                    return Err(("adaptive_clipping.target_quantile", "must be in [0, 1]".into()));
                }
                if !(positive(a.learning_rate) && a.learning_rate <= 10.0) {
                    return Err(("adaptive_clipping.learning_rate", "must be in (0, 10]".into()));
                }
                let sigma_b = a.count_stddev.unwrap_or(f64::from(selected) / 20.0);
                if !positive(sigma_b) {
                    return Err(("adaptive_clipping.count_stddev", "must be positive".into()));
                }
                rest -= (2.0 * sigma_b).powi(-2);
                if rest <= 0.0 {
                    return Err((
                        "adaptive_clipping.count_stddev",
                        format!(
                            "{sigma_b} leaves no budget for the update noise: it must exceed \
                             noise_multiplier / 2 = {}",
                            self.noise_multiplier / 2.0
                        ),
                    ));
                }
                Some(sigma_b)
            }
        };
        let metrics_stddev = match self.metrics {
            MetricsRelease::Withheld => None,
            MetricsRelease::Noised(m) => {
                if self.noise == NoisePlacement::Distributed {
                    return Err((
                        "metrics",
                        "noised metrics need central noise: with distributed noise the run \
                         withholds its metrics"
                            .into(),
                    ));
                }
                if !(positive(m.loss_bound) && m.loss_bound <= 1e6) {
                    return Err(("metrics.noised.loss_bound", "must be in (0, 1e6]".into()));
                }
                let sigma_m = m.stddev.unwrap_or(f64::from(selected) / 10.0);
                if !positive(sigma_m) {
                    return Err(("metrics.noised.stddev", "must be positive".into()));
                }
                // What the update and the metrics share: σ_m must leave some of it.
                let shared = rest;
                rest -= (sigma_m / metrics::BLOCK_SENSITIVITY).powi(-2);
                if rest <= 0.0 {
                    let floor = shared.powf(-0.5) * metrics::BLOCK_SENSITIVITY;
                    return Err((
                        "metrics.noised.stddev",
                        format!(
                            "{sigma_m} leaves no budget for the update noise: it must exceed \
                             {floor:.4}"
                        ),
                    ));
                }
                Some(sigma_m)
            }
        };
        let update_noise_multiplier = match (count_stddev, metrics_stddev) {
            (None, None) => self.noise_multiplier,
            _ => rest.powf(-0.5),
        };
        let distributed = match (self.noise, self.min_survivors) {
            (NoisePlacement::Central, None) => None,
            (NoisePlacement::Central, Some(_)) => {
                return Err(("min_survivors", "is for distributed noise only".into()));
            }
            (NoisePlacement::Distributed, None) => {
                return Err((
                    "min_survivors",
                    "is needed with distributed noise: the fewest survivors whose noise the guarantee counts on".into(),
                ));
            }
            (NoisePlacement::Distributed, Some(min)) => Some(
                DistributedNoise::for_plan(
                    self.noise_multiplier,
                    self.clip_norm,
                    sizes.n_params,
                    sizes.protocol,
                    min,
                )
                .map_err(|why| ("min_survivors", why))?,
            ),
        };
        let accountant = match &distributed {
            Some(d) => d.accountant(sampling, sampling_rate),
            None => sampling.accountant(sampling_rate, self.noise_multiplier),
        };
        let rounds_allowed =
            self.rounds_within_budget(rounds, |r| accountant.epsilon(r, self.delta))?;
        Ok(Privacy {
            plan: *self,
            sampling,
            sampling_rate,
            update_noise_multiplier,
            count_stddev,
            metrics_stddev,
            rounds_allowed,
            distributed,
            blt: None,
        })
    }

    /// The rounds, of the plan's `rounds`, whose ε (`spent` after that many, growing with
    /// them) stays within the plan's `epsilon_budget`: all of them without one, and refused by
    /// name when not even one round fits.
    fn rounds_within_budget(
        &self,
        rounds: u32,
        spent: impl Fn(u64) -> f64,
    ) -> Result<u32, (&'static str, String)> {
        let Some(budget) = self.epsilon_budget else { return Ok(rounds) };
        if !(budget.is_finite() && budget > 0.0) {
            return Err(("epsilon_budget", "must be positive".into()));
        }
        let allowed = most_within(rounds, |r| spent(u64::from(r)) <= budget);
        if allowed == 0 {
            return Err((
                "epsilon_budget",
                format!(
                    "one round already spends ε = {:.3} at δ = {}; raise the budget or the noise",
                    spent(1),
                    self.delta
                ),
            ));
        }
        Ok(allowed)
    }

    /// [`DifferentialPrivacy::resolve`] for `mechanism: blt_ftrl`.
    fn resolve_blt(
        &self,
        sizes: Sizes,
        rounds: u32,
        sampling: Sampling,
    ) -> Result<Privacy, (&'static str, String)> {
        let refuse = |name, why: &str| Err((name, why.to_owned()));
        if sampling == Sampling::Poisson {
            return refuse("mechanism", "blt_ftrl assumes no sampling: use selection: random");
        }
        if self.population != 0 {
            return refuse(
                "population",
                "blt_ftrl assumes no sampling and no population: leave it out",
            );
        }
        if self.noise != NoisePlacement::Central || self.min_survivors.is_some() {
            return refuse(
                "noise",
                "blt_ftrl's noise is central (the coordinator's, after unmasking in a secure run)",
            );
        }
        if self.adaptive_clipping.is_some() {
            return refuse("adaptive_clipping", "blt_ftrl's sensitivity is for a fixed clip_norm");
        }
        if self.metrics != MetricsRelease::Withheld {
            return refuse("metrics", "blt_ftrl withholds the cohort's metrics");
        }
        if rounds > MAX_BLT_ROUNDS {
            return Err(("mechanism", format!("blt_ftrl runs at most {MAX_BLT_ROUNDS} rounds")));
        }
        let positive_count = |name: &'static str, v: Option<u64>| match v {
            Some(v) if v >= 1 => Ok(v),
            Some(_) => Err((name, "must be at least 1".to_owned())),
            None => Err((
                name,
                "is needed with blt_ftrl: the participation rule its ε counts on".to_owned(),
            )),
        };
        let schema = blt::Schema {
            rounds: u64::from(rounds),
            min_separation: positive_count("min_separation", self.min_separation)?,
            max_participations: positive_count("max_participations", self.max_participations)?,
        };
        let blt =
            BltPrivacy { strategy: blt::Blt::optimized(&schema), schema, cohort: sizes.selected };
        let z = self.noise_multiplier;
        let epsilon = |r: u64| blt::epsilon_of_gdp(blt.mu_after(r, z), self.delta);
        let rounds_allowed = self.rounds_within_budget(rounds, epsilon)?;
        Ok(Privacy {
            plan: *self,
            sampling,
            sampling_rate: 1.0,
            update_noise_multiplier: z,
            count_stddev: None,
            metrics_stddev: None,
            rounds_allowed,
            distributed: None,
            blt: Some(blt),
        })
    }
}

impl Privacy {
    /// ε spent at the plan's δ after `rounds` committed rounds: the tighter of the RDP and
    /// (with Poisson sampling) PLD accountants' bounds.
    pub fn epsilon_after(&self, rounds: u64) -> f64 {
        self.spent(rounds).epsilon()
    }

    /// The ε that holds against the coordinator after a device took part in `participations`
    /// rounds: with distributed noise, the mechanism without amplification by sampling (the
    /// coordinator chooses and knows the cohort); `None` with central noise, where the
    /// coordinator sees the un-noised sum and no ε holds against it.
    pub fn epsilon_against_coordinator(&self, participations: u64) -> Option<f64> {
        let noise = self.distributed.as_ref()?;
        Some(noise.epsilon_unamplified(participations, self.plan.delta))
    }

    /// Each accountant's ε at the plan's δ after `rounds` committed rounds.
    pub fn spent(&self, rounds: u64) -> Spent {
        Spent { rdp: self.epsilon_rdp(rounds), pld: self.epsilon_pld(rounds) }
    }

    /// The Rényi DP accountant of one round: the sampled Gaussian, or with distributed noise
    /// the sampled distributed discrete Gaussian.
    pub fn accountant(&self) -> RdpAccountant {
        match &self.distributed {
            Some(d) => d.accountant(self.sampling, self.sampling_rate),
            None => self.sampling.accountant(self.sampling_rate, self.plan.noise_multiplier),
        }
    }

    /// ε after `rounds` by the Rényi DP accountant; with `blt_ftrl`, the Gaussian mechanism's
    /// exact ε for its μ (no Rényi conversion needed).
    pub fn epsilon_rdp(&self, rounds: u64) -> f64 {
        match &self.blt {
            Some(b) => {
                blt::epsilon_of_gdp(b.mu_after(rounds, self.plan.noise_multiplier), self.plan.delta)
            }
            None => self.accountant().epsilon(rounds, self.plan.delta),
        }
    }

    /// With `blt_ftrl`, the zCDP ρ = μ²/2 of the first `rounds` rounds.
    pub fn zcdp_rho(&self, rounds: u64) -> Option<f64> {
        let b = self.blt.as_ref()?;
        Some(b.mu_after(rounds, self.plan.noise_multiplier).powi(2) / 2.0)
    }

    /// What the accountant composes, for the run view.
    pub fn describe(&self) -> String {
        if let Some(b) = &self.blt {
            return format!(
                "BLT-FTRL (ω = {:.4}, λ = {:.4}), no sampling assumed: each device at most {} times, at least {} committed rounds apart (enforced by the coordinator); add/remove adjacency, μ-GDP with μ = sensitivity / z",
                b.strategy.omega,
                b.strategy.lambda,
                b.schema.max_participations,
                b.schema.min_separation
            );
        }
        match &self.distributed {
            Some(d) => format!(
                "distributed discrete Gaussian (noise of at least {} survivors), {}",
                d.min_survivors,
                self.sampling.describe()
            ),
            None => self.sampling.describe().into(),
        }
    }

    /// ε after `rounds` by the privacy loss distribution accountant, which `dp-accounting` has
    /// for the Poisson-sampled Gaussian only (`None` for the fixed-size draw and for
    /// distributed noise, and past what its grid represents: see [`pld::MAX_POINTS`]).
    pub fn epsilon_pld(&self, rounds: u64) -> Option<f64> {
        if self.sampling != Sampling::Poisson || self.distributed.is_some() {
            return None;
        }
        pld::epsilon_remembered(
            self.sampling_rate,
            self.plan.noise_multiplier,
            rounds,
            self.plan.delta,
        )
    }

    /// What a round's noisy sum is divided by: the number of updates with the fixed-size draw
    /// (the cohort's size is fixed, so it reveals nothing), the expected cohort with Poisson
    /// sampling (McMahan et al.'s fixed denominator: dividing by how many were drawn would
    /// release that number, which the accountant does not cover).
    fn denominator(&self, n_updates: u64) -> f64 {
        if let Some(b) = &self.blt {
            return f64::from(b.cohort.max(1));
        }
        match self.sampling {
            Sampling::FixedSize => n_updates.max(1) as f64,
            Sampling::Poisson => self.sampling_rate * self.plan.population as f64,
        }
    }

    /// Turns the mean of `n_updates` clipped updates into the round's release: the noisy sum
    /// over [`Privacy::denominator`]. Adds `N(0, (z_Δ·C)²)` per coordinate of the sum, unless
    /// the noise is distributed (the devices added it before masking); with `blt_ftrl` each
    /// mean is first encoded with the earlier rounds' (`blt::Blt::release`, the run's
    /// `buffers`, empty before the first round, which it advances), released, and decoded.
    /// Other runs leave `buffers` as they are. Every release is [`Gaussian::noised`]: exact
    /// noise, exactly rounded.
    pub fn noise_mean(
        &self,
        mean: &mut [f64],
        n_updates: u64,
        clip_norm: f64,
        noise: &mut Gaussian,
        buffers: &mut blt::Buffers,
    ) -> Result<(), exact_normal::NoiseError> {
        let denominator = self.denominator(n_updates);
        let rescale = n_updates as f64 / denominator;
        if rescale != 1.0 {
            for v in mean.iter_mut() {
                *v *= rescale;
            }
        }
        if self.distributed.is_some() {
            return Ok(());
        }
        let sd = self.update_noise_multiplier * clip_norm / denominator;
        match &self.blt {
            None => {
                for v in mean {
                    *v = noise.noised(*v, sd)?;
                }
            }
            Some(b) => {
                if buffers.inputs.len() != mean.len() {
                    *buffers = blt::Buffers::zeros(mean.len());
                }
                let cells = buffers.inputs.iter_mut().zip(buffers.releases.iter_mut());
                for (v, (input, released)) in mean.iter_mut().zip(cells) {
                    *v = b.strategy.release(*v, input, released, |y| noise.noised(y, sd))?;
                }
            }
        }
        Ok(())
    }

    /// What the round releases beside its model: with `metrics: noised`, the block sums
    /// (`means` over `n_updates` devices, [`metrics::block`]) noised and turned into the
    /// cohort's training loss and pooled evaluation; nothing otherwise.
    pub fn release_metrics(
        &self,
        means: &std::collections::BTreeMap<String, f64>,
        n_updates: u64,
        noise: &mut Gaussian,
    ) -> Result<metrics::Released, exact_normal::NoiseError> {
        match (self.plan.metrics.noised(), self.metrics_stddev) {
            (Some(settings), Some(stddev)) => metrics::release(
                means,
                n_updates,
                self.denominator(n_updates),
                &settings,
                stddev,
                noise,
            ),
            _ => Ok(metrics::Released::default()),
        }
    }

    /// The clip norm for the next round (adaptive clipping): `C·exp(−η(b̃ − γ))` where `b̃` is the
    /// noised share of the round's `n_updates` that were within `C`. Without adaptive
    /// clipping, `C` is unchanged.
    ///
    /// The count is released centred, as tf-privacy's quantile estimator does: each update
    /// adds `b − ½` (±½), the noise goes on that sum, and `½` comes back after the division.
    /// Under add/remove adjacency (Poisson sampling) one device then moves it by ½, the
    /// sensitivity the accountant charges (`(2σ_b)⁻²`); the uncentred count moved by 1 and was
    /// understated. With the fixed-size draw the denominator is the count and the two agree.
    pub fn next_clip_norm(
        &self,
        clip_norm: f64,
        within: u64,
        n_updates: u64,
        noise: &mut Gaussian,
    ) -> Result<f64, exact_normal::NoiseError> {
        let (Some(a), Some(sigma_b)) = (self.plan.adaptive_clipping, self.count_stddev) else {
            return Ok(clip_norm);
        };
        let centred = within as f64 - n_updates as f64 / 2.0;
        let share = noise.noised(centred, sigma_b)? / self.denominator(n_updates) + 0.5;
        Ok((clip_norm * (-a.learning_rate * (share - a.target_quantile)).exp()).clamp(1e-9, 1e9))
    }
}

/// What a run has spent, by each accountant that covers its sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spent {
    /// ε by the Rényi DP accountant.
    pub rdp: f64,
    /// ε by the privacy loss distribution accountant (Poisson sampling only).
    pub pld: Option<f64>,
}

impl Spent {
    /// The tighter of the two bounds: the ε the run reports.
    pub fn epsilon(&self) -> f64 {
        self.pld.map_or(self.rdp, |pld| pld.min(self.rdp))
    }
}

/// The central noise: exact normal draws ([`exact_normal`]) from the ChaCha20 keystream under
/// a 32-byte seed (the coordinator seeds it from the OS generator each round; tests seed it by
/// hand), each release rounded exactly to a grid below its standard deviation.
pub struct Gaussian {
    bits: distributed::NoiseSource,
    sampler: exact_normal::ExactNormal,
}

impl Gaussian {
    /// A stream under `seed`.
    pub fn new(seed: [u8; 32]) -> Self {
        Gaussian { bits: distributed::NoiseSource::new(seed), sampler: Default::default() }
    }

    /// `value + stddev·Z` for an exact `Z ~ N(0, 1)`, rounded exactly to the power of two at or
    /// below `stddev·2⁻²⁰`: a function of the ideal Gaussian mechanism's output.
    pub fn noised(&mut self, value: f64, stddev: f64) -> Result<f64, exact_normal::NoiseError> {
        self.sampler.noised(value, stddev, &mut self.bits)
    }

    /// One draw from N(0, 1), on the grid of 2⁻²⁰.
    #[cfg(test)]
    pub(crate) fn sample(&mut self) -> f64 {
        self.noised(0.0, 1.0).expect("a unit normal is always in range")
    }
}

/// The Rényi orders of `dp-accounting`'s `RdpAccountant` (its `DEFAULT_RDP_ORDERS`).
pub fn rdp_orders() -> Vec<f64> {
    let mut orders: Vec<f64> = (1..100).map(|x| 1.0 + f64::from(x) / 10.0).collect();
    orders.extend((11..64).map(f64::from));
    orders.extend([128.0, 256.0, 512.0, 1024.0]);
    orders
}

/// RDP accountant for repeated subsampled Gaussian mechanisms of one (q, z).
#[derive(Debug, Clone)]
pub struct RdpAccountant {
    orders: Vec<f64>,
    /// RDP of one step at each order.
    per_step: Vec<f64>,
}

impl RdpAccountant {
    /// The accountant of a Poisson-subsampled Gaussian mechanism with sampling rate `q` and
    /// noise multiplier `z` (noise over the add/remove sensitivity), `dp-accounting`'s
    /// `PoissonSampledDpEvent(q, GaussianDpEvent(z))`.
    pub fn new(q: f64, z: f64) -> Self {
        let orders = rdp_orders();
        let per_step = orders.iter().map(|&a| rdp_subsampled_gaussian(q, z, a)).collect();
        RdpAccountant { orders, per_step }
    }

    /// The accountant of a Gaussian mechanism on a sample of fixed size `m` drawn without
    /// replacement from `n` (`q = m / n`), under replace-one adjacency, with noise multiplier
    /// `z` over the replace-one sensitivity: `dp-accounting`'s
    /// `SampledWithoutReplacementDpEvent(n, m, GaussianDpEvent(z))` with `REPLACE_ONE`.
    pub fn without_replacement(q: f64, z: f64) -> Self {
        let orders = rdp_orders();
        let per_step = orders.iter().map(|&a| rdp_sampled_without_replacement(q, z, a)).collect();
        RdpAccountant { orders, per_step }
    }

    /// ε after `steps` steps at `delta`.
    pub fn epsilon(&self, steps: u64, delta: f64) -> f64 {
        let rdp: Vec<f64> = self.per_step.iter().map(|r| r * steps as f64).collect();
        epsilon_from_rdp(&self.orders, &rdp, delta)
    }
}

/// The largest `n` in `0..=max` with `within(n)`, for a `within` that holds up to some `n` and
/// not after (0 when it holds for none above 0): bisection.
fn most_within(max: u32, within: impl Fn(u32) -> bool) -> u32 {
    let (mut lo, mut hi) = (0u32, max);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if within(mid) { lo = mid } else { hi = mid - 1 }
    }
    lo
}

/// The smallest noise multiplier (to 0.1 %) whose mechanism, sampling at rate `q` by
/// `sampling` for `steps` steps, spends at most `epsilon` at `delta`: how an operator (or a
/// benchmark) sizes `z` for a target privacy budget. Bisection over the accountant, since ε
/// falls as `z` grows. `None` when even `z` = 1e4, the largest a plan accepts, spends more.
pub fn noise_multiplier_for(
    sampling: Sampling,
    q: f64,
    steps: u64,
    delta: f64,
    epsilon: f64,
) -> Option<f64> {
    smallest_noise(|z| sampling.accountant(q, z).epsilon(steps, delta), epsilon)
}

/// The smallest noise multiplier (to 0.1 %) up to 1e4 whose run `spends` at most `epsilon`.
fn smallest_noise(spends: impl Fn(f64) -> f64, epsilon: f64) -> Option<f64> {
    const MAX_Z: f64 = 1e4;
    if spends(MAX_Z) > epsilon {
        return None;
    }
    let (mut lo, mut hi) = (1e-3, MAX_Z);
    while hi / lo > 1.001 {
        let mid = (lo * hi).sqrt();
        if spends(mid) <= epsilon { hi = mid } else { lo = mid }
    }
    Some(hi)
}

/// ε at `delta` from RDP values at `orders` (Canonne, Kamath and Steinke 2020, Proposition 12,
/// as `dp-accounting` computes it).
pub fn epsilon_from_rdp(orders: &[f64], rdp: &[f64], delta: f64) -> f64 {
    let best = orders
        .iter()
        .zip(rdp)
        .map(|(&a, &r)| {
            if delta * delta + (-r).exp_m1() > 0.0 {
                0.0
            } else if a > 1.01 {
                r + (-1.0 / a).ln_1p() - (delta * a).ln() / (a - 1.0)
            } else {
                f64::INFINITY
            }
        })
        .fold(f64::INFINITY, f64::min);
    best.max(0.0)
}

/// RDP at order `alpha` of one Poisson-subsampled Gaussian mechanism (Mironov, Talwar and
/// Zhang 2019): integer orders by the binomial expansion, fractional ones by the two-sided
/// series.
pub fn rdp_subsampled_gaussian(q: f64, z: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    if z == 0.0 || alpha.is_infinite() {
        return f64::INFINITY;
    }
    if q == 1.0 {
        return alpha / (2.0 * z * z);
    }
    let log_a = if alpha.fract() == 0.0 { log_a_int(q, z, alpha) } else { log_a_frac(q, z, alpha) };
    log_a / (alpha - 1.0)
}

fn log_a_int(q: f64, z: f64, alpha: f64) -> f64 {
    let log1mq = (-q).ln_1p();
    let mut log_a = f64::NEG_INFINITY;
    for i in 0..=alpha as u64 {
        let i = i as f64;
        let log_coef = log_comb(alpha, i) + i * q.ln() + (alpha - i) * log1mq;
        log_a = log_add(log_a, log_coef + (i * i - i) / (2.0 * z * z));
    }
    log_a
}

fn log_a_frac(q: f64, z: f64, alpha: f64) -> f64 {
    // Mironov, Talwar and Zhang 2019, Sec. 3.3: the integrals over (−∞, z0] and [z0, ∞) as
    // series; like dp-accounting, each term's binomial enters by its magnitude (an upper bound
    // on A), and the series stops once both parts shrink and are 30 nats below the total.
    let (mut log_a0, mut log_a1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let z0 = z * z * (1.0 / q - 1.0).ln() + 0.5;
    let log1mq = (-q).ln_1p();
    let (mut last_s0, mut last_s1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    for i in 0..MAX_FRACTIONAL_TERMS {
        let fi = f64::from(i);
        let log_coef = log_comb(alpha, fi);
        let j = alpha - fi;
        let log_t0 = log_coef + fi * q.ln() + j * log1mq;
        let log_t1 = log_coef + j * q.ln() + fi * log1mq;
        let log_e0 = 0.5f64.ln() + log_erfc((fi - z0) / (std::f64::consts::SQRT_2 * z));
        let log_e1 = 0.5f64.ln() + log_erfc((z0 - j) / (std::f64::consts::SQRT_2 * z));
        let log_s0 = log_t0 + (fi * fi - fi) / (2.0 * z * z) + log_e0;
        let log_s1 = log_t1 + (j * j - j) / (2.0 * z * z) + log_e1;
        log_a0 = log_add(log_a0, log_s0);
        log_a1 = log_add(log_a1, log_s1);
        let total = log_add(log_a0, log_a1);
        if log_s0 < last_s0 && log_s1 < last_s1 && log_s0.max(log_s1) < total - 30.0 {
            return total;
        }
        (last_s0, last_s1) = (log_s0, log_s1);
    }
    // Not converged: the order is left out of the minimum, as dp-accounting does.
    f64::INFINITY
}

/// RDP at order `alpha` of the Gaussian mechanism with noise multiplier `z` on a sample drawn
/// without replacement at rate `q`, replace-one adjacency: Wang, Balle and Kasiviswanathan
/// (2019), Theorem 27, computed as `dp-accounting` does (exactly up to order 256, with the
/// cruder bound of each term above; fractional orders interpolate the CGF between their
/// integer neighbours, their Corollary 10).
pub fn rdp_sampled_without_replacement(q: f64, z: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    if q == 1.0 {
        return alpha / (2.0 * z * z);
    }
    if alpha.is_infinite() {
        return f64::INFINITY;
    }
    if alpha.fract() == 0.0 {
        return log_a_gaussian_without_replacement(q, z, alpha as u64) / (alpha - 1.0);
    }
    let (lo, hi) = (alpha.floor(), alpha.ceil());
    let x = log_a_gaussian_without_replacement(q, z, lo as u64);
    let y = log_a_gaussian_without_replacement(q, z, hi as u64);
    let t = alpha - lo;
    ((1.0 - t) * x + t * y) / (alpha - 1.0)
}

/// ln A_α of Theorem 27 for the Gaussian mechanism at an integer order: the general bound
/// ([`log_a_without_replacement`]) with each term tightened by the forward differences of the
/// Gaussian's CGF, up to order 256.
fn log_a_gaussian_without_replacement(q: f64, z: f64, alpha: u64) -> f64 {
    /// Above it, each term takes the bound 2·e^{(i−1)·rdp(i)}, which needs no differences.
    const EXACT_UP_TO: u64 = 256;
    // x·rdp(x + 1) of the Gaussian mechanism.
    let cgf = |x: f64| x * (x + 1.0) / (2.0 * z * z);
    let deltas =
        (2..=EXACT_UP_TO).contains(&alpha).then(|| forward_differences(cgf, alpha as usize));
    log_a_without_replacement(q, alpha, &|x| x / (2.0 * z * z), deltas.as_deref())
}

/// ln A_α of Wang, Balle and Kasiviswanathan (2019), Theorem 9, for an integer order and a
/// mechanism of replace-one RDP `rdp` (with ε(∞) = ∞, each term's min takes its finite side):
/// 1 + Σ_{i≥2} C(α, i)·qⁱ·(bound of term i), the terms from the third on tightened by
/// `deltas`, the forward differences of Theorem 27, where the mechanism has them.
fn log_a_without_replacement(
    q: f64,
    alpha: u64,
    rdp: &dyn Fn(f64) -> f64,
    deltas: Option<&[f64]>,
) -> f64 {
    if alpha <= 1 {
        return 0.0;
    }
    let fa = alpha as f64;
    let e2 = rdp(2.0);
    let log_f2m1 = e2 + (-(-e2).exp()).ln_1p();
    let second = 2.0 * q.ln() + log_comb(fa, 2.0) + (4f64.ln() + log_f2m1).min(e2 + 2f64.ln());
    let mut log_a = log_add(0.0, second);
    for i in 3..=alpha {
        let fi = i as f64;
        let mut s = 2f64.ln() + (fi - 1.0) * rdp(fi);
        if let Some(deltas) = deltas {
            let lo = deltas[2 * (i as usize / 2) - 1];
            let hi = deltas[2 * (i as usize).div_ceil(2) - 1];
            s = s.min(4f64.ln() + 0.5 * (lo + hi));
        }
        log_a = log_add(log_a, s + (fi * q.ln() + log_comb(fa, fi)));
    }
    log_a
}

/// ln|Δⁱ| at 0 of the sequence (1, e^{f(0)}, e^{f(1)}, …, e^{f(n)}) for i = 1..=n+2, in
/// log magnitude, as `dp-accounting`'s `_get_forward_diffs` takes them (Wang et al.,
/// Theorem 27), differenced in place in log space with signs.
fn forward_differences(f: impl Fn(f64) -> f64, n: usize) -> Vec<f64> {
    let mut values = vec![0.0; n + 3];
    let mut positive = vec![true; n + 3];
    for (i, v) in values.iter_mut().enumerate().skip(1) {
        *v = f((i - 1) as f64);
    }
    let mut deltas = vec![0.0; n + 2];
    for (i, delta) in deltas.iter_mut().enumerate() {
        for j in 0..n + 2 - i {
            if positive[j] == positive[j + 1] {
                let (sign, magnitude) = log_sub_sign(values[j + 1], values[j]);
                values[j] = magnitude;
                positive[j] = if positive[j + 1] { sign } else { !sign };
            } else {
                values[j] = log_add(values[j], values[j + 1]);
                positive[j] = positive[j + 1];
            }
        }
        *delta = values[0];
    }
    deltas
}

/// ln|e^a − e^b| and whether e^a ≥ e^b.
fn log_sub_sign(a: f64, b: f64) -> (bool, f64) {
    if a > b {
        (true, a + (-(b - a).exp()).ln_1p())
    } else if a < b {
        (false, b + (-(a - b).exp()).ln_1p())
    } else {
        (true, f64::NEG_INFINITY)
    }
}

/// Terms of the fractional-order series before an order is given up on.
const MAX_FRACTIONAL_TERMS: u32 = 1000;

/// ln|C(n, k)| for real n, k (through ln|Γ|).
fn log_comb(n: f64, k: f64) -> f64 {
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// ln(e^a + e^b).
fn log_add(a: f64, b: f64) -> f64 {
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if lo == f64::NEG_INFINITY { hi } else { hi + (lo - hi).exp().ln_1p() }
}

/// ln Φ(x), the standard normal CDF's logarithm, accurate in the far left tail.
fn log_phi(x: f64) -> f64 {
    log_erfc(-x / std::f64::consts::SQRT_2) - std::f64::consts::LN_2
}

/// ln(erfc(x)), accurate in the far tail where erfc underflows.
fn log_erfc(x: f64) -> f64 {
    if x < 20.0 {
        libm::erfc(x).ln()
    } else {
        // erfc(x) = e^{−x²}/(x√π) · (1 − 1/(2x²) + 3/(4x⁴) − 15/(8x⁶) + …)
        let x2 = x * x;
        let series = 1.0 - 1.0 / (2.0 * x2) + 3.0 / (4.0 * x2 * x2) - 15.0 / (8.0 * x2 * x2 * x2);
        -x2 - x.ln() - 0.5 * std::f64::consts::PI.ln() + series.ln()
    }
}

pub mod blt;
pub mod distributed;
pub mod exact_normal;
pub mod metrics;
pub mod pld;

pub use distributed::DistributedNoise;
pub use metrics::{MetricsRelease, NoisedMetrics};

#[cfg(test)]
mod tests;
