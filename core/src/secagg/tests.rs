//! The protocol end to end in memory: exact sums under dropout at every stage, bad messages,
//! shares that do not open, Shamir, quantization; property tests over random cohorts.

use std::collections::{BTreeMap, BTreeSet};

use chacha20::cipher::StreamCipher;
use proptest::prelude::*;

use super::prg::Keystream;
use super::shamir::{self, reconstruct, reconstruct_checked, share};
use super::*;

mod malicious_server;

fn bytes<const N: usize>(seed: u64, stream: u8) -> [u8; N] {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut out = [0u8; N];
    Keystream::new(&key, stream).0.apply_keystream(&mut out);
    out
}

/// Who drops where: indices leaving after AdvertiseKeys, after ShareKeys, after sending
/// the masked input (before Unmasking), and a client sending a bad message.
#[derive(Debug, Clone, Default)]
struct Script {
    silent: BTreeSet<ClientIdx>,
    after_advertise: BTreeSet<ClientIdx>,
    after_share: BTreeSet<ClientIdx>,
    after_mask: BTreeSet<ClientIdx>,
    corrupt_share: Option<ClientIdx>,
    /// A sealed share (from, to) whose ciphertext is garbled: well-formed, but it does not
    /// open.
    garble: Option<(ClientIdx, ClientIdx)>,
    /// A sealed share (from, to) garbled after the server relayed it: the recipient cannot
    /// open it, but the server's copy opens, so the recipient's accusation is false.
    garble_relayed: Option<(ClientIdx, ClientIdx)>,
    /// A survivor (holder) that returns its share of another's (owner's) self-mask seed with
    /// one chunk shifted.
    shift_seed_share: Option<(ClientIdx, ClientIdx)>,
}

/// Client `i`'s device identity in the round drawn from `seed`.
fn identity(seed: u64, i: ClientIdx) -> DeviceIdentity {
    DeviceIdentity::from_secret(bytes(seed ^ u64::from(i) << 40, 7))
}

/// The public graph of a round where all `config.n` clients of [`run`] with `seed` advertise.
fn graph_of(config: &Config, seed: u64) -> BTreeMap<ClientIdx, BTreeSet<ClientIdx>> {
    let roster = Roster::new((1..=config.n).map(|i| (i, identity(seed, i).public())));
    neighbours(&roster, config.k, &config.session)
}

type Outcome = Result<(Vec<u32>, BTreeSet<ClientIdx>), SecAggError>;

/// Runs one round end to end in memory; the sum and survivors, and each client's input.
fn run(config: &Config, seed: u64, script: &Script) -> (Outcome, BTreeMap<ClientIdx, Vec<u32>>) {
    let (outcome, inputs, _) = run_naming(config, seed, script);
    (outcome, inputs)
}

