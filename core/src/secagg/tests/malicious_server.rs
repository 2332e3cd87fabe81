//! A malicious server against honest devices: it substitutes or replays key advertisements,
//! claims a survivor dropped to get both of its secrets, or shows different survivor sets to
//! different devices. Each time the honest devices refuse, and the server ends up with fewer
//! than `t` shares of any secret that would reveal one device's input.

use super::*;

const N: u32 = 7;

/// A complete-graph round of seven (t = 4): SecAgg, where the threshold is over the cohort.
fn config(session: u8) -> Config {
    Config { session: [session; 16], n: N, k: N - 1, t: 4, len: 4 }
}

/// Seven honest clients at the end of MaskedInputCollection, and who survived it.
struct Collected {
    clients: BTreeMap<ClientIdx, Client>,
    survivors: BTreeSet<ClientIdx>,
}

fn advertised(config: Config, seed: u64) -> (Server, BTreeMap<ClientIdx, Client>) {
    let mut server = Server::new(config).unwrap();
    let mut clients = BTreeMap::new();
    for i in 1..=config.n {
        let (client, advert) =
            Client::new(i, config, identity(seed, i), bytes(seed ^ u64::from(i) << 32, 1)).unwrap();
        server.receive_keys(i, advert).unwrap();
        clients.insert(i, client);
    }
    (server, clients)
}

fn collected(seed: u64) -> Collected {
    let (mut server, mut clients) = advertised(config(1), seed);
    for (i, keys) in server.close_advertise().unwrap() {
        let sealed = clients.get_mut(&i).unwrap().share_keys(keys).unwrap();
        server.receive_shares(i, sealed).unwrap();
    }
    for (i, request) in server.close_share_keys().unwrap() {
        let client = clients.get_mut(&i).unwrap();
        let y = client.masked_input(request, &[i; 4]).unwrap();
        server.receive_masked(i, y, &[]).unwrap();
    }
    let survivors = server.close_masked().unwrap().survivors;
    Collected { clients, survivors }
}

impl Collected {
    /// Shows `survivors` to `devices` and collects their signatures over it.
    fn signatures(
        &mut self,
        devices: impl IntoIterator<Item = ClientIdx>,
        survivors: &BTreeSet<ClientIdx>,
    ) -> BTreeMap<ClientIdx, Signature> {
        let request = ConsistencyRequest { survivors: survivors.clone() };
        devices
            .into_iter()
            .map(|i| {
                (i, self.clients.get_mut(&i).unwrap().sign_survivors(request.clone()).unwrap())
            })
            .collect()
    }

    /// Asks `devices` to unmask for `request`: the responses of those that did not refuse.
    fn unmask(
        &mut self,
        devices: impl IntoIterator<Item = ClientIdx>,
        request: &UnmaskRequest,
    ) -> Vec<Result<UnmaskResponse, SecAggError>> {
        devices
            .into_iter()
            .map(|i| self.clients.get_mut(&i).unwrap().unmask(request.clone()))
            .collect()
    }
}

/// How many shares of `owner`'s self-mask seed and of its mask key the server gathered.
fn gathered(responses: &[UnmaskResponse], owner: ClientIdx) -> (usize, usize) {
    let seeds = responses.iter().filter(|r| r.seed_shares.contains_key(&owner)).count();
    let keys = responses.iter().filter(|r| r.key_shares.contains_key(&owner)).count();
    (seeds, keys)
}

fn refused_by_every_device(results: Vec<Result<UnmaskResponse, SecAggError>>) -> bool {
    results.iter().all(|r| r.is_err())
}

/// How the server swaps a part of an advertisement for its own.
type Substitute = fn(&mut AdvertiseKeys, &AdvertiseKeys);

