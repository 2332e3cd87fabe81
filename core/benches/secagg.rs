//! SecAgg+ cost, in memory (no network): per-client and server compute time and bytes each
//! client sends and receives, for the cohort sizes the issue names. `cargo bench -p
//! starling-core --bench secagg` (release); `-- quick` runs only n = 50.

use starling_core::codec;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use starling_core::secagg::{Client, ClientIdx, Config, DeviceIdentity, Server};

fn randomness<const N: usize>(seed: u64) -> [u8; N] {
    // Benchmark-only stand-in for OS randomness: distinct, reproducible bytes.
    use sha2::Digest;
    let mut out = [0u8; N];
    for (block, chunk) in out.chunks_mut(32).enumerate() {
        let digest =
            sha2::Sha256::digest([seed.to_le_bytes(), (block as u64).to_le_bytes()].concat());
        chunk.copy_from_slice(&digest[..chunk.len()]);
    }
    out
}

struct Figures {
    client: Duration,
    server: Duration,
    /// Of `server`: rebuilding the secrets (`Server::finish`), the part the coordinator's
    /// driver task runs.
    secrets: Duration,
    /// Of `server`: adding the vectors and removing the masks (`Unmasking::sum`), which the
    /// coordinator runs on a blocking thread.
    unmask: Duration,
    sent: usize,
    received: usize,
    survivors: usize,
}

fn size<T: serde::Serialize>(v: &T) -> usize {
    codec::to_vec(v).expect("messages encode").len()
}

fn round(n: u32, m: usize, dropout: f64) -> Figures {
    let config = Config::with_defaults([1; 16], n, m);
    let mut client_time = Duration::ZERO;
    let mut server_time = Duration::ZERO;
    let (mut sent, mut received) = (0usize, 0usize);
    let mut server = Server::new(config).unwrap();
    let mut clients = BTreeMap::new();
    for i in 1..=n {
        let t = Instant::now();
        let identity = DeviceIdentity::from_secret(randomness::<32>(u64::from(i) << 32));
        let (client, advert) = Client::new(i, config, identity, randomness(u64::from(i))).unwrap();
        client_time += t.elapsed();
        sent += size(&advert);
        let t = Instant::now();
        server.receive_keys(i, advert).unwrap();
        server_time += t.elapsed();
        clients.insert(i, client);
    }
    let t = Instant::now();
    let neighbourhoods = server.close_advertise().unwrap();
    server_time += t.elapsed();
    for (i, keys) in neighbourhoods.clone() {
        received += size(&keys);
        let t = Instant::now();
        let sealed = clients.get_mut(&i).unwrap().share_keys(keys).unwrap();
        client_time += t.elapsed();
        sent += size(&sealed);
        let t = Instant::now();
        server.receive_shares(i, sealed).unwrap();
        server_time += t.elapsed();
    }
    let t = Instant::now();
    let requests = server.close_share_keys().unwrap();
    server_time += t.elapsed();
    // Dropouts leave after ShareKeys: the costly case, their masks must be rebuilt.
    let dropped: Vec<ClientIdx> =
        (1..=n).filter(|i| (f64::from(*i) * 0.618_034).fract() < dropout).collect();
    let input: Vec<u32> = (0..m as u32).map(|j| j % 1000).collect();
    for (i, request) in requests {
        received += size(&request);
        if dropped.contains(&i) {
            continue;
        }
        let t = Instant::now();
        let client = clients.get_mut(&i).unwrap();
        let y = client.masked_input(request, &input).unwrap();
        let accusations = client.accusations();
        client_time += t.elapsed();
        sent += y.len() * 4 + 8;
        let t = Instant::now();
        server.receive_masked(i, y, &accusations).unwrap();
        server_time += t.elapsed();
    }
    let t = Instant::now();
    let check = server.close_masked().unwrap();
    server_time += t.elapsed();
    for &i in &check.survivors {
        received += size(&check);
        let t = Instant::now();
        let signature = clients.get_mut(&i).unwrap().sign_survivors(check.clone()).unwrap();
        client_time += t.elapsed();
        sent += size(&signature);
        let t = Instant::now();
        server.receive_signature(i, signature).unwrap();
        server_time += t.elapsed();
    }
    let t = Instant::now();
    let request = server.close_consistency().unwrap();
    server_time += t.elapsed();
    for &i in request.signatures.keys() {
        // What the coordinator sends each signer: its neighbourhood's signatures.
        let request = request.for_client(i, &neighbourhoods[&i]);
        received += size(&request);
        let t = Instant::now();
        let response = clients.get_mut(&i).unwrap().unmask(request).unwrap();
        client_time += t.elapsed();
        sent += size(&response);
        let t = Instant::now();
        server.receive_unmask(i, response).unwrap();
        server_time += t.elapsed();
    }
    let t = Instant::now();
    let unmasking = server.finish().unwrap();
    let secrets = t.elapsed();
    let t = Instant::now();
    // Nobody's shares failed to open: nothing to take back out of the running sum.
    let sum = unmasking.sum(|_| None).unwrap();
    let survivors = unmasking.survivors().clone();
    let unmask = t.elapsed();
    server_time += secrets + unmask;
    let expected: Vec<u32> = input.iter().map(|v| v.wrapping_mul(survivors.len() as u32)).collect();
    assert_eq!(sum, expected, "the unmasked sum is the plaintext sum");
    Figures {
        client: client_time / n,
        server: server_time,
        secrets,
        unmask,
        sent: sent / n as usize,
        received: received / n as usize,
        survivors: survivors.len(),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let cases: &[(u32, usize, f64)] = if quick {
        &[(50, 100_000, 0.0)]
    } else {
        // 131 072: a 100 000-parameter model as distributed DP pads it for its rotation.
        &[
            (50, 100_000, 0.0),
            (100, 100_000, 0.1),
            (100, 131_072, 0.1),
            (500, 100_000, 0.0),
            (500, 100_000, 0.1),
            (500, 131_072, 0.1),
            (1000, 100_000, 0.0),
        ]
    };
    println!(
        "| n | m | dropout | k | t | survivors | client time | server time | of which secrets / unmasking | client sends | client receives |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &(n, m, dropout) in cases {
        let config = Config::with_defaults([1; 16], n, m);
        let f = round(n, m, dropout);
        println!(
            "| {n} | {m} | {:.0}% | {} | {} | {} | {:.1} ms | {:.2} s | {:.1} ms / {:.1} ms | {:.1} KiB | {:.1} KiB |",
            dropout * 100.0,
            config.k,
            config.t,
            f.survivors,
            f.client.as_secs_f64() * 1e3,
            f.server.as_secs_f64(),
            f.secrets.as_secs_f64() * 1e3,
            f.unmask.as_secs_f64() * 1e3,
            f.sent as f64 / 1024.0,
            f.received as f64 / 1024.0,
        );
    }
}