/// [`run`], and the survivors the server found returning wrong shares.
fn run_naming(
    config: &Config,
    seed: u64,
    script: &Script,
) -> (Outcome, BTreeMap<ClientIdx, Vec<u32>>, BTreeSet<ClientIdx>) {
    let mut inconsistent = BTreeSet::new();
    let mut server = Server::new(*config).unwrap();
    let mut clients = BTreeMap::new();
    let mut inputs = BTreeMap::new();
    for i in 1..=config.n {
        let (client, advert) =
            Client::new(i, *config, identity(seed, i), bytes(seed ^ u64::from(i) << 32, 1))
                .unwrap();
        let input: Vec<u32> = (0..config.len)
            .map(|j| (u64::from(i) * 7919 + j as u64 * 104_729 + seed) as u32 % 1000)
            .collect();
        inputs.insert(i, input);
        if !script.silent.contains(&i) {
            server.receive_keys(i, advert).unwrap();
            clients.insert(i, client);
        }
    }
    let result = (|| {
        let neighbourhoods = server.close_advertise()?;
        for (i, keys) in neighbourhoods {
            if script.after_advertise.contains(&i) {
                continue;
            }
            let mut sealed = clients.get_mut(&i).unwrap().share_keys(keys)?;
            if script.corrupt_share == Some(i) {
                sealed.pop();
            }
            // A sender that seals garbage signs what it sends.
            for s in sealed.iter_mut().filter(|s| script.garble == Some((s.from, s.to))) {
                s.ciphertext[0] ^= 0xff;
                s.sign(&identity(seed, s.from), &config.session);
            }
            let _ = server.receive_shares(i, sealed);
        }
        // What each client sent, as the coordinator's store keeps it: the running sum needs a
        // withdrawn client's vector back.
        let mut sent = BTreeMap::new();
        for (i, mut request) in server.close_share_keys()? {
            if script.after_share.contains(&i) {
                continue;
            }
            for s in request.shares.iter_mut() {
                // A recipient that lies about what it got: the honest client's code, given a
                // message that does not open and bears its sender's signature.
                if script.garble_relayed == Some((s.from, s.to)) {
                    s.ciphertext[0] ^= 0xff;
                    s.sign(&identity(seed, s.from), &config.session);
                }
            }
            let client = clients.get_mut(&i).unwrap();
            let y = client.masked_input(request, &inputs[&i])?;
            match server.receive_masked(i, y.clone(), &client.accusations()) {
                Ok(()) => {
                    sent.insert(i, y);
                }
                // A false accuser's input is refused; the round goes on without it.
                Err(SecAggError::BadMessage { client, .. })
                    if script.garble_relayed.is_some_and(|(_, to)| to == client) => {}
                Err(e) => return Err(e),
            }
        }
        let check = server.close_masked()?;
        for &i in &check.survivors {
            if script.after_mask.contains(&i) {
                continue;
            }
            let signature = clients.get_mut(&i).unwrap().sign_survivors(check.clone())?;
            server.receive_signature(i, signature)?;
        }
        let request = server.close_consistency()?;
        for &i in request.signatures.keys() {
            let mut response = clients.get_mut(&i).unwrap().unmask(request.clone())?;
            if let Some((holder, owner)) = script.shift_seed_share
                && holder == i
            {
                let share = response.seed_shares.get_mut(&owner).expect("holds a share");
                share[0] = (share[0] + 1) % shamir::P;
            }
            server.receive_unmask(i, response)?;
        }
        let unmasking = server.finish()?;
        inconsistent = unmasking.inconsistent().clone();
        Ok((unmasking.sum(|j| sent.get(&j).cloned())?, unmasking.survivors().clone()))
    })();
    (result, inputs, inconsistent)
}

fn plain_sum(
    inputs: &BTreeMap<ClientIdx, Vec<u32>>,
    who: &BTreeSet<ClientIdx>,
    len: usize,
) -> Vec<u32> {
    let mut sum = vec![0u32; len];
    for i in who {
        for (s, v) in sum.iter_mut().zip(&inputs[i]) {
            *s = s.wrapping_add(*v);
        }
    }
    sum
}

#[test]
fn shamir_rebuilds_from_any_t_shares_only() {
    let secret: [u8; 32] = bytes(1, 1);
    let mut rng = Keystream::new(&bytes(2, 1), 0);
    let holders: Vec<ClientIdx> = (1..=7).collect();
    let shares = share(&secret, 4, &holders, &mut rng);
    let all: Vec<(ClientIdx, Share)> = shares.into_iter().collect();
    for start in 0..4 {
        assert_eq!(reconstruct(&all[start..start + 4]), Some(secret));
    }
    assert_ne!(reconstruct(&all[..3]), Some(secret));
}

#[test]
fn no_dropout_sums_exactly_and_the_graph_is_regular() {
    let config = Config::with_defaults([7; 16], 30, 64);
    assert!(config.k < 29 && config.k.is_multiple_of(2), "{config:?}");
    let (result, inputs) = run(&config, 3, &Script::default());
    let (sum, survivors) = result.unwrap();
    assert_eq!(survivors.len(), 30);
    assert_eq!(sum, plain_sum(&inputs, &survivors, 64));
    let graph = graph_of(&config, 3);
    let roster = Roster::new((1..=30).map(|i| (i, identity(3, i).public())));
    for (i, ns) in &graph {
        assert_eq!(ns.len(), config.k as usize);
        assert!(ns.iter().all(|j| graph[j].contains(i)), "symmetric");
        let own = graph::neighbours_of(&roster, config.k, &config.session, *i);
        assert_eq!(own.as_ref(), Some(ns), "a device's own view of the graph");
    }
    assert_eq!(graph::neighbours_of(&roster, config.k, &config.session, 31), None);
}