/// A server that swaps a neighbour's mask or channel key for one of its own (to sit in the
/// middle of a channel, or to learn a pairwise mask) is caught by the signature: the device
/// refuses the whole neighbourhood and seals nothing. An honest server refuses such an
/// advertisement from a device too.
#[test]
fn a_substituted_public_key_is_refused_before_anything_is_shared() {
    let (mut server, mut clients) = advertised(config(2), 3);
    let graph = server.close_advertise().unwrap();
    let substitutions: [(&str, Substitute); 3] = [
        ("mask key", |k, m| k.mask_pk = m.mask_pk),
        ("channel key", |k, m| k.cipher_pk = m.cipher_pk),
        ("seed commitment", |k, m| k.seed_commitment = m.seed_commitment),
    ];
    // Keys the server made for itself.
    let (_, servers_keys) = Client::new(2, config(2), identity(99, 2), bytes(99, 1)).unwrap();
    for (what, substitute) in substitutions {
        let mut keys = graph[&1].clone();
        substitute(keys.keys.get_mut(&2).unwrap(), &servers_keys);
        let mut victim =
            Client::new(1, config(2), identity(3, 1), bytes(3 ^ 1 << 32, 1)).unwrap().0;
        let err = victim.share_keys(keys).unwrap_err();
        assert!(err.to_string().contains("not signed by its identity"), "{what}: {err}");
    }
    // The real neighbourhood is accepted by the same client.
    clients.get_mut(&1).unwrap().share_keys(graph[&1].clone()).unwrap();
    // A device whose advertisement was altered on its way in is refused by an honest server.
    let mut fresh = Server::new(config(2)).unwrap();
    let (_, mut advert) = Client::new(1, config(2), identity(3, 1), bytes(5, 1)).unwrap();
    advert.mask_pk = servers_keys.mask_pk;
    assert!(matches!(
        fresh.receive_keys(1, advert),
        Err(SecAggError::BadMessage { client: 1, .. })
    ));
}

/// Advertisements are bound to the round and the seat: the server cannot replay a device's
/// keys from an earlier round (whose secrets it may have learned since), nor present one
/// device's keys in another's seat, nor seat one identity twice.
#[test]
fn an_advertisement_replayed_from_another_round_or_seat_is_refused() {
    let (mut earlier, _) = advertised(config(3), 4);
    let earlier_graph = earlier.close_advertise().unwrap();
    let (mut server, _) = advertised(config(4), 4);
    let graph = server.close_advertise().unwrap();
    let victim = || Client::new(1, config(4), identity(4, 1), bytes(4 ^ 1 << 32, 1)).unwrap().0;

    let mut replayed = graph[&1].clone();
    replayed.keys.insert(2, earlier_graph[&1].keys[&2]);
    let err = victim().share_keys(replayed).unwrap_err();
    assert!(err.to_string().contains("neighbour 2's keys are not signed"), "{err}");

    // Reseated: the roster names another identity at that seat; a roster rewritten to match
    // either repeats an identity or leaves the keys signed for another seat.
    let mut reseated = graph[&1].clone();
    reseated.keys.insert(3, graph[&1].keys[&2]);
    let err = victim().share_keys(reseated.clone()).unwrap_err();
    assert!(err.to_string().contains("identity is not the roster's"), "{err}");
    let rewritten = |drop_two: bool| {
        let identities = reseated.roster.iter().map(|(i, id)| match i {
            3 => (3, reseated.keys[&3].identity),
            _ => (i, *id),
        });
        Roster::new(identities.filter(|(i, _)| !(drop_two && *i == 2)))
    };
    for drop_two in [false, true] {
        let mut reseated = reseated.clone();
        reseated.roster = std::sync::Arc::new(rewritten(drop_two));
        reseated.keys.remove(&2).filter(|_| !drop_two).map(|k| reseated.keys.insert(2, k));
        assert!(victim().share_keys(reseated).is_err(), "roster rewritten, 2 dropped: {drop_two}");
    }

    // An honest server refuses the replay too.
    let mut fresh = Server::new(config(4)).unwrap();
    assert!(fresh.receive_keys(2, earlier_graph[&1].keys[&2]).is_err());
    // And two seats for one identity, even with each advertisement signed for its own seat.
    let mut twice = Server::new(config(4)).unwrap();
    let (_, first) = Client::new(1, config(4), identity(4, 1), bytes(6, 1)).unwrap();
    let (_, second) = Client::new(2, config(4), identity(4, 1), bytes(7, 1)).unwrap();
    twice.receive_keys(1, first).unwrap();
    assert!(twice.receive_keys(2, second).is_err());
}

