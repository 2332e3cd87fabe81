//! Starling's end-to-end tests, in one binary: each area is a module. Every test binary links
//! burn and wgpu (hundreds of megabytes each), so one binary instead of nine saves most of the
//! link time and disk a test build costs on CI's two cores.

mod aggregator_tier;
mod app_trainer;
mod asynchronous;
mod cli;
mod compression;
mod container;
mod deploy;
mod e2e;
mod fine_tuning;
mod hardening;
mod hugging_face;
mod operator;
mod privacy;
mod production;
mod replicas;
mod resilience;
mod sdk;
mod secure;
mod strategy;
mod tidy;
mod tokenizers;