#[test]
fn dropouts_at_every_stage_up_to_the_threshold() {
    // 6 of the 18 in the graph drop after it is drawn; with k = 14 every neighbourhood keeps
    // at least 8 = t, wherever the dropouts sit on the ring.
    let config = Config { session: [4; 16], n: 20, k: 14, t: 8, len: 32 };
    let script = Script {
        silent: [1, 2].into(),
        after_advertise: [3, 4].into(),
        after_share: [5, 6].into(),
        after_mask: [7, 8].into(),
        ..Default::default()
    };
    let (result, inputs) = run(&config, 21, &script);
    let (sum, survivors) = result.unwrap();
    assert_eq!(survivors, (7..=20).collect());
    assert_eq!(sum, plain_sum(&inputs, &survivors, 32));
}

#[test]
fn complete_graph_is_secagg() {
    let config = Config { session: [1; 16], n: 6, k: 5, t: 3, len: 5 };
    let script = Script { after_share: [2].into(), after_mask: [5].into(), ..Default::default() };
    let (result, inputs) = run(&config, 11, &script);
    let (sum, survivors) = result.unwrap();
    assert_eq!(survivors, [1, 3, 4, 5, 6].into());
    assert_eq!(sum, plain_sum(&inputs, &survivors, 5));
}

#[test]
fn a_bad_share_message_excludes_only_its_sender() {
    let config = Config::with_defaults([2; 16], 12, 8);
    let script = Script { corrupt_share: Some(4), ..Default::default() };
    let (result, inputs) = run(&config, 5, &script);
    let (sum, survivors) = result.unwrap();
    assert!(!survivors.contains(&4));
    assert_eq!(survivors.len(), 11);
    assert_eq!(sum, plain_sum(&inputs, &survivors, 8));
}

/// A client that seals an undecryptable share to one neighbour left that
/// neighbour without their pairwise mask while the server assumed it cancelled, and the
/// round committed a random sum. The neighbour now reports the share it could not open,
/// and the server leaves the sender out: the sum is the honest survivors' exactly.
#[test]
fn a_share_that_does_not_open_excludes_its_sender_not_the_sum() {
    for (config, seed) in [
        (Config::with_defaults([6; 16], 12, 8), 5),
        (Config { session: [6; 16], n: 7, k: 6, t: 4, len: 8 }, 9),
    ] {
        let from = 3;
        // The same graph the server draws: the public one on the identities of `run`'s clients.
        let to = *graph_of(&config, seed)[&from].iter().next().unwrap();
        let script = Script { garble: Some((from, to)), ..Default::default() };
        let (result, inputs) = run(&config, seed, &script);
        let (sum, survivors) = result.unwrap();
        assert!(!survivors.contains(&from), "the sender is left out");
        assert!(survivors.contains(&to), "the neighbour that reported it stays in");
        assert_eq!(survivors.len() as u32, config.n - 1);
        assert_eq!(sum, plain_sum(&inputs, &survivors, config.len));
    }
    // With dropouts on top, the round still sums exactly or fails cleanly.
    let config = Config { session: [8; 16], n: 9, k: 4, t: 3, len: 6 };
    let script = Script { garble: Some((2, 3)), after_mask: [5].into(), ..Default::default() };
    match run(&config, 4, &script) {
        (Ok((sum, survivors)), inputs) => {
            assert!(!survivors.contains(&2));
            assert_eq!(sum, plain_sum(&inputs, &survivors, 6));
        }
        (Err(e), _) => assert!(matches!(e, SecAggError::BelowThreshold { .. }), "{e}"),
    }
}

