//! Loaders for the real datasets in `shared/data` and the partitioners that split them into
//! federated clients: IID, Dirichlet(α) label skew, and the FedAvg paper's shards per client.

use std::io::Read;
use std::path::Path;

use starling_core::model_spec::InputSpec;

use crate::examples::Examples;
use starling_core::rng::SplitMix64;

/// Why a dataset could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not what it should be.
    #[error("{path}: {why}")]
    Format {
        /// File.
        path: String,
        /// What is wrong.
        why: String,
    },
}

/// Reads an IDX u8 file (gunzipping `*.gz`): dimensions and data.
pub fn read_idx(path: &Path) -> Result<(Vec<usize>, Vec<u8>), DataError> {
    let name = path.display().to_string();
    let io = |source| DataError::Io { path: name.clone(), source };
    let raw = std::fs::read(path).map_err(io)?;
    let buf = if path.extension().is_some_and(|e| e == "gz") {
        let mut out = vec![];
        flate2::read::GzDecoder::new(&raw[..]).read_to_end(&mut out).map_err(io)?;
        out
    } else {
        raw
    };
    let format = |why: &str| DataError::Format { path: name.clone(), why: why.to_owned() };
    if buf.len() < 4 || buf[0] != 0 || buf[1] != 0 || buf[2] != 0x08 {
        return Err(format("not an IDX u8 file"));
    }
    let ndim = buf[3] as usize;
    let header = 4 + 4 * ndim;
    if buf.len() < header {
        return Err(format("truncated header"));
    }
    let dims: Vec<usize> = (0..ndim)
        .map(|i| {
            u32::from_be_bytes(buf[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes")) as usize
        })
        .collect();
    let n: usize = dims.iter().product();
    let data = buf.get(header..header + n).ok_or_else(|| format("truncated data"))?.to_vec();
    Ok((dims, data))
}

/// Grey images and their labels from a pair of IDX files, pixels scaled by `scale`.
pub fn idx_images(images: &Path, labels: &Path, scale: f32) -> Result<Examples, DataError> {
    let (dims, pixels) = read_idx(images)?;
    let (ldims, labels_raw) = read_idx(labels)?;
    let bad = |why: String| DataError::Format { path: images.display().to_string(), why };
    if dims.len() != 3 || ldims.len() != 1 || dims[0] != ldims[0] {
        return Err(bad(format!("image dims {dims:?} do not match label dims {ldims:?}")));
    }
    let input = InputSpec::Image { channels: 1, height: dims[1] as u64, width: dims[2] as u64 };
    let mut out = Examples::new(input);
    let w = dims[1] * dims[2];
    let mut x = vec![0f32; w];
    for (i, &label) in labels_raw.iter().enumerate() {
        for (dst, &p) in x.iter_mut().zip(&pixels[i * w..(i + 1) * w]) {
            *dst = f32::from(p) * scale;
        }
        out.push(&x, u32::from(label)).map_err(|e| bad(e.to_string()))?;
    }
    Ok(out)
}

/// A device's own examples on disk: a directory holding `images-idx3-ubyte` and
/// `labels-idx1-ubyte` (IDX, optionally `.gz`; pixels scaled by `pixel_scale`), or a CSV file
/// of `label,x1,...,xn` rows for `input` (required for CSV). Every problem names its line.
pub fn local_examples(
    path: &Path,
    input: Option<InputSpec>,
    pixel_scale: f32,
) -> Result<Examples, DataError> {
    if path.is_dir() {
        let find = |name: &str| {
            let plain = path.join(name);
            if plain.exists() { plain } else { path.join(format!("{name}.gz")) }
        };
        return idx_images(&find("images-idx3-ubyte"), &find("labels-idx1-ubyte"), pixel_scale);
    }
    let name = path.display().to_string();
    let bad = |why: String| DataError::Format { path: name.clone(), why };
    let input = input.ok_or_else(|| bad("a CSV file needs its input shape (--input)".into()))?;
    let text = std::fs::read_to_string(path)
        .map_err(|source| DataError::Io { path: name.clone(), source })?;
    let mut out = Examples::new(input);
    let mut row = vec![];
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let mut fields = line.split(',').map(str::trim);
        let label = fields.next().unwrap_or_default();
        let label: u32 = label
            .parse()
            .map_err(|_| bad(format!("line {}: label {label:?} is not a class", i + 1)))?;
        row.clear();
        for f in fields {
            row.push(
                f.parse::<f32>()
                    .map_err(|_| bad(format!("line {}: {f:?} is not a number", i + 1)))?,
            );
        }
        out.push(&row, label).map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
    }
    Ok(out)
}

/// scikit-learn's 8×8 digits (1,797 examples, pixels 0–16 scaled to 0–1).
pub fn digits(dir: &Path) -> Result<Examples, DataError> {
    idx_images(
        &dir.join("digits-images-idx3-ubyte"),
        &dir.join("digits-labels-idx1-ubyte"),
        1.0 / 16.0,
    )
}

/// Which MNIST-format split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// 60,000 training examples.
    Train,
    /// 10,000 test examples.
    Test,
}