/// The server holds every masked input and claims that survivor 7 dropped, to get its mask
/// key's shares (which strip its pairwise masks), then asks again with 7 among the survivors
/// for its self-mask seed's. Every device unmasks once, for the one set it signed: the server
/// gets the key shares and no seed share, and 7's input stays behind its self mask.
#[test]
fn a_survivor_claimed_dropped_cannot_also_be_claimed_alive() {
    let mut round = collected(5);
    let everyone = round.survivors.clone();
    let mut without_7 = everyone.clone();
    without_7.remove(&7);
    let signatures = round.signatures(1..=6, &without_7);
    let claimed_dropped = UnmaskRequest { survivors: without_7, signatures };
    let responses: Vec<_> =
        round.unmask(1..=6, &claimed_dropped).into_iter().map(Result::unwrap).collect();
    assert_eq!(gathered(&responses, 7), (0, 6), "7's key shares, as for any dropout");

    // Now 7 "survived": the same devices, the full set, 7's own signature included.
    let mut signatures = round.signatures([7], &everyone);
    signatures.extend(claimed_dropped.signatures.clone());
    let claimed_alive = UnmaskRequest { survivors: everyone, signatures };
    assert!(refused_by_every_device(round.unmask(1..=6, &claimed_alive)));
}

/// The server shows the full set to devices 1, 2, 3 and 7, and a set without 7 to 4, 5 and 6,
/// hoping for 7's seed shares from the first group and its key shares from the second. Each
/// device signs once: the second group holds three signatures on its set (forged ones and
/// signatures moved from the other set do not verify), fewer than t = 4, and refuses; the
/// first group reveals three seed shares of 7, fewer than t. Nothing of 7 can be rebuilt, and
/// asking the second group with the first group's set is refused because they did not sign it.
#[test]
fn two_survivor_sets_shown_to_two_groups_reveal_nothing() {
    let mut round = collected(6);
    let everyone = round.survivors.clone();
    let mut without_7 = everyone.clone();
    without_7.remove(&7);
    let on_everyone = round.signatures([1, 2, 3, 7], &everyone);
    let on_without_7 = round.signatures([4, 5, 6], &without_7);

    let first = UnmaskRequest { survivors: everyone.clone(), signatures: on_everyone.clone() };
    let revealed: Vec<_> =
        round.unmask([1, 2, 3], &first).into_iter().map(Result::unwrap).collect();

    let mut padded = on_without_7.clone();
    padded.extend(on_everyone.iter().filter(|(i, _)| **i != 7).map(|(i, s)| (*i, *s)));
    padded.insert(7, Signature { r: [1; 32], s: [2; 32] });
    let second = UnmaskRequest { survivors: without_7, signatures: padded };
    let results = round.unmask([4, 5, 6], &second);
    for r in &results {
        let err = r.as_ref().unwrap_err().to_string();
        assert!(err.contains("only 3 clients remain at Unmasking (signers"), "{err}");
    }
    assert!(refused_by_every_device(round.unmask([4, 5, 6], &first)));
    let (seeds, keys) = gathered(&revealed, 7);
    assert!(seeds < 4 && keys == 0, "the server has {seeds} seed and {keys} key shares of 7");
}