/// A round of six at MaskedInputCollection in which client 2's sealed shares to client 1 were
/// garbled on the way (so 1 cannot open them), with every client's mask request.
fn collecting_with_a_garbled_share()
-> (Server, BTreeMap<ClientIdx, Client>, BTreeMap<ClientIdx, MaskRequest>) {
    let config = Config { session: [2; 16], n: 6, k: 4, t: 3, len: 4 };
    let mut server = Server::new(config).unwrap();
    let mut clients = BTreeMap::new();
    for i in 1..=6 {
        let (client, advert) =
            Client::new(i, config, identity(1, i), bytes(u64::from(i), 1)).unwrap();
        server.receive_keys(i, advert).unwrap();
        clients.insert(i, client);
    }
    let graph = server.close_advertise().unwrap();
    assert!(graph[&1].keys.contains_key(&2), "the test needs 1 and 2 to be neighbours");
    for (i, keys) in graph {
        let mut sealed = clients.get_mut(&i).unwrap().share_keys(keys).unwrap();
        for s in sealed.iter_mut().filter(|s| (s.from, s.to) == (2, 1)) {
            s.ciphertext[0] ^= 0xff;
            s.sign(&identity(1, 2), &config.session);
        }
        server.receive_shares(i, sealed).unwrap();
    }
    let requests = server.close_share_keys().unwrap();
    (server, clients, requests)
}

/// What a test does to a client's accusations before the server sees them.
type Tamper = dyn Fn(&mut Vec<Accusation>);

/// An accusation removes a neighbour only with evidence the server checks itself: the proven
/// channel point of the two, under which the relayed shares do not open. Accusing a client
/// that sent no shares, revealing a point the proof does not cover, or tampering with the
/// proof gets the accuser's input refused (and the accuser excluded); the accused stays.
#[test]
fn an_accusation_without_evidence_is_refused_and_one_with_it_holds() {
    let accuse = |tamper: &Tamper| {
        let (mut server, mut clients, mut requests) = collecting_with_a_garbled_share();
        let client = clients.get_mut(&1).unwrap();
        client.masked_input(requests.remove(&1).unwrap(), &[0; 4]).unwrap();
        let mut accusations = client.accusations();
        assert_eq!(accusations.iter().map(|a| a.accused).collect::<Vec<_>>(), [2]);
        tamper(&mut accusations);
        let result = server.receive_masked(1, vec![0; 4], &accusations);
        (result, server)
    };
    // The honest accusation holds.
    let (result, server) = accuse(&|_| {});
    result.unwrap();
    assert!(server.accused().contains(&2) && server.excluded().is_empty());
    // Evidence that does not hold: each refused, the accuser excluded, no one accused.
    let cases: [(&str, &Tamper); 4] = [
        ("a client that sent no shares", &|a| a[0].accused = 1),
        ("the same neighbour twice", &|a| a.push(a[0])),
        ("a tampered proof", &|a| a[0].proof.response[5] ^= 1),
        ("another point", &|a| a[0].shared = crate::secagg::channel::tests::some_point()),
    ];
    for (what, tamper) in cases {
        let (result, server) = accuse(tamper);
        let err = result.unwrap_err();
        assert!(matches!(err, SecAggError::BadMessage { client: 1, .. }), "{what}: {err}");
        assert!(server.excluded().contains(&1), "{what}");
        assert!(server.accused().is_empty(), "{what}");
    }
}

/// A client that accuses a neighbour whose shares do open (here the relay garbled them on the
/// way to it, which the server, holding what it relayed, can tell) is the one left out: the
/// accused stays in the sum, and the sum is the others' exactly.
#[test]
fn a_false_accusation_leaves_out_the_accuser_not_the_accused() {
    let config = Config { session: [5; 16], n: 8, k: 6, t: 4, len: 6 };
    let seed = 11;
    let graph = graph_of(&config, seed);
    let (from, to) = (3, *graph[&3].iter().next().unwrap());
    let script = Script { garble_relayed: Some((from, to)), ..Default::default() };
    let (result, inputs) = run(&config, seed, &script);
    let (sum, survivors) = result.unwrap();
    assert!(survivors.contains(&from), "the accused stays in");
    assert!(!survivors.contains(&to), "the false accuser is left out");
    assert_eq!(survivors.len() as u32, config.n - 1);
    assert_eq!(sum, plain_sum(&inputs, &survivors, config.len));
}