/// MNIST or Fashion-MNIST from a folder of the official gzipped IDX files (pixels scaled to 0–1).
pub fn mnist(dir: &Path, split: Split) -> Result<Examples, DataError> {
    let prefix = match split {
        Split::Train => "train",
        Split::Test => "t10k",
    };
    idx_images(
        &dir.join(format!("{prefix}-images-idx3-ubyte.gz")),
        &dir.join(format!("{prefix}-labels-idx1-ubyte.gz")),
        1.0 / 255.0,
    )
}

/// LEAF's Shakespeare vocabulary (80 characters); anything else maps to the space.
pub const SHAKESPEARE_VOCAB: &str =
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}";

/// One speaking role of one play: a naturally federated client.
#[derive(Debug, Clone, PartialEq)]
pub struct ShakespeareRole {
    /// `<play>/<SPEAKER>`.
    pub id: String,
    /// The role's speech, normalised as LEAF does (newlines to spaces, space runs collapsed).
    pub text: String,
}

/// The Shakespeare-by-role dataset: one client per (play, speaking role), in file order.
pub fn shakespeare_roles(dir: &Path) -> Result<Vec<ShakespeareRole>, DataError> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path)
            .map_err(|source| DataError::Io { path: path.display().to_string(), source })
    };
    let text = read("text.txt")?;
    let index = String::from_utf8(read("clients.tsv")?)
        .map_err(|e| DataError::Format { path: "clients.tsv".into(), why: e.to_string() })?;
    let bad = |line: usize, why: &str| DataError::Format {
        path: "clients.tsv".into(),
        why: format!("line {line}: {why}"),
    };
    let mut roles = vec![];
    for (n, line) in index.lines().enumerate().skip(1) {
        let cols: Vec<&str> = line.split('\t').collect();
        let [_, id, _, _, _, _, offset, length, ..] = cols[..] else {
            return Err(bad(n + 1, "too few columns"));
        };
        let (offset, length): (usize, usize) = match (offset.parse(), length.parse()) {
            (Ok(o), Ok(l)) => (o, l),
            _ => return Err(bad(n + 1, "offset and length must be numbers")),
        };
        let raw = text
            .get(offset..offset + length)
            .ok_or_else(|| bad(n + 1, "range outside text.txt"))?;
        let mut normalised = String::with_capacity(raw.len());
        for &b in raw {
            let c = if b == b'\n' { ' ' } else { b as char };
            if !(c == ' ' && normalised.ends_with(' ')) {
                normalised.push(c);
            }
        }
        roles.push(ShakespeareRole { id: id.to_owned(), text: normalised });
    }
    Ok(roles)
}

/// Next-character examples from `text`: every window of `length` characters, labelled with the
/// character after it (LEAF's recipe), at most `max` of them (0: all), as vocabulary ids.
pub fn next_char_examples(text: &str, length: usize, max: usize) -> Examples {
    let vocab = SHAKESPEARE_VOCAB.len() as u64;
    let ids: Vec<u32> = text
        .bytes()
        .map(|b| SHAKESPEARE_VOCAB.bytes().position(|v| v == b).unwrap_or(1) as u32)
        .collect();
    let mut out = Examples::new(InputSpec::Tokens { vocab, length: length as u64 });
    let n = ids.len().saturating_sub(length);
    let n = if max > 0 { n.min(max) } else { n };
    let mut window = vec![0f32; length];
    for i in 0..n {
        for (w, &id) in window.iter_mut().zip(&ids[i..i + length]) {
            *w = id as f32;
        }
        out.push(&window, ids[i + length]).expect("ids are below the vocabulary");
    }
    out
}

/// IID: a shuffled, even split of `n` examples over `clients`.
pub fn iid(n: usize, clients: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..n).collect();
    SplitMix64(seed).shuffle(&mut idx);
    let mut parts = vec![vec![]; clients];
    for (k, i) in idx.into_iter().enumerate() {
        parts[k % clients].push(i);
    }
    parts
}