/// A coordinator that drops survivors' masked inputs from the sum it unmasks (keeping at least
/// `t`) would reveal a sum of fewer devices than distributed noise was calibrated for: a
/// review measured ε 4.00 → 5.49 on the benchmark's setting, with about 55 % of the cohort
/// unmasked. Devices that noised for six survivors sign no set of fewer, so it gets no shares;
/// the same devices sign the set of all seven.
#[test]
fn a_survivor_set_below_the_noise_calibration_is_signed_by_no_device() {
    let mut round = collected(11);
    assert_eq!(round.survivors.len(), 7);
    for client in round.clients.values_mut() {
        client.require_survivors(6);
    }
    let too_few: BTreeSet<ClientIdx> = (1..=5).collect();
    assert!(too_few.len() >= config(1).t as usize, "above the threshold, below the calibration");
    let request = ConsistencyRequest { survivors: too_few.clone() };
    for i in too_few {
        let refused = round.clients.get_mut(&i).unwrap().sign_survivors(request.clone());
        assert!(
            matches!(refused, Err(SecAggError::BelowThreshold { have: 5, need: 6, .. })),
            "device {i} signed five survivors: {refused:?}"
        );
    }
    let all = round.survivors.clone();
    let signed = round.signatures(all.clone(), &all);
    assert_eq!(signed.len(), 7, "the honest set is signed by every survivor");
}

/// A coordinator garbles its relay of device 1's sealed shares to four of its neighbours
/// (t = 4) and keeps the originals. Were they to accuse device 1, each accusation's evidence
/// (their channel's point) would open the original the coordinator kept: four shares of both
/// of device 1's secrets, its input in clear, with no device colluding (a review reproduced
/// exactly that). The shares carry their sender's signature, so each neighbour sees the relay
/// was altered and leaves the round: no accusation, no evidence, no masked input. Re-signing
/// with a key of the coordinator's own does not pass either; the untouched relays still open.
#[test]
fn a_coordinator_that_garbles_a_relay_gets_no_evidence_to_open_the_original() {
    let (mut server, mut clients) = advertised(config(4), 21);
    for (i, keys) in server.close_advertise().unwrap() {
        let sealed = clients.get_mut(&i).unwrap().share_keys(keys).unwrap();
        server.receive_shares(i, sealed).unwrap();
    }
    let mut requests = server.close_share_keys().unwrap();
    let coordinators_own = identity(99, 1);
    for victim_neighbour in 2..=5 {
        let request = requests.get_mut(&victim_neighbour).unwrap();
        let relayed = request.shares.iter_mut().find(|s| s.from == 1).unwrap();
        relayed.ciphertext[0] ^= 0xff;
        if victim_neighbour == 5 {
            relayed.sign(&coordinators_own, &config(4).session);
        }
    }
    for (i, request) in requests {
        let client = clients.get_mut(&i).unwrap();
        let masked = client.masked_input(request, &[i; 4]);
        if (2..=5).contains(&i) {
            assert_eq!(masked, Err(SecAggError::RelayAltered { from: 1 }), "device {i}");
            assert!(client.accusations().is_empty(), "device {i} revealed a channel point");
        } else {
            assert!(masked.is_ok(), "device {i} refused an unaltered relay: {masked:?}");
            assert!(client.accusations().is_empty());
        }
    }
}