#[test]
fn dropout_beyond_the_threshold_fails_cleanly() {
    let config = Config { session: [3; 16], n: 8, k: 4, t: 3, len: 4 };
    // Everyone but two leaves after sharing: too few masked inputs.
    let script = Script { after_share: (3..=8).collect(), ..Default::default() };
    let (result, _) = run(&config, 1, &script);
    assert!(matches!(result, Err(SecAggError::BelowThreshold { .. })), "{result:?}");
}

#[test]
fn weighted_fedavg_through_the_ring() {
    let n = 50;
    let q = Quantizer::for_cohort(1.0, n);
    let deltas: Vec<Vec<f32>> = (0..n)
        .map(|i| (0..10).map(|j| ((i * 13 + j * 7) % 19) as f32 / 10.0 - 0.9).collect())
        .collect();
    let counts: Vec<u64> = (0..n).map(|i| 10 + u64::from(i) % 40).collect();
    let mut sum = vec![0u32; 11];
    for (d, &c) in deltas.iter().zip(&counts) {
        for (s, v) in sum.iter_mut().zip(encode_weighted(&q, d, c, 100)) {
            *s = s.wrapping_add(v);
        }
    }
    let mean = decode_weighted_mean(&q, &sum, n).unwrap();
    let total: f64 = counts.iter().map(|&c| c as f64).sum();
    for j in 0..10 {
        let exact: f64 =
            deltas.iter().zip(&counts).map(|(d, &c)| f64::from(d[j]) * c as f64).sum::<f64>()
                / total;
        // n values each off by half a step, over a total weight of at least n·0.1.
        assert!((mean[j] - exact).abs() < 1e-4, "{j}: {} vs {exact}", mean[j]);
    }
}

/// Secure runs sent per-device evaluation reports in clear. The evaluation now
/// rides in the masked vector, and the server decodes only the cohort's pooled means.
#[test]
fn evaluation_pools_through_the_ring() {
    let n = 40;
    let q = Quantizer::for_cohort(1.0, n);
    let mut sum = [0u32; 2 + EVALUATION_ENTRIES];
    let (mut examples, mut correct, mut loss_sum) = (0.0, 0.0, 0.0);
    for i in 0..n {
        let mut v = encode_weighted(&q, &[0.5], 10, 100);
        let ev = (!i.is_multiple_of(4)).then(|| EvaluationInput {
            examples: 5 + u64::from(i) % 30,
            accuracy: f64::from(i % 10) / 10.0,
            loss: 0.2 + f64::from(i) / 20.0,
        });
        if let Some(ev) = ev {
            examples += ev.examples as f64;
            correct += ev.examples as f64 * ev.accuracy;
            loss_sum += ev.examples as f64 * ev.loss;
        }
        append_evaluation(&q, &mut v, ev, 100, SECURE_LOSS_CAP);
        for (s, x) in sum.iter_mut().zip(v) {
            *s = s.wrapping_add(x);
        }
    }
    let (weight, accuracy, loss) =
        decode_evaluation(&q, &sum[2..], n, 100, SECURE_LOSS_CAP).unwrap();
    assert!((weight - examples).abs() < 0.01, "{weight} vs {examples}");
    assert!((accuracy - correct / examples).abs() < 1e-5, "{accuracy}");
    assert!((loss - loss_sum / examples).abs() < 1e-3, "{loss}");
    let mean = decode_weighted_mean(&q, &sum[..2], n).unwrap();
    assert!((mean[0] - 0.5).abs() < 1e-5);
    // Nobody evaluated: no pooled evaluation, not a 0 % one.
    let mut nobody = [0u32; EVALUATION_ENTRIES];
    for _ in 0..n {
        let mut v = vec![];
        append_evaluation(&q, &mut v, None, 100, SECURE_LOSS_CAP);
        for (s, x) in nobody.iter_mut().zip(v) {
            *s = s.wrapping_add(x);
        }
    }
    assert_eq!(decode_evaluation(&q, &nobody, n, 100, SECURE_LOSS_CAP), None);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// For random cohorts, graphs and dropout at every stage: the round either succeeds
    /// with exactly the survivors' sum, or (too many dropped) fails as below threshold.
    #[test]
    fn unmasked_sum_is_the_plaintext_sum(
        n in 4u32..24,
        k_half in 1u32..6,
        seed in any::<u64>(),
        drops in proptest::collection::vec((1u32..24, 0u8..4), 0..8),
    ) {
        let k = (2 * k_half).min(n - 1);
        let config = Config { session: [9; 16], n, k, t: k / 2 + 1, len: 16 };
        let mut script = Script::default();
        for (i, stage) in drops {
            let i = (i - 1) % n + 1;
            match stage {
                0 => script.silent.insert(i),
                1 => script.after_advertise.insert(i),
                2 => script.after_share.insert(i),
                _ => script.after_mask.insert(i),
            };
        }
        let (result, inputs) = run(&config, seed, &script);
        match result {
            Ok((sum, survivors)) => {
                prop_assert_eq!(&sum, &plain_sum(&inputs, &survivors, 16));
                prop_assert!(survivors.iter().all(|i| !script.silent.contains(i) && !script.after_advertise.contains(i) && !script.after_share.contains(i)));
            }
            Err(SecAggError::BelowThreshold { .. }) => {
                prop_assert!(!script.silent.is_empty() || !script.after_advertise.is_empty() || !script.after_share.is_empty() || !script.after_mask.is_empty());
            }
            Err(e) => prop_assert!(false, "unexpected failure {e}"),
        }
    }
}