/// Label skew: each class is spread over clients in proportions drawn from Dirichlet(α);
/// small α gives each client few classes.
pub fn dirichlet(labels: &[u32], clients: usize, alpha: f64, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = SplitMix64(seed);
    let classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
    let mut parts = vec![vec![]; clients];
    for class in 0..classes {
        let mut members: Vec<usize> =
            (0..labels.len()).filter(|&i| labels[i] as usize == class).collect();
        rng.shuffle(&mut members);
        let weights: Vec<f64> = (0..clients).map(|_| gamma(&mut rng, alpha)).collect();
        let total: f64 = weights.iter().sum();
        let mut start = 0;
        let mut acc = 0.0;
        for (client, w) in weights.iter().enumerate() {
            acc += w / total;
            let end = if client + 1 == clients {
                members.len()
            } else {
                (acc * members.len() as f64).round() as usize
            };
            parts[client].extend_from_slice(&members[start..end.max(start)]);
            start = end.max(start);
        }
    }
    parts
}

/// The FedAvg paper's pathological non-IID split: sort by label, cut into
/// `clients × shards_per_client` shards, give each client that many random shards.
pub fn shards(
    labels: &[u32],
    clients: usize,
    shards_per_client: usize,
    seed: u64,
) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..labels.len()).collect();
    idx.sort_by_key(|&i| (labels[i], i));
    let n_shards = clients * shards_per_client;
    let shard_len = labels.len() / n_shards.max(1);
    let mut order: Vec<usize> = (0..n_shards).collect();
    SplitMix64(seed).shuffle(&mut order);
    order
        .chunks(shards_per_client)
        .map(|own| {
            own.iter()
                .flat_map(|&s| idx[s * shard_len..(s + 1) * shard_len].iter().copied())
                .collect()
        })
        .collect()
}

/// Gamma(α, 1) by Marsaglia–Tsang (with the α < 1 boost).
fn gamma(rng: &mut SplitMix64, alpha: f64) -> f64 {
    if alpha < 1.0 {
        let u = rng.unit().max(f64::MIN_POSITIVE);
        return gamma(rng, alpha + 1.0) * u.powf(1.0 / alpha);
    }
    let d = alpha - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        // Box–Muller normal.
        let (u1, u2) = (rng.unit().max(f64::MIN_POSITIVE), rng.unit());
        let x = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = rng.unit().max(f64::MIN_POSITIVE);
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// A real dataset from `shared/data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Dataset {
    /// scikit-learn's 8×8 digits (80/20 split).
    Digits,
    /// MNIST.
    Mnist,
    /// Fashion-MNIST.
    FashionMnist,
    /// Shakespeare by role: one client per (play, speaking role), the largest roles first;
    /// next-character prediction with an LSTM. The partition is always the natural one.
    Shakespeare,
}

impl Dataset {
    /// What its examples are: 8 × 8 or 28 × 28 grey images, or Shakespeare's 80-character
    /// windows.
    pub fn input(self) -> InputSpec {
        match self {
            Dataset::Digits => InputSpec::Image { channels: 1, height: 8, width: 8 },
            Dataset::Mnist | Dataset::FashionMnist => {
                InputSpec::Image { channels: 1, height: 28, width: 28 }
            }
            Dataset::Shakespeare => InputSpec::Tokens {
                vocab: SHAKESPEARE_VOCAB.len() as u64,
                length: SHAKESPEARE_CONTEXT as u64,
            },
        }
    }
}

/// Characters of context per Shakespeare example (LEAF uses 80).
const SHAKESPEARE_CONTEXT: usize = 80;
/// Examples per Shakespeare client, at most (the largest roles have tens of thousands).
const SHAKESPEARE_MAX_PER_CLIENT: usize = 400;

/// How the training examples are split over clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Partition {
    /// Shuffled and even.
    Iid,
    /// Dirichlet(α) label skew.
    Dirichlet(f64),
    /// The FedAvg paper's shards: this many label-sorted shards per client.
    Shards(usize),
}

impl std::str::FromStr for Partition {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "iid" => Ok(Partition::Iid),
            Some(("dirichlet", a)) => {
                a.parse().map(Partition::Dirichlet).map_err(|e| format!("alpha: {e}"))
            }
            Some(("shards", n)) => {
                n.parse().map(Partition::Shards).map_err(|e| format!("shards: {e}"))
            }
            _ => Err("expected iid, dirichlet:ALPHA or shards:N".into()),
        }
    }
}