/// SecAgg+ with the graph the server chose: it hands device 1 a neighbourhood of devices it
/// controls instead of the one the public graph gives, each neighbour genuine and signed for
/// its own seat. Device 1 recomputes its neighbourhood from the roster and session and shares
/// nothing; the public one it accepts.
#[test]
fn a_neighbourhood_the_server_chose_is_refused() {
    let config = Config { session: [8; 16], n: 12, k: 4, t: 3, len: 4 };
    let mut server = Server::new(config).unwrap();
    for i in 1..=config.n {
        let (_, advert) =
            Client::new(i, config, identity(8, i), bytes(8 ^ u64::from(i) << 32, 1)).unwrap();
        server.receive_keys(i, advert).unwrap();
    }
    let mut graph = server.close_advertise().unwrap();
    let victim = || Client::new(1, config, identity(8, 1), bytes(8 ^ 1 << 32, 1)).unwrap().0;
    let honest = graph.remove(&1).unwrap();
    // Colluders of the server's choosing: two members the public graph does not make 1's
    // neighbours.
    let strangers: Vec<ClientIdx> =
        (2..=config.n).filter(|j| !honest.keys.contains_key(j)).take(2).collect();
    let mut chosen = honest.clone();
    for (&stranger, (&neighbour, _)) in strangers.iter().zip(honest.keys.iter()) {
        chosen.keys.remove(&neighbour);
        chosen.keys.insert(stranger, advert_of(&graph, stranger));
    }
    let err = victim().share_keys(chosen).unwrap_err();
    assert!(err.to_string().contains("not the ones the public graph gives"), "{err}");
    victim().share_keys(honest).unwrap();
}

/// Member `j`'s advertisement, as the server relays it to `j`'s neighbours.
fn advert_of(graph: &BTreeMap<ClientIdx, NeighbourKeys>, j: ClientIdx) -> AdvertiseKeys {
    graph.values().find_map(|n| n.keys.get(&j).copied()).expect("someone's neighbour")
}

/// The server makes up a whole round around device 1: six members it invented, each with an
/// identity it made, keys signed by that identity for its seat, the roster and graph
/// consistent. A device that trusts the identity inside an advertisement shares its secrets
/// with them (today's behaviour without a pinned authority). A device that pins the operator's
/// enrolment authority refuses: the invented identities carry no certificate, and a
/// certificate copied from an enrolled device is for another key. With members the authority
/// certified, the same device goes ahead.
#[test]
fn members_the_server_made_up_are_refused_by_a_device_pinning_the_enrolment_authority() {
    let authority = EnrolmentAuthority::from_secret(bytes(77, 3));
    let real_certificate = authority.certify(&identity(1, 4).public());
    let round = |certify: &dyn Fn(ClientIdx, &mut AdvertiseKeys)| {
        let mut server = Server::new(config(9)).unwrap();
        let mut victim = None;
        for i in 1..=N {
            let (client, mut advert) =
                Client::new(i, config(9), identity(9, i), bytes(9 ^ u64::from(i) << 32, 1))
                    .unwrap();
            certify(i, &mut advert);
            server.receive_keys(i, advert).unwrap();
            if i == 1 {
                victim = Some(client);
            }
        }
        let mut victim = victim.unwrap();
        victim.require_certificates(authority.public());
        let neighbourhood = server.close_advertise().unwrap().remove(&1).unwrap();
        (victim, neighbourhood)
    };
    let certify_victim = |i: ClientIdx, advert: &mut AdvertiseKeys| {
        if i == 1 {
            advert.certificate = Some(authority.certify(&advert.identity));
        }
    };

    // Trusting the advertisement alone, the made-up neighbourhood is accepted.
    let (_, neighbourhood) = round(&certify_victim);
    let mut trusting = Client::new(1, config(9), identity(9, 1), bytes(9 ^ 1 << 32, 1)).unwrap().0;
    trusting.share_keys(neighbourhood.clone()).unwrap();

    let (mut victim, neighbourhood) = round(&certify_victim);
    let err = victim.share_keys(neighbourhood).unwrap_err();
    assert!(
        err.to_string().contains("no certificate from the pinned enrolment authority"),
        "{err}"
    );

    let (mut victim, neighbourhood) = round(&|i, advert| {
        certify_victim(i, advert);
        if i != 1 {
            advert.certificate = Some(real_certificate);
        }
    });
    assert!(victim.share_keys(neighbourhood).is_err(), "a certificate of another key");

    let (mut victim, neighbourhood) =
        round(&|_, advert| advert.certificate = Some(authority.certify(&advert.identity)));
    victim.share_keys(neighbourhood).unwrap();
}
