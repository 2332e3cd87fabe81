//! Plan validation: defaults, bounds, and deterministic initialization.

use super::*;

fn plan_json() -> serde_json::Value {
    serde_json::json!({
        "model": {
            "schema": {"tensors": [
                {"name": "w", "shape": [4, 3], "dtype": "f32"},
                {"name": "b", "shape": [4], "dtype": "f32"}
            ]},
            "init": {"kind": "seeded", "seed": 7}
        },
        "training": {"epochs": 1, "lr": 0.1},
        "cohort_size": 10,
        "rounds": 3
    })
}

fn parse(v: serde_json::Value) -> Result<ValidatedPlan, PlanError> {
    serde_json::from_value::<Plan>(v).unwrap().validate()
}

#[test]
fn defaults_resolve() {
    let p = parse(plan_json()).unwrap();
    let c = p.round_config();
    assert_eq!((c.cohort_size, c.target_selected, c.min_quorum), (10, 13, 10));
    assert_eq!((c.selection_timeout_ms, c.reporting_timeout_ms), (30_000, 120_000));
    assert_eq!(p.plan().population, "default");
    // Devices get the whole training section, its defaults filled in.
    let sent =
        r#"{"epochs":1,"batch_size":32,"lr":0.1,"optimizer":"sgd","fedprox_mu":0.0,"seed":0}"#;
    assert_eq!(p.training_config_json(), sent);
}

#[test]
fn bounds_are_checked_with_the_field_named() {
    let cases = [
        ("cohort_size", serde_json::json!(0)),
        ("over_selection", serde_json::json!(0.5)),
        ("min_quorum", serde_json::json!(11)),
        ("rounds", serde_json::json!(0)),
        ("reporting_timeout_secs", serde_json::json!(1.0)),
    ];
    for (name, value) in cases {
        let mut v = plan_json();
        v[name] = value;
        let err = parse(v).unwrap_err().to_string();
        assert!(err.starts_with(name), "{name}: {err}");
    }
    let mut v = plan_json();
    v["unknown_field"] = serde_json::json!(1);
    assert!(serde_json::from_value::<Plan>(v).is_err());
}

#[test]
fn seeded_init_is_deterministic_glorot() {
    let p = parse(plan_json()).unwrap();
    let a = p.initial_parameters(|_| None).unwrap();
    let b = p.initial_parameters(|_| None).unwrap();
    assert_eq!(a, b);
    let bound = (6.0f32 / 7.0).sqrt();
    assert!(a[..12].iter().all(|v| v.abs() <= bound) && a[..12].iter().any(|v| *v != 0.0));
    assert_eq!(&a[12..], &[0.0; 4]);
}

#[test]
fn explicit_parameters_are_checked() {
    let mut v = plan_json();
    v["model"]["init"] = serde_json::json!({"kind": "parameters", "data_base64": "AAAA"});
    assert!(parse(v).is_err());
}

#[test]
fn schema_comes_from_the_spec_or_must_match_it() {
    let spec = serde_json::json!({"input": {"kind": "features", "size": 4}, "layers": [{"kind": "linear", "out": 3}]});
    let mut v = plan_json();
    v["model"] = serde_json::json!({"spec": spec, "init": {"kind": "seeded", "seed": 1}});
    let p = parse(v.clone()).unwrap();
    assert_eq!(p.schema().tensors.len(), 2);
    assert_eq!(p.initial_parameters(|_| None).unwrap().len(), 15);
    assert!(p.model_spec().is_some());
    v["model"]["schema"] = plan_json()["model"]["schema"].clone();
    assert!(parse(v.clone()).unwrap_err().to_string().starts_with("model.schema"));
    v["model"] = serde_json::json!({"init": {"kind": "zeros"}});
    assert!(parse(v).unwrap_err().to_string().starts_with("model"));
}

