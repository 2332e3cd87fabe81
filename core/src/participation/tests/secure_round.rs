//! A secure round from one device's side, against a real SecAgg+ server and two other real
//! clients: the key stages before training, the masked input, signature and unmasking after;
//! the unmasked sum holds this device's delta.

use std::collections::BTreeMap;

use super::*;
use crate::secagg::{self, Client, Config, Server};
use crate::wire::SecureAggregationTask;

const DELTA_LEN: usize = 3;

/// The session of [`task`]'s round, which the device checks the coordinator's config against.
fn session() -> [u8; 16] {
    let t = task();
    crate::round::secure::session_id(t.run_id, t.round_idx, t.model_version)
}

fn config() -> Config {
    Config::with_defaults(session(), 3, DELTA_LEN + 1)
}

fn secure_task(index: secagg::ClientIdx) -> SecureAggregationTask {
    SecureAggregationTask {
        config: config(),
        index,
        clip: 4.0,
        max_examples: 10,
        clip_norm: None,
        distributed_noise: None,
        evaluation_loss_cap: None,
    }
}

/// Clients 2..=n of the round `config`, as plain SecAgg+ clients, their keys with `server`.
fn others(server: &mut Server, config: Config) -> BTreeMap<secagg::ClientIdx, Client> {
    (2..=config.n)
        .map(|i| {
            let identity = DeviceIdentity::from_secret([i as u8; 32]);
            let (client, keys) = Client::new(i, config, identity, [i as u8 + 40; 96]).unwrap();
            server.receive_keys(i, keys).unwrap();
            (i, client)
        })
        .collect()
}

/// The last message the device sent.
fn sent(t: &mut Trace) -> SecAggUpload {
    t.sent.take().expect("the device sent a message")
}