/// The data of a simulation: every client's training examples (concatenated), the test set,
/// and each client's indices into the training examples.
pub struct FederatedData {
    /// All clients' training examples.
    pub train: Examples,
    /// The held-out test set the global model is scored on.
    pub test: Examples,
    /// Each client's indices into `train`.
    pub clients: Vec<Vec<usize>>,
}

/// How much of Shakespeare a simulation takes: training windows per role (`0`: every window of
/// the role's text) and how many of the largest roles' held-out tenth make the test set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShakespeareScale {
    /// Windows per role, at most (0: all).
    pub windows_per_role: usize,
    /// Roles whose held-out 10 % form the test set.
    pub test_roles: usize,
}

impl Default for ShakespeareScale {
    /// 400 windows per role, 64 test roles: minutes on two cores.
    fn default() -> Self {
        ShakespeareScale {
            windows_per_role: SHAKESPEARE_MAX_PER_CLIENT,
            test_roles: SHAKESPEARE_TEST_ROLES,
        }
    }
}

/// Loads a dataset once and splits it over `clients`: image sets by `partition` (after keeping
/// at most `max_examples`, 0 for all), Shakespeare by its natural one-client-per-role partition.
pub fn federated_data(
    dataset: Dataset,
    dir: &std::path::Path,
    clients: usize,
    partition: Partition,
    max_examples: usize,
    seed: u64,
) -> Result<FederatedData, DataError> {
    let scale = ShakespeareScale::default();
    federated_data_scaled(dataset, dir, clients, partition, max_examples, seed, scale)
}

/// [`federated_data`], with Shakespeare at `shakespeare`'s scale.
pub fn federated_data_scaled(
    dataset: Dataset,
    dir: &std::path::Path,
    clients: usize,
    partition: Partition,
    max_examples: usize,
    seed: u64,
    shakespeare: ShakespeareScale,
) -> Result<FederatedData, DataError> {
    let (mut train, test) = match dataset {
        Dataset::Shakespeare => return shakespeare_data(dir, clients, seed, shakespeare),
        Dataset::Digits => digits(&dir.join("sklearn_digits"))?.split_holdout(0.2, seed),
        Dataset::Mnist => {
            (mnist(&dir.join("mnist"), Split::Train)?, mnist(&dir.join("mnist"), Split::Test)?)
        }
        Dataset::FashionMnist => {
            let d = dir.join("fashion_mnist");
            (mnist(&d, Split::Train)?, mnist(&d, Split::Test)?)
        }
    };
    if max_examples > 0 && train.len() > max_examples {
        train = train.subset(&(0..max_examples).collect::<Vec<_>>());
    }
    let clients = match partition {
        Partition::Iid => iid(train.len(), clients, seed),
        Partition::Dirichlet(alpha) => dirichlet(train.labels(), clients, alpha, seed),
        Partition::Shards(n) => shards(train.labels(), clients, n, seed),
    };
    Ok(FederatedData { train, test, clients })
}

/// Roles whose held-out 10 % form the Shakespeare test set.
const SHAKESPEARE_TEST_ROLES: usize = 64;

/// The `n` largest Shakespeare roles as clients (each role's 90 % for training), and a test set
/// pooled from the held-out 10 % of the `scale.test_roles` largest roles.
fn shakespeare_data(
    dir: &std::path::Path,
    n: usize,
    seed: u64,
    scale: ShakespeareScale,
) -> Result<FederatedData, DataError> {
    let mut roles = shakespeare_roles(&dir.join("shakespeare_roles"))?;
    roles.sort_by_key(|r| std::cmp::Reverse(r.text.len()));
    let input = next_char_examples("", SHAKESPEARE_CONTEXT, 0).input();
    let (mut train, mut test) = (Examples::new(input), Examples::new(input));
    let mut clients = vec![];
    for (i, role) in roles.iter().take(n.max(scale.test_roles)).enumerate() {
        let examples = next_char_examples(&role.text, SHAKESPEARE_CONTEXT, scale.windows_per_role);
        let (own, held) = examples.split_holdout(0.1, seed + i as u64);
        if i < scale.test_roles {
            test.extend(&held);
        }
        if i < n {
            let start = train.len();
            train.extend(&own);
            clients.push((start..train.len()).collect());
        }
    }
    Ok(FederatedData { train, test, clients })
}

#[cfg(test)]
pub(crate) mod tests;