#[test]
fn secure_aggregation_resolves_and_checks_its_bounds() {
    let mut v = plan_json();
    v["secure_aggregation"] = serde_json::json!({"clip": 0.5, "max_examples": 1000});
    let secure = parse(v.clone()).unwrap().round_config().secure.unwrap();
    // 13 selected: k = 12 (the complete graph: 3·⌈log2 13⌉ = 12 = n − 1), t = 7.
    // The vector: 16 weighted values, the weight, and the device's evaluation (3 entries).
    assert_eq!((secure.k, secure.t, secure.n_params, secure.vector_len), (12, 7, 16, 16 + 1 + 3));
    assert!(secure.carries_evaluation(20) && !secure.carries_evaluation(17));
    assert_eq!(secure.stage_timeout_ms, 30_000);
    v["secure_aggregation"]["neighbours"] = serde_json::json!(4);
    assert_eq!(parse(v.clone()).unwrap().round_config().secure.unwrap().t, 3);
    let bad = [
        ("neighbours", serde_json::json!(3)),
        ("clip", serde_json::json!(0.0)),
        ("max_examples", serde_json::json!(0)),
        ("stage_timeout_secs", serde_json::json!(-1.0)),
    ];
    for (key, value) in bad {
        let mut v = v.clone();
        v["secure_aggregation"][key] = value;
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
    let mut tiny = plan_json();
    tiny["cohort_size"] = serde_json::json!(2);
    tiny["over_selection"] = serde_json::json!(1.0);
    tiny["secure_aggregation"] = serde_json::json!({"clip": 1.0, "max_examples": 10});
    assert!(parse(tiny).unwrap_err().to_string().contains("3..="));
}

/// Distributed DP: each device's vector is the rotated model padded to a power of two (no
/// weight, no evaluation), the rounds need the survivors the noise counts on, and the plan
/// must say how many that is and turn secure aggregation on.
#[test]
fn distributed_noise_resolves_into_the_secure_rounds() {
    let mut v = plan_json();
    v["over_selection"] = serde_json::json!(1.0);
    v["min_quorum"] = serde_json::json!(6);
    v["secure_aggregation"] = serde_json::json!({"clip": 1.0, "max_examples": 1});
    v["strategy"] = serde_json::json!({"differential_privacy": {"noise_multiplier": 1.0,
        "clip_norm": 0.5, "population": 100, "delta": 1e-5, "noise": "distributed",
        "min_survivors": 8}});
    let plan = parse(v.clone()).unwrap();
    let secure = plan.round_config().secure.unwrap();
    let noise = secure.distributed.expect("devices add the noise");
    assert_eq!((noise.n_params, noise.padded_len(), secure.vector_len), (16, 16, 16));
    assert!(!secure.carries_evaluation(16) && !secure.carries_evaluation(20));
    assert_eq!(noise.local_stddev, 0.5 / 8f64.sqrt());
    assert_eq!(plan.round_config().min_quorum, 8, "the survivors the noise counts on");
    assert_eq!(plan.privacy().unwrap().epsilon_pld(3), None);

    let mut missing = v.clone();
    missing["strategy"]["differential_privacy"]["min_survivors"] = serde_json::Value::Null;
    assert!(parse(missing).unwrap_err().to_string().contains("min_survivors"));
    let mut too_many = v.clone();
    too_many["strategy"]["differential_privacy"]["min_survivors"] = 11.into();
    assert!(parse(too_many).unwrap_err().to_string().contains("min_survivors"));
    let mut plain = v.clone();
    plain["secure_aggregation"] = serde_json::Value::Null;
    assert!(parse(plain).unwrap_err().to_string().contains("needs secure_aggregation"));
    let mut central = v;
    central["strategy"]["differential_privacy"]["noise"] = "central".into();
    assert!(parse(central).unwrap_err().to_string().contains("distributed noise only"));
}

/// `init` (and a layer of a spec) with a unit `kind` accepted any other field, so a
/// typo such as `{"kind": "zeros", "seed": 3}` passed silently. Every variant now refuses them.
#[test]
fn unknown_fields_are_refused_in_every_tagged_variant() {
    for init in [
        serde_json::json!({"kind": "zeros", "seed": 3}),
        serde_json::json!({"kind": "seeded", "seed": 3, "extra": 1}),
    ] {
        let mut plan = plan_json();
        plan["model"]["init"] = init.clone();
        let err = serde_json::from_value::<Plan>(plan).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{init}: {err}");
    }
    let mut plan = plan_json();
    plan["model"]["init"] = serde_json::json!({"kind": "zeros"});
    assert!(parse(plan).is_ok(), "the plain form still loads");
    for layer in ["relu", "flatten", "layer_norm", "last_step"] {
        let json = serde_json::json!({"kind": layer, "out": 3});
        let err = serde_json::from_value::<crate::model_spec::LayerSpec>(json).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{layer}: {err}");
    }
    let relu: crate::model_spec::LayerSpec =
        serde_json::from_value(serde_json::json!({"kind": "relu"})).unwrap();
    assert_eq!(serde_json::to_value(relu).unwrap(), serde_json::json!({"kind": "relu"}));
}

/// Plain runs cap self-reported example counts (secure runs already did).
#[test]
fn plain_runs_cap_example_counts() {
    let default_cap = parse(plan_json()).unwrap().max_examples();
    assert_eq!(default_cap, DEFAULT_MAX_EXAMPLES);
    // One device claiming any count weighs at most ~17 honest ones holding 600 (MNIST's
    // per-device share); the old default of 100 000 let one outweigh two honest ones 83 : 1.
    assert!(default_cap <= 10_000, "{default_cap}");
    let mut plan = plan_json();
    plan["max_examples"] = 600.into();
    assert_eq!(parse(plan.clone()).unwrap().max_examples(), 600);
    for bad in [0u64, crate::fedavg::MAX_EXAMPLE_COUNT + 1] {
        plan["max_examples"] = bad.into();
        assert!(matches!(parse(plan.clone()), Err(PlanError::Field { field: "max_examples", .. })));
    }
}

/// A plan may require device conditions; they reach the round config, a malformed
/// requirement is refused by name, old plans (without any) still load and require nothing.
#[test]
fn eligibility_is_validated_and_reaches_the_rounds() {
    assert!(parse(plan_json()).unwrap().round_config().eligibility.is_open());
    let mut plan = plan_json();
    plan["eligibility"] =
        serde_json::json!({"charging": true, "unmetered_network": true, "min_app_version": "4.2"});
    let config = parse(plan).unwrap().round_config();
    assert!(config.eligibility.charging && config.eligibility.unmetered_network);
    assert_eq!(config.eligibility.min_app_version.as_deref(), Some("4.2"));
    let mut plan = plan_json();
    plan["eligibility"] = serde_json::json!({"min_app_version": "4.x"});
    let err = parse(plan).unwrap_err().to_string();
    assert!(err.contains("eligibility") && err.contains("4.x"), "{err}");
    let mut plan = plan_json();
    plan["eligibility"] = serde_json::json!({"min_battery_percent": 120});
    let err = parse(plan).unwrap_err().to_string();
    assert!(err.contains("min_battery_percent 120"), "{err}");
    let mut plan = plan_json();
    plan["eligibility"] = serde_json::json!({"charing": true});
    assert!(
        serde_json::from_value::<Plan>(plan).unwrap_err().to_string().contains("unknown field")
    );
}

/// `evaluation_only` reaches the rounds, makes uploads delta-free (an empty update
/// schema, while devices still get the model's), and is refused with secure aggregation.
#[test]
fn evaluation_only_plans_upload_no_delta_and_are_plain() {
    let plain = parse(plan_json()).unwrap();
    assert!(!plain.round_config().evaluation_only);
    assert_eq!(plain.update_schema(), *plain.schema());
    let mut plan = plan_json();
    plan["evaluation_only"] = true.into();
    let evaluating = parse(plan.clone()).unwrap();
    assert!(evaluating.round_config().evaluation_only);
    assert_eq!(evaluating.update_schema().numel(), 0);
    assert_eq!(evaluating.schema(), plain.schema());
    plan["secure_aggregation"] = serde_json::json!({"clip": 1.0, "max_examples": 1000});
    assert!(matches!(parse(plan), Err(PlanError::Field { field: "evaluation_only", .. })));
}

/// A plan names its server optimizer under `strategy`; old plans are FedAvg with
/// their `server_learning_rate`; bad hyper-parameters are refused by name, and a stateful
/// optimizer does not silently ignore a `server_learning_rate`.
#[test]
fn the_strategy_names_a_checked_server_optimizer() {
    use crate::strategy::{AdaptiveParams, ServerOptimizer};
    assert_eq!(parse(plan_json()).unwrap().plan().strategy.optimizer, ServerOptimizer::default());
    let mut plan = plan_json();
    plan["strategy"] = serde_json::json!({"optimizer": {"kind": "fed_adam", "lr": 0.01}});
    let adam = parse(plan.clone()).unwrap().plan().strategy.optimizer;
    assert_eq!(
        adam,
        ServerOptimizer::FedAdam(AdaptiveParams { lr: 0.01, beta1: 0.9, beta2: 0.99, tau: 1e-3 })
    );
    plan["server_learning_rate"] = 0.5.into();
    assert!(matches!(
        parse(plan.clone()),
        Err(PlanError::Field { field: "server_learning_rate", .. })
    ));
    plan["server_learning_rate"] = 1.0.into();
    plan["strategy"]["optimizer"]["beta1"] = 1.5.into();
    let err = parse(plan.clone()).unwrap_err().to_string();
    assert!(err.contains("strategy.optimizer") && err.contains("beta1"), "{err}");
    plan["strategy"] = serde_json::json!({"optimizer": {"kind": "fed_sgd"}});
    let err = serde_json::from_value::<Plan>(plan).unwrap_err().to_string();
    assert!(err.contains("fed_sgd"), "{err}");
}

/// The test plan with `strategy` as its strategy.
fn with_strategy(strategy: serde_json::Value) -> serde_json::Value {
    let mut v = plan_json();
    v["strategy"] = strategy;
    v
}

/// Why `plan` is refused.
fn refused(plan: serde_json::Value) -> String {
    parse(plan).unwrap_err().to_string()
}

#[test]
fn robust_aggregation_is_checked_against_the_rest_of_the_plan() {
    // Robust aggregators parse, need each update, and bypass the tier.
    let median = parse(with_strategy(
        serde_json::json!({"aggregation": {"kind": "coordinate_median"}, "norm_bound": 2.0}),
    ))
    .unwrap();
    assert!(median.round_config().each_update_direct);
    assert!(!parse(plan_json()).unwrap().round_config().each_update_direct);
    let krum = with_strategy(serde_json::json!({"aggregation": {"kind": "krum", "byzantine": 4}}));
    assert!(refused(krum.clone()).contains("min_quorum to 11"), "{}", refused(krum));
    let err = refused(with_strategy(
        serde_json::json!({"aggregation": {"kind": "trimmed_mean", "trim_fraction": 0.5}}),
    ));
    assert!(err.contains("strategy.aggregation") && err.contains("trim_fraction"), "{err}");
    assert!(
        refused(with_strategy(serde_json::json!({"norm_bound": -1.0})))
            .contains("strategy.norm_bound")
    );
    // Order statistics and norm bounds cannot see through secure aggregation.
    let mut secure = with_strategy(
        serde_json::json!({"aggregation": {"kind": "trimmed_mean", "trim_fraction": 0.1}}),
    );
    secure["secure_aggregation"] = serde_json::json!({"clip": 0.5, "max_examples": 1});
    assert!(refused(secure.clone()).contains("secure aggregation reveals only the sum"));
    secure["strategy"] = serde_json::json!({"norm_bound": 1.0});
    assert!(refused(secure.clone()).contains("cannot bound a masked update"));
    // An evaluation-only run takes none of it.
    let mut eval = with_strategy(serde_json::json!({"aggregation": {"kind": "coordinate_median"}}));
    eval["evaluation_only"] = true.into();
    assert!(refused(eval).contains("evaluation-only run trains nothing"));
    // Unknown fields are refused inside the new parts too.
    let v =
        with_strategy(serde_json::json!({"aggregation": {"kind": "coordinate_median", "trim": 1}}));
    assert!(serde_json::from_value::<Plan>(v).is_err());
}

#[test]
fn differential_privacy_is_checked_against_the_rest_of_the_plan() {
    // DP: resolved, budget caps the rounds, and its combinations are checked.
    let dp = serde_json::json!({"noise_multiplier": 1.0, "clip_norm": 0.5, "population": 100, "delta": 1e-5});
    let private = parse(with_strategy(serde_json::json!({"differential_privacy": dp}))).unwrap();
    let privacy = private.privacy().unwrap();
    assert_eq!(privacy.sampling_rate, 0.13, "13 selected (over-selection 1.3) of 100");
    // Random selection with DP: an exact draw of 13 from at least the 100 accounted.
    assert_eq!(privacy.sampling, crate::privacy::Sampling::FixedSize);
    assert_eq!(private.round_config().min_population, Some(100));
    assert_eq!(private.round_config().total_rounds, 3);
    let mut budgeted = with_strategy(serde_json::json!({"differential_privacy": dp}));
    budgeted["rounds"] = 1000.into();
    budgeted["strategy"]["differential_privacy"]["epsilon_budget"] = 3.0.into();
    budgeted["strategy"]["differential_privacy"]["noise_multiplier"] = 4.0.into();
    let budgeted = parse(budgeted).unwrap();
    let allowed = budgeted.round_config().total_rounds;
    assert!((1..1000).contains(&allowed), "{allowed}");
    assert!(budgeted.privacy().unwrap().epsilon_after(u64::from(allowed)) <= 3.0);
    let err =
        refused(with_strategy(serde_json::json!({"differential_privacy": dp, "norm_bound": 1.0})));
    assert!(err.contains("does not combine"), "{err}");
    // Poisson selection draws at the accountant's rate, and needs DP for that rate.
    let mut poisson = with_strategy(serde_json::json!({"differential_privacy": dp}));
    poisson["selection"] = "poisson".into();
    let poisson = parse(poisson).unwrap();
    assert_eq!(poisson.round_config().poisson_rate, Some(0.13));
    assert_eq!(poisson.round_config().min_population, None, "Poisson draws on arrival");
    assert_eq!(poisson.privacy().unwrap().sampling, crate::privacy::Sampling::Poisson);
    assert_eq!(private.round_config().poisson_rate, None, "random selection draws no rate");
    let mut no_dp = plan_json();
    no_dp["selection"] = "poisson".into();
    let err = refused(no_dp);
    assert!(err.contains("selection") && err.contains("needs differential_privacy"), "{err}");
    // Whoever checks in first is no sample of the population: no ε holds for it.
    let mut first_come = with_strategy(serde_json::json!({"differential_privacy": dp}));
    first_come["selection"] = "first_come".into();
    let err = refused(first_come);
    assert!(err.contains("selection") && err.contains("must be random"), "{err}");
    let mut small = with_strategy(serde_json::json!({"differential_privacy": dp}));
    small["strategy"]["differential_privacy"]["population"] = 5.into();
    let err = refused(small);
    assert!(err.contains("strategy.differential_privacy") && err.contains("population"), "{err}");
    // With secure aggregation every update must weigh 1, the clip norm reaches the devices,
    // and adaptive clipping is refused.
    let mut secure = with_strategy(serde_json::json!({"differential_privacy": dp}));
    secure["secure_aggregation"] = serde_json::json!({"clip": 0.5, "max_examples": 100});
    assert!(refused(secure.clone()).contains("secure_aggregation.max_examples"));
    secure["secure_aggregation"]["max_examples"] = 1.into();
    assert_eq!(parse(secure.clone()).unwrap().round_config().secure.unwrap().clip_norm, Some(0.5));
    secure["strategy"]["differential_privacy"]["adaptive_clipping"] =
        serde_json::json!({"count_stddev": 5.0});
    assert!(refused(secure).contains("adaptive_clipping"));
    // Unknown fields are refused inside the privacy section too.
    let v = with_strategy(
        serde_json::json!({"differential_privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "population": 10, "delta": 1e-5, "epsilon": 3}}),
    );
    assert!(serde_json::from_value::<Plan>(v).is_err());
}

#[test]
fn compression_is_chosen_in_the_plan_and_refused_where_it_cannot_work() {
    let with = |key: &str, value: serde_json::Value| {
        let mut v = plan_json();
        v[key] = value;
        v
    };
    let refused = |v: serde_json::Value| parse(v).unwrap_err().to_string();
    // Old plans are f32, and so are their tasks.
    let plain = parse(plan_json()).unwrap();
    assert_eq!(plain.compression(), Compression::F32);
    assert_eq!(plain.max_delta_bytes(), 16 * 4);
    assert!(serde_json::to_value(plain.plan()).unwrap().get("compression").is_none());
    let int8 = parse(with("compression", serde_json::json!({"kind": "int8", "block": 8}))).unwrap();
    assert_eq!(int8.compression(), Compression::Int8 { block: 8 });
    // The tier reduces a compressed run's decoded values, as the coordinator folds them.
    assert!(!int8.round_config().each_update_direct);
    // Top-k of every value sends an index beside each: the body limit makes room.
    let dense_top_k =
        parse(with("compression", serde_json::json!({"kind": "top_k", "fraction": 1.0})));
    assert_eq!(dense_top_k.unwrap().max_delta_bytes(), 4 + 16 * 8);
    let err = refused(with("compression", serde_json::json!({"kind": "top_k", "fraction": 0.0})));
    assert!(err.contains("compression") && err.contains("fraction"), "{err}");
    let mut secure = with("compression", serde_json::json!({"kind": "f16"}));
    secure["secure_aggregation"] = serde_json::json!({"clip": 1.0, "max_examples": 10});
    assert!(refused(secure).contains("secure aggregation"));
    let mut median = with("compression", serde_json::json!({"kind": "bf16"}));
    median["strategy"] = serde_json::json!({"aggregation": {"kind": "coordinate_median"}});
    assert!(refused(median).contains("order statistics"));
}

#[test]
fn asynchronous_runs_select_by_concurrency_and_refuse_what_weighs_updates_otherwise() {
    let with = |value: serde_json::Value| {
        let mut v = plan_json();
        v["asynchronous"] = value;
        v
    };
    let refused = |v: serde_json::Value| parse(v).unwrap_err().to_string();
    let cohort = plan_json()["cohort_size"].as_u64().unwrap() as u32;
    // Synchronous by default, and old plans say nothing of it.
    let plain = parse(plan_json()).unwrap();
    assert_eq!(plain.round_config().asynchronous, None);
    assert!(serde_json::to_value(plain.plan()).unwrap().get("asynchronous").is_none());
    let fedbuff = parse(with(serde_json::json!({"concurrency": cohort * 3, "max_staleness": 4})))
        .unwrap()
        .round_config();
    let a = fedbuff.asynchronous.expect("asynchronous");
    assert_eq!((a.concurrency, a.max_staleness, a.staleness_exponent), (cohort * 3, 4, 0.5));
    assert_eq!(fedbuff.target_selected, cohort * 3, "concurrency, not over-selection");
    assert!(fedbuff.each_update_direct, "each update is weighed by its staleness");
    assert_eq!(a.staleness_scale(0), 1.0);
    assert_eq!(a.staleness_scale(3), 0.5);
    let err = refused(with(serde_json::json!({"concurrency": cohort - 1, "max_staleness": 4})));
    assert!(err.contains("asynchronous.concurrency"), "{err}");
    let exponent =
        serde_json::json!({"concurrency": cohort, "max_staleness": 1, "staleness_exponent": -1});
    assert!(refused(with(exponent)).contains("staleness_exponent"));
    let unknown = serde_json::json!({"concurrency": cohort, "max_staleness": 1, "buffer": 3});
    assert!(serde_json::from_value::<Plan>(with(unknown)).is_err(), "unknown fields are refused");
    let mut secure = with(serde_json::json!({"concurrency": cohort, "max_staleness": 1}));
    secure["secure_aggregation"] = serde_json::json!({"clip": 1.0, "max_examples": 10});
    assert!(refused(secure).contains("asynchronous"));
    let mut median = with(serde_json::json!({"concurrency": cohort, "max_staleness": 1}));
    median["strategy"] = serde_json::json!({"aggregation": {"kind": "coordinate_median"}});
    assert!(refused(median).contains("asynchronous"));
}

#[test]
fn a_model_downloads_in_a_whole_encoding_and_evaluation_runs_get_it_plain() {
    let with = |value: serde_json::Value| {
        let mut v = plan_json();
        v["model_download"] = value;
        v
    };
    let refused = |v: serde_json::Value| parse(v).unwrap_err().to_string();
    // Old plans download f32 and say nothing of it.
    let plain = parse(plan_json()).unwrap();
    assert_eq!(plain.model_download(), Compression::F32);
    assert!(serde_json::to_value(plain.plan()).unwrap().get("model_download").is_none());
    let int8 = parse(with(serde_json::json!({"kind": "int8", "block": 64}))).unwrap();
    assert_eq!(int8.model_download(), Compression::Int8 { block: 64 });
    assert_eq!(int8.compression(), Compression::F32, "uploads keep their own encoding");
    let err = refused(with(serde_json::json!({"kind": "top_k", "fraction": 0.5})));
    assert!(err.contains("model_download") && err.contains("top_k"), "{err}");
    let err = refused(with(serde_json::json!({"kind": "int8", "block": 0})));
    assert!(err.contains("model_download") && err.contains("block"), "{err}");
    let mut evaluation = with(serde_json::json!({"kind": "f16"}));
    evaluation["evaluation_only"] = serde_json::json!(true);
    assert!(refused(evaluation).contains("evaluation-only"));
}

/// A plan may write its models' bytes every few versions; every version by default
/// (and old plans say nothing of it), the last always, and only where models can be rebuilt.
#[test]
fn models_are_written_every_checkpoint_interval_versions_and_the_last() {
    let with = |interval: u32| {
        let mut v = plan_json();
        v["checkpoint_interval"] = interval.into();
        v["rounds"] = 7.into();
        v
    };
    let refused = |v: serde_json::Value| parse(v).unwrap_err().to_string();
    let plain = parse(plan_json()).unwrap();
    assert_eq!(plain.plan().checkpoint_interval, 1);
    assert!(serde_json::to_value(plain.plan()).unwrap().get("checkpoint_interval").is_none());
    assert!((0..=3).all(|v| plain.writes_model(ModelVersion(v))));
    let every_third = parse(with(3)).unwrap();
    let written: Vec<i64> =
        (0..=7).filter(|&v| every_third.writes_model(ModelVersion(v))).collect();
    assert_eq!(written, [0, 3, 6, 7], "every third version, and the run's last (7)");
    // A written version stands for itself and those given up since the previous written one.
    let stands_for = |v: i64| every_third.versions_written_by(ModelVersion(v));
    assert_eq!(stands_for(3), ModelVersion(1)..=ModelVersion(3));
    assert_eq!(stands_for(6), ModelVersion(4)..=ModelVersion(6));
    assert_eq!(stands_for(7), ModelVersion(7)..=ModelVersion(7), "the last, after 6");
    assert_eq!(stands_for(5), ModelVersion(4)..=ModelVersion(5), "a stopped run's newest");
    assert_eq!(plain.versions_written_by(ModelVersion(2)), ModelVersion(2)..=ModelVersion(2));
    for bad in [0, MAX_CHECKPOINT_INTERVAL + 1] {
        assert!(refused(with(bad)).contains("checkpoint_interval"), "{bad}");
    }
    let mut secure = with(2);
    secure["secure_aggregation"] = serde_json::json!({"clip": 0.5, "max_examples": 1});
    assert!(refused(secure).contains("secure round's records"));
    let mut private = with(2);
    private["strategy"] = serde_json::json!({"differential_privacy":
        {"noise_multiplier": 1.0, "clip_norm": 0.5, "population": 100, "delta": 1e-5}});
    assert!(refused(private).contains("DP round's noise"));
    let mut evaluation = with(2);
    evaluation["evaluation_only"] = true.into();
    assert!(refused(evaluation).contains("commits no models"));
}

/// A Krum plan over 200 000-device rounds validated before, and its first close would have
/// asked for ~320 GB; it is refused at plan time, naming the field and what fits. A plan's
/// `compression` with a field its kind lacks is refused too.
#[test]
fn plans_whose_order_statistic_cannot_fit_or_whose_compression_has_stray_fields_are_refused() {
    let mut v = plan_json();
    v["cohort_size"] = serde_json::json!(200_000);
    v["min_quorum"] = serde_json::json!(5);
    v["over_selection"] = serde_json::json!(1.0);
    v["strategy"] = serde_json::json!({"aggregation": {"kind": "krum", "byzantine": 1}});
    let err = parse(v.clone()).unwrap_err().to_string();
    assert!(err.starts_with("strategy.aggregation") && err.contains("at most"), "{err}");
    v["cohort_size"] = serde_json::json!(1_000);
    assert!(parse(v).is_ok());
    for field in ["compression", "model_download"] {
        let mut v = plan_json();
        v[field] = serde_json::json!({"kind": "f16", "fraction": 0.1});
        let err = serde_json::from_value::<Plan>(v).unwrap_err().to_string();
        assert!(err.contains("fraction"), "{field}: {err}");
    }
}

/// The training section is typed and checked when the run is created: a typo or a value of
/// the wrong type does not parse (naming the field), an out-of-range value fails validation by
/// name, and absent or `null` are the defaults devices have always trained with.
#[test]
fn training_sections_are_checked_at_plan_time() {
    let with = |training: serde_json::Value| {
        let mut plan = plan_json();
        plan["training"] = training;
        plan
    };
    for (training, names) in [
        (serde_json::json!({"fedprox_muu": 0.1}), "fedprox_muu"),
        (serde_json::json!({"fedprox_mu": "x"}), "invalid type"),
        (serde_json::json!({"optimizer": "lbfgs"}), "lbfgs"),
    ] {
        let err = serde_json::from_value::<Plan>(with(training)).unwrap_err().to_string();
        assert!(err.contains(names), "{err}");
    }
    for (training, name) in [
        (serde_json::json!({"lr": 0}), "training.lr"),
        (serde_json::json!({"epochs": 0}), "training.epochs"),
        (serde_json::json!({"batch_size": 100_000}), "training.batch_size"),
        (serde_json::json!({"fedprox_mu": -1.0}), "training.fedprox_mu"),
    ] {
        let plan: Plan = serde_json::from_value(with(training)).unwrap();
        assert!(matches!(plan.validate(), Err(PlanError::Field { field, .. }) if field == name));
    }
    let defaults = TrainingPlan::default();
    assert_eq!(parse(with(serde_json::Value::Null)).unwrap().plan().training, defaults);
    let mut absent = plan_json();
    absent.as_object_mut().unwrap().remove("training");
    assert_eq!(parse(absent).unwrap().plan().training, defaults);
    // Devices get the whole section, defaults filled in.
    let adam = parse(with(serde_json::json!({"optimizer": "adam", "lr": 0.01}))).unwrap();
    let sent = TrainingPlan::from_json(&adam.training_config_json()).unwrap();
    assert_eq!((sent.optimizer, sent.lr, sent.epochs), (LocalOptimizer::Adam, 0.01, 1));
}

/// A model of three tensors, `model.trainable` and `model.local` set as given.
fn partial_plan(
    trainable: Option<serde_json::Value>,
    local: serde_json::Value,
) -> serde_json::Value {
    let mut v = plan_json();
    v["model"]["schema"] = serde_json::json!({"tensors": [
        {"name": "body.weight", "shape": [4, 3], "dtype": "f32"},
        {"name": "body.bias", "shape": [3], "dtype": "f32"},
        {"name": "head.weight", "shape": [3, 2], "dtype": "f32"}
    ]});
    if let Some(trainable) = trainable {
        v["model"]["trainable"] = trainable;
    }
    v["model"]["local"] = local;
    v
}

#[test]
fn name_patterns_match_with_stars_anywhere() {
    for (pattern, name, expected) in [
        ("body.weight", "body.weight", true),
        ("body.weight", "body.weights", false),
        ("body.*", "body.bias", true),
        ("*.bias", "body.bias", true),
        ("*.bias", "body.bias.x", false),
        ("layers.*.lora_*", "layers.3.TransformerBlock.query.lora_a", true),
        ("*", "anything", true),
        ("a*b*a", "aba", true),
        ("a*b*a", "ab", false),
        ("*aa", "a", false),
    ] {
        assert_eq!(name_matches(pattern, name), expected, "{pattern} on {name}");
    }
}

#[test]
fn the_update_is_the_trainable_tensors_that_are_not_local() {
    let names = |p: &ValidatedPlan| -> Vec<String> {
        p.update_schema().tensors.iter().map(|t| t.name.clone()).collect()
    };
    let whole = parse(partial_plan(None, serde_json::json!([]))).unwrap();
    assert!(whole.model_parts().is_whole());
    assert_eq!(whole.update_len(), 12 + 3 + 6);

    let head_only = parse(partial_plan(Some(serde_json::json!(["head.*"])), serde_json::json!([])));
    let head_only = head_only.unwrap();
    assert_eq!(names(&head_only), ["head.weight"]);
    assert_eq!(head_only.update_len(), 6);

    let personal = parse(partial_plan(None, serde_json::json!(["head.*"]))).unwrap();
    assert_eq!(names(&personal), ["body.weight", "body.bias"]);
    assert_eq!(personal.model_parts().local(), ["head.weight"]);
    // DP and secure aggregation size themselves by the update too.
    assert_eq!(personal.update_len(), 15);

    // The update's values come out of the model and go back in its place; the rest stays.
    let model: Vec<f32> = (0..21).map(|i| i as f32).collect();
    let parts = personal.model_parts();
    assert_eq!(parts.update_of(&model), model[..15].to_vec());
    let parts = head_only.model_parts();
    assert_eq!(parts.update_of(&model), model[15..].to_vec());
    let next = parts.with_update(model.clone(), &[-1.0; 6]);
    assert_eq!(next[..15], model[..15]);
    assert_eq!(next[15..], [-1.0; 6]);
}

#[test]
fn trainable_and_local_patterns_are_checked_against_the_model() {
    let refused = |trainable: Option<serde_json::Value>, local: serde_json::Value| {
        parse(partial_plan(trainable, local)).unwrap_err().to_string()
    };
    let err = refused(Some(serde_json::json!(["head.wieght"])), serde_json::json!([]));
    assert_eq!(err, "model.trainable: pattern \"head.wieght\" matches no tensor of the model");
    let err = refused(None, serde_json::json!(["tail.*"]));
    assert_eq!(err, "model.local: pattern \"tail.*\" matches no tensor of the model");
    let err = refused(Some(serde_json::json!([])), serde_json::json!([]));
    assert_eq!(err, "model.trainable: must list at least one pattern");
    let err = refused(Some(serde_json::json!(["body.*"])), serde_json::json!(["head.*"]));
    assert_eq!(
        err,
        "model.local: head.weight is local but not trainable: a frozen tensor has nothing to keep"
    );
    let err = refused(None, serde_json::json!(["*"]));
    assert_eq!(
        err,
        "model.local: every trainable tensor is local: the run would have nothing to aggregate"
    );
    let mut v = partial_plan(Some(serde_json::json!(["head.*"])), serde_json::json!([]));
    v["evaluation_only"] = serde_json::json!(true);
    let err = parse(v).unwrap_err().to_string();
    assert!(err.starts_with("model.trainable: an evaluation-only run trains nothing"), "{err}");
}

/// A task's update schema is accepted only as a subsequence of the model's tensors.
#[test]
fn parts_rebuilt_from_a_task_need_an_update_inside_the_model() {
    let plan = parse(partial_plan(None, serde_json::json!(["head.*"]))).unwrap();
    let (schema, parts) = (plan.schema(), plan.model_parts());
    let rebuilt =
        ModelParts::of_update(schema, parts.update_schema().clone(), parts.local().to_vec());
    assert_eq!(rebuilt.as_ref(), Some(parts));
    let mut reversed = parts.update_schema().clone();
    reversed.tensors.reverse();
    assert_eq!(ModelParts::of_update(schema, reversed, vec![]), None);
    let mut foreign = parts.update_schema().clone();
    foreign.tensors[0].shape = vec![3, 4];
    assert_eq!(ModelParts::of_update(schema, foreign, vec![]), None);
}

/// A Poisson plan drawing the whole population (q = 1) was accepted; the PLD accountant then
/// panicked with a capacity overflow at the first round's close and took the coordinator's
/// driver with it. Now such a plan is refused naming the field; one whose noise multiplier is
/// too small for the PLD's grid is shown the RDP bound alone; the largest rate below 1 is
/// accepted and its ε computes.
#[test]
fn poisson_plans_the_pld_accountant_cannot_represent_are_refused_by_field() {
    let poisson = |population: u64, z: f64| {
        let mut v = plan_json();
        v["selection"] = "poisson".into();
        v["strategy"] = serde_json::json!({"differential_privacy": {
            "noise_multiplier": z, "clip_norm": 0.5, "population": population, "delta": 1e-5}});
        v
    };
    // 13 drawn per round (cohort 10, over-selection 1.3).
    let err = parse(poisson(13, 1.0)).unwrap_err().to_string();
    assert!(err.contains("strategy.differential_privacy: population"), "{err}");
    assert!(err.contains("poisson") && err.contains("selection: random"), "{err}");
    let tiny = parse(poisson(100, 1e-4)).unwrap();
    let privacy = tiny.privacy().unwrap();
    assert_eq!(privacy.epsilon_pld(3), None, "past the PLD's grid");
    assert_eq!(privacy.spent(3).epsilon(), privacy.epsilon_rdp(3), "the RDP bound stands");
    let nearly_all = parse(poisson(14, 1.0)).unwrap();
    let eps = nearly_all.privacy().unwrap().epsilon_pld(3).expect("represented");
    assert!(eps.is_finite() && eps > 0.0, "{eps}");
    // Drawing everyone at random is not Poisson sampling: q = 1 is accounted without it.
    let mut all = poisson(13, 1.0);
    all["selection"] = "random".into();
    let all = parse(all).unwrap();
    let eps = all.privacy().unwrap().epsilon_after(3);
    assert!(eps.is_finite() && eps > 0.0, "{eps}");
}

/// A run named with 10 MB was stored: names are bounded, and the refusal does not echo them.
#[test]
fn a_run_name_over_its_limit_is_refused_by_field() {
    let mut v = plan_json();
    v["name"] = "n".repeat(MAX_RUN_NAME + 1).into();
    let err = parse(v.clone()).unwrap_err().to_string();
    assert!(err.contains("name") && err.contains("257 bytes"), "{err}");
    assert!(err.len() < 200, "{err}");
    v["name"] = "n".repeat(MAX_RUN_NAME).into();
    parse(v).unwrap();
}

#[test]
fn a_tensors_model_names_only_its_tensors_and_defaults_to_a_seeded_start() {
    let mut v = plan_json();
    v["model"]["kind"] = serde_json::json!("tensors");
    v["model"].as_object_mut().unwrap().remove("init");
    let p = parse(v.clone()).unwrap();
    assert_eq!(p.plan().model.kind, Some(ModelKind::Tensors));
    assert_eq!(p.plan().model.init, InitSpec::Seeded { seed: 0 });
    assert_eq!(p.schema().tensors.len(), 2);
    // A spec is the devices' business in such a run; and the schema is all there is.
    let mut with_spec = v.clone();
    with_spec["model"]["spec"] = serde_json::json!({
        "input": {"kind": "features", "size": 3},
        "layers": [{"kind": "linear", "out": 4}]
    });
    assert!(refused(with_spec).starts_with("model.spec"));
    let mut no_schema = v;
    no_schema["model"].as_object_mut().unwrap().remove("schema");
    assert!(refused(no_schema).starts_with("model.schema"));
    // `layers` needs the spec it builds.
    let mut layers = plan_json();
    layers["model"]["kind"] = serde_json::json!("layers");
    assert!(refused(layers).starts_with("model.spec"));
    let mut unknown = plan_json();
    unknown["model"]["kind"] = serde_json::json!("onnx");
    assert!(serde_json::from_value::<Plan>(unknown).is_err());
}

#[test]
fn an_optimizers_name_is_its_plan_spelling() {
    for optimizer in [LocalOptimizer::Sgd, LocalOptimizer::Adam] {
        let spelled = serde_json::to_value(optimizer).unwrap();
        assert_eq!(spelled, serde_json::Value::String(optimizer.name().into()));
    }
}

/// `mechanism: blt_ftrl`: no population (it assumes no sampling), the participation rule
/// named and carried to the rounds, its ε known for the whole run at plan time and within a
/// budget; what its sensitivity cannot cover is refused by name.
#[test]
fn blt_ftrl_plans_carry_their_participation_rule_and_refuse_what_it_cannot_cover() {
    let mut v = plan_json();
    v["rounds"] = serde_json::json!(50);
    v["strategy"] = serde_json::json!({"differential_privacy": {"noise_multiplier": 2.0,
        "clip_norm": 1.0, "delta": 1e-5, "mechanism": "blt_ftrl", "min_separation": 10,
        "max_participations": 5}});
    let plan = parse(v.clone()).unwrap();
    let rule = plan.round_config().participation_rule.expect("the rounds enforce it");
    assert_eq!((rule.min_separation, rule.max_participations), (10, 5));
    let privacy = plan.privacy().unwrap();
    let blt = privacy.blt.expect("a blt_ftrl run");
    let mu = blt.strategy.sensitivity(&blt.schema) / 2.0;
    assert_eq!(privacy.epsilon_after(50), crate::privacy::blt::epsilon_of_gdp(mu, 1e-5));
    assert!(privacy.epsilon_after(10) < privacy.epsilon_after(50), "ε grows with the rounds");
    assert_eq!(privacy.zcdp_rho(50), Some(mu * mu / 2.0));
    // Correlated noise beats independent noise on the same rule (√5 = 2.24 of sensitivity).
    assert!(
        blt.strategy.loss(&blt.schema) < crate::privacy::blt::Blt::INDEPENDENT.loss(&blt.schema)
    );
    assert!(plan.plan().strategy.is_stateful(), "the noise buffer is kept with the model");

    let refusal = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut bad = v.clone();
        edit(&mut bad["strategy"]["differential_privacy"]);
        parse(bad).unwrap_err().to_string()
    };
    assert!(
        refusal(&|dp| dp["min_separation"] = serde_json::Value::Null)
            .contains("min_separation: is needed")
    );
    assert!(
        refusal(&|dp| dp["max_participations"] = 0.into())
            .contains("max_participations: must be at least 1")
    );
    assert!(refusal(&|dp| dp["population"] = 1000.into()).contains("population"));
    assert!(
        refusal(&|dp| dp["adaptive_clipping"] = serde_json::json!({}))
            .contains("adaptive_clipping")
    );
    assert!(refusal(&|dp| dp["epsilon_budget"] = 0.01.into()).contains("epsilon_budget"));
    let mut fedavg = v.clone();
    fedavg["strategy"]["differential_privacy"]["mechanism"] = "dp_fedavg".into();
    fedavg["strategy"]["differential_privacy"]["population"] = 1000.into();
    assert!(
        parse(fedavg)
            .unwrap_err()
            .to_string()
            .contains("min_separation: is for mechanism: blt_ftrl")
    );
    let mut poisson = v.clone();
    poisson["selection"] = "poisson".into();
    assert!(parse(poisson).is_err());
    let mut budgeted = v;
    let half = privacy.epsilon_after(25);
    budgeted["strategy"]["differential_privacy"]["epsilon_budget"] = half.into();
    let allowed = parse(budgeted).unwrap().round_config().total_rounds;
    assert!((24..=25).contains(&allowed), "{allowed} rounds within ε({half})");
}

#[test]
fn a_tokenizer_is_named_by_content_hash_for_a_model_over_tokens() {
    let hash = "ab".repeat(32);
    let tokens = serde_json::json!({
        "input": {"kind": "tokens", "vocab": 50, "length": 8},
        "layers": [{"kind": "embedding", "dim": 4}, {"kind": "last_step"}, {"kind": "linear", "out": 50}]
    });
    let with = |spec: serde_json::Value, tokenizer: &str| {
        let mut v = plan_json();
        v["model"] = serde_json::json!({"spec": spec, "tokenizer": tokenizer});
        v
    };
    let plan = parse(with(tokens.clone(), &hash)).unwrap();
    assert_eq!(plan.tokenizer(), Some(hash.as_str()));
    assert_eq!(parse(plan_json()).unwrap().tokenizer(), None);
    for bad in [&hash[..63], &hash.to_uppercase(), &format!("{}g", &hash[..63])] {
        let err = refused(with(tokens.clone(), bad));
        assert!(err.contains("model.tokenizer") && err.contains("64 lowercase hex"), "{err}");
    }
    let features = serde_json::json!({
        "input": {"kind": "features", "size": 4}, "layers": [{"kind": "linear", "out": 3}]
    });
    let err = refused(with(features, &hash));
    assert!(err.contains("model.tokenizer") && err.contains("input is tokens"), "{err}");
}