#[test]
fn a_secure_round_shares_keys_before_training_and_masks_after() {
    let mut server = Server::new(config()).unwrap();
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { secure_aggregation: Some(secure_task(1)), ..task() }).conditions();
    let SecAggUpload::AdvertiseKeys(keys) = sent(&mut t) else { panic!("keys first") };
    server.receive_keys(1, keys).unwrap();
    let mut others = others(&mut server, config());
    t.event(Event::SecureSent);
    // The stage is still collecting: the device asks again when told.
    t.event(Event::Instruction(SecAggInstruction::Wait { retry_after_ms: 200 }));
    t.at(1_200).event(Event::Woke);

    let mut neighbourhoods = server.close_advertise().unwrap();
    t.event(Event::Instruction(SecAggInstruction::ShareKeys(neighbourhoods.remove(&1).unwrap())));
    let SecAggUpload::ShareKeys(sealed) = sent(&mut t) else { panic!("shares") };
    server.receive_shares(1, sealed).unwrap();
    for (i, keys) in neighbourhoods {
        server.receive_shares(i, others.get_mut(&i).unwrap().share_keys(keys).unwrap()).unwrap();
    }
    t.event(Event::SecureSent).model(&[1.0, 2.0, 3.0]).conditions();
    t.event(Event::Evaluated(Some(evaluation()))).conditions().train(&[1.5, 1.0, 3.25]);

    let mut requests = server.close_share_keys().unwrap();
    t.event(Event::Instruction(SecAggInstruction::MaskedInput(requests.remove(&1).unwrap())));
    let SecAggUpload::MaskedInput { masked, accusations, .. } = sent(&mut t) else { panic!() };
    let to_u32 =
        |b: &[u8]| b.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    let mut inputs: BTreeMap<_, Vec<u32>> = BTreeMap::from([(1, to_u32(&masked))]);
    server.receive_masked(1, inputs[&1].clone(), &accusations).unwrap();
    let q = secure_task(1).quantizer();
    for (i, request) in requests {
        let zero = secagg::encode_weighted(&q, &[0.0; DELTA_LEN], 10, 10);
        let y = others.get_mut(&i).unwrap().masked_input(request, &zero).unwrap();
        server.receive_masked(i, y.clone(), &[]).unwrap();
        inputs.insert(i, y);
    }

    let check = server.close_masked().unwrap();
    t.event(Event::SecureSent)
        .event(Event::Instruction(SecAggInstruction::SignSurvivors(check.clone())));
    let SecAggUpload::SignSurvivors(signature) = sent(&mut t) else { panic!() };
    server.receive_signature(1, signature).unwrap();
    for (i, client) in others.iter_mut() {
        server.receive_signature(*i, client.sign_survivors(check.clone()).unwrap()).unwrap();
    }
    let unmask = server.close_consistency().unwrap();
    t.event(Event::SecureSent).event(Event::Instruction(SecAggInstruction::Unmask(unmask.clone())));
    let SecAggUpload::Unmask(response) = sent(&mut t) else { panic!() };
    server.receive_unmask(1, response).unwrap();
    for (i, client) in others.iter_mut() {
        server.receive_unmask(*i, client.unmask(unmask.clone()).unwrap()).unwrap();
    }
    t.event(Event::SecureSent);
    let state = t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: true, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          SecureSend(AdvertiseKeys)
        t=1000 SecureSent
          SecurePoll
        t=1000 Instruction(wait)
          WaitUntil(1200)
        t=1200 Woke
          SecurePoll
        t=1200 Instruction(ShareKeys)
          SecureSend(ShareKeys to [2, 3])
        t=1200 SecureSent
          Progress(Downloading)
          FetchModel(m0)
        t=1200 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1200 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 3.0] }
        t=1200 Evaluated(Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }))
          ReadConditions
        t=1200 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 3.0], trains: None, deadline: 60000, encoding: None }
        t=1200 Trained { loss: 0.25, examples: 10, delta: [0.5, -1.0, 0.25], encoded: None }
          Progress(Uploading)
          SecurePoll
        t=1200 Instruction(MaskedInput)
          SecureSend(MaskedInput { version: 0, 4 entries, 0 accused })
        t=1200 SecureSent
          SecurePoll
        t=1200 Instruction(SignSurvivors)
          SecureSend(SignSurvivors)
        t=1200 SecureSent
          SecurePoll
        t=1200 Instruction(Unmask)
          SecureSend(Unmask)
        t=1200 SecureSent
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }) }))"#]]);
    assert_eq!(state.pending_upload, None, "a masked update is never kept");

    // The coordinator learns the cohort's mean, which carries this device's delta.
    let sum = server.finish().unwrap().sum(|i| inputs.get(&i).cloned()).unwrap();
    let mean = secagg::decode_weighted_mean(&q, &sum, 3).unwrap();
    let expected = [0.5 / 3.0, -1.0 / 3.0, 0.25 / 3.0];
    for (got, want) in mean.iter().zip(expected) {
        assert!((got - want).abs() < 1e-3, "mean {mean:?}, expected {expected:?}");
    }
}

#[test]
fn a_device_left_out_of_the_secure_round_misses_it() {
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { secure_aggregation: Some(secure_task(1)), ..task() }).conditions();
    t.event(Event::SecureSent);
    t.event(Event::Instruction(SecAggInstruction::Excluded { reason: "too slow".into() }));
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: true, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          SecureSend(AdvertiseKeys)
        t=1000 SecureSent
          SecurePoll
        t=1000 Instruction(excluded)
          Notice(Excluded("too slow"))
          Finish(Ok(RoundMissed { run_id: RunId(1), round_idx: RoundIdx(0) }))"#]]);
}

#[test]
fn a_coordinator_asking_for_the_wrong_stage_gets_nothing() {
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { secure_aggregation: Some(secure_task(1)), ..task() }).conditions();
    t.event(Event::SecureSent).event(Event::Instruction(SecAggInstruction::Done));
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: true, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          SecureSend(AdvertiseKeys)
        t=1000 SecureSent
          SecurePoll
        t=1000 Instruction(done)
          Finish(Err(Secure(OutOfStep { want: "ShareKeys", got: "done" })))"#]]);
}

#[test]
fn a_device_without_an_identity_key_cannot_join_a_secure_round() {
    let mut t = Trace::start(ParticipantState { identity: None, ..enrolled() });
    t.task(TaskAssignment { secure_aggregation: Some(secure_task(1)), ..task() }).conditions();
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: true, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Finish(Err(Secure(NoIdentity)))"#]]);
}