/// A holder returning a wrong share of a survivor's self-mask seed made the sum noise that
/// committed. Each seed now must match its owner's commitment: with a spare share the holder
/// is named and left out and the sum is exact; with exactly `t` shares the round fails.
#[test]
fn a_wrong_seed_share_is_named_with_spares_and_fails_the_round_without() {
    let config = Config { session: [3; 16], n: 5, k: 4, t: 3, len: 16 };
    let liar = Script { shift_seed_share: Some((2, 1)), ..Script::default() };
    let (outcome, inputs, inconsistent) = run_naming(&config, 21, &liar);
    let (sum, survivors) = outcome.expect("four shares of each seed: one to spare");
    assert_eq!(sum, plain_sum(&inputs, &survivors, config.len));
    assert_eq!(inconsistent, BTreeSet::from([2]));

    // Client 5 leaves before Unmasking: client 1's seed has exactly t = 3 shares left.
    let no_spare = Script { after_mask: BTreeSet::from([5]), ..liar };
    let (outcome, ..) = run_naming(&config, 21, &no_spare);
    match outcome {
        Err(SecAggError::BadMessage { client: 1, why }) => assert!(why.contains("commitment")),
        other => panic!("a seed rebuilt from a wrong share must fail the round: {other:?}"),
    }
    // The same departure with honest shares sums exactly.
    let honest = Script { after_mask: BTreeSet::from([5]), ..Script::default() };
    let (outcome, inputs) = run(&config, 21, &honest);
    let (sum, survivors) = outcome.unwrap();
    assert_eq!(sum, plain_sum(&inputs, &survivors, config.len));
}

#[test]
fn checked_rebuilds_name_the_one_wrong_share_among_spares() {
    let secret = bytes::<32>(5, 2);
    let holders: Vec<ClientIdx> = (1..=6).collect();
    let shares = share(&secret, 3, &holders, &mut Keystream::new(&bytes(6, 1), 1));
    let accept = |s: &[u8; 32]| *s == secret;
    for liar in 1..=6 {
        let mut given: Vec<(ClientIdx, shamir::Share)> = shares.clone().into_iter().collect();
        given[liar as usize - 1].1[2] ^= 1;
        let rebuilt = reconstruct_checked(&given, 3, accept).expect("one wrong share of six");
        assert_eq!((rebuilt.secret, rebuilt.inconsistent), (secret, vec![liar]));
        // Without spares the wrong share cannot be outvoted: nothing is rebuilt.
        let exact: Vec<_> =
            given.iter().copied().filter(|(x, _)| *x <= 3 || *x == liar).take(3).collect();
        if exact.iter().any(|(x, _)| *x == liar) {
            assert_eq!(reconstruct_checked(&exact, 3, accept), None);
        }
    }
    assert_eq!(
        reconstruct_checked(&shares.into_iter().take(2).collect::<Vec<_>>(), 3, accept),
        None
    );
}