/// Distributed DP: the device clips, rotates, rounds and noises its delta itself before
/// masking (its input is the rotation's padded length), and its noise counts on the sums of at
/// least `min_survivors` devices: a coordinator that leaves a survivor out of the sum it asks
/// the device to sign gets no signature, so it never unmasks a sum with less noise than the ε
/// shown assumes, though the protocol's threshold alone would allow it.
#[test]
fn a_distributed_dp_device_noises_its_input_and_signs_no_smaller_sum() {
    let noise = crate::privacy::DistributedNoise::for_plan(1.0, 1.0, DELTA_LEN, 4, 4).unwrap();
    let config = Config::with_defaults(session(), 4, noise.padded_len());
    let task = SecureAggregationTask { config, distributed_noise: Some(noise), ..secure_task(1) };
    let mut server = Server::new(config).unwrap();
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { secure_aggregation: Some(task), ..super::task() }).conditions();
    let SecAggUpload::AdvertiseKeys(keys) = sent(&mut t) else { panic!("keys first") };
    server.receive_keys(1, keys).unwrap();
    let mut others = others(&mut server, config);
    let mut neighbourhoods = server.close_advertise().unwrap();
    t.event(Event::SecureSent);
    t.event(Event::Instruction(SecAggInstruction::ShareKeys(neighbourhoods.remove(&1).unwrap())));
    let SecAggUpload::ShareKeys(sealed) = sent(&mut t) else { panic!("shares") };
    server.receive_shares(1, sealed).unwrap();
    for (i, keys) in neighbourhoods {
        server.receive_shares(i, others.get_mut(&i).unwrap().share_keys(keys).unwrap()).unwrap();
    }
    t.event(Event::SecureSent).model(&[1.0, 2.0, 3.0]).conditions();
    t.event(Event::Evaluated(None)).conditions().train(&[1.5, 1.0, 3.25]);
    let mut requests = server.close_share_keys().unwrap();
    t.event(Event::Instruction(SecAggInstruction::MaskedInput(requests.remove(&1).unwrap())));
    let SecAggUpload::MaskedInput { masked, accusations, .. } = sent(&mut t) else { panic!() };
    let y = masked.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    server.receive_masked(1, y, &accusations).unwrap();
    // Devices 2 and 3 send their inputs; device 4's never arrives (or is left out).
    for i in [2, 3] {
        let request = requests.remove(&i).unwrap();
        let y = others.get_mut(&i).unwrap().masked_input(request, &vec![0; config.len]).unwrap();
        server.receive_masked(i, y, &[]).unwrap();
    }
    let check = server.close_masked().unwrap();
    assert!(check.survivors.len() >= config.t as usize, "the threshold alone would allow it");
    t.event(Event::SecureSent).event(Event::Instruction(SecAggInstruction::SignSurvivors(check)));
    let state = t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: true, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          SecureSend(AdvertiseKeys)
        t=1000 SecureSent
          SecurePoll
        t=1000 Instruction(ShareKeys)
          SecureSend(ShareKeys to [2, 3, 4])
        t=1000 SecureSent
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 3.0] }
        t=1000 Evaluated(None)
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 3.0], trains: None, deadline: 60000, encoding: None }
        t=1000 Trained { loss: 0.25, examples: 10, delta: [0.5, -1.0, 0.25], encoded: None }
          Progress(Uploading)
          SecurePoll
        t=1000 Instruction(MaskedInput)
          SecureSend(MaskedInput { version: 0, 4 entries, 0 accused })
        t=1000 SecureSent
          SecurePoll
        t=1000 Instruction(SignSurvivors)
          Finish(Err(Secure(Secagg(BelowThreshold { stage: "ConsistencyCheck", have: 3, need: 4 }))))"#]]);
    assert_eq!(state.pending_upload, None);
}

/// The session orders the ring of neighbours, so a coordinator free to pick it could try
/// sessions until a device's neighbourhood were its own devices. The device derives it from
/// the run, round and model version of its task and refuses any other before advertising.
#[test]
fn a_session_the_coordinator_picked_is_refused_before_anything_is_sent() {
    let mut t = Trace::start(enrolled());
    let picked = Config { session: [9; 16], ..config() };
    let secure = SecureAggregationTask { config: picked, ..secure_task(1) };
    t.task(TaskAssignment { secure_aggregation: Some(secure), ..task() }).conditions();
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: true, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Finish(Err(Secure(Secagg(BadMessage { client: 0, why: "the round's session is not the one derived from its run, round and model version" }))))"#]]);
}
