//! HTTP clients for the fleet API (what a device speaks) and the admin API (what the simulator
//! and tools speak), over reqwest with CBOR and JSON bodies.
//!
//! One implementation serves the SDK's participant, the simulator, the end-to-end tests and the
//! benchmarks, so every caller speaks the API the same way.

use starling_core::backoff::Backoff;
use starling_core::codec;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE};
use serde::Serialize;
use serde::de::DeserializeOwned;
use starling_core::eligibility::DeviceAttributes;
use starling_core::participation::Enrolment;
use starling_core::secagg::DeviceIdentity;
use starling_core::tensor::TensorPayload;
use starling_core::wire::path;
use starling_core::wire::{
    self, CBOR_MEDIA_TYPE, CheckInRequest, CheckInResponse, EnrollRequest, EnrollResponse,
    ErrorBody, EvaluationReport, SecAggInstruction, SecAggUpload, UploadAck, UploadRequest,
};
use starling_core::wire::{TICKET_HEADER, UploadTarget};
use starling_core::{DeviceId, RoundIdx, RunId};

use starling_core::admin::{
    CentralEvaluation, DeviceView, EnrollmentToken, EnrollmentTokenView, ModelView,
    NewEnrollmentToken, RoundDeviceView, RoundView, RunView,
};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Transport failure (connection refused, reset, timeout).
    #[error("http transport: {0}")]
    Transport(#[from] reqwest::Error),
    /// The server answered with an error body.
    #[error("{status}: {body:?}")]
    Api {
        /// HTTP status.
        status: StatusCode,
        /// The error body.
        body: ErrorBody,
    },
    /// The answer could not be decoded.
    #[error("undecodable answer: {0}")]
    Decode(String),
    /// The TLS settings are unusable (unreadable PEM, no certificate in it).
    #[error("tls settings: {0}")]
    Tls(String),
}

impl ClientError {
    /// The HTTP status of an API error.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// How the SDK authenticates the coordinator, and itself, over `https://`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// PEM CA certificates; the coordinator's certificate must chain to one of these and no
    /// other. `None`: the platform's trust store.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate chain followed by its private key: the device's identity for mutual TLS.
    pub identity_pem: Option<Vec<u8>>,
}

impl TlsSettings {
    /// Reads the CA and, when both are given, the device certificate and key from PEM files.
    pub fn from_files(
        ca: Option<&std::path::Path>,
        cert: Option<&std::path::Path>,
        key: Option<&std::path::Path>,
    ) -> Result<Self, ClientError> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| ClientError::Tls(format!("{}: {e}", p.display())))
        };
        let identity_pem = match (cert, key) {
            (Some(cert), Some(key)) => Some([read(cert)?, read(key)?].concat()),
            (None, None) => None,
            _ => {
                return Err(ClientError::Tls(
                    "a client certificate needs its key, and the key its certificate".into(),
                ));
            }
        };
        Ok(TlsSettings { ca_pem: ca.map(read).transpose()?, identity_pem })
    }
}

/// Makes ring the process's rustls provider, as reqwest (built without one) needs before its
/// first client; idempotent. Every SDK client calls it; so must code building its own reqwest
/// client in a process that links the SDK.
pub fn install_tls_provider() {
    // ring is the only rustls provider linked; the error only says one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The one HTTP client configuration every SDK client uses.
fn http_client(tls: &TlsSettings) -> Result<reqwest::Client, ClientError> {
    install_tls_provider();
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(4)
        // Let idle connections go before the coordinator may (its header deadline, 10 s by
        // default, can also end idle keep-alive connections), so a request never goes out on a
        // connection the server is closing.
        .pool_idle_timeout(Duration::from_secs(5));
    if let Some(pem) = &tls.ca_pem {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| ClientError::Tls(format!("CA certificates: {e}")))?;
        if certs.is_empty() {
            return Err(ClientError::Tls("the CA file holds no certificate".into()));
        }
        builder = builder.tls_certs_only(certs);
    }
    if let Some(pem) = &tls.identity_pem {
        let identity = reqwest::Identity::from_pem(pem)
            .map_err(|e| ClientError::Tls(format!("client certificate and key: {e}")))?;
        builder = builder.identity(identity);
    }
    builder.build().map_err(|e| ClientError::Tls(e.to_string()))
}

/// How many times [`AdminClient::model_file`] asks (backing off from 200 ms: about 3 s in all).
const MODEL_FILE_TRIES: u32 = 5;

/// Retries `call` on transport errors, 408, 429 and 503, with exponential backoff (at most `tries`
/// attempts); any other answer, success or refusal, is returned at once.
pub async fn retrying<T, F, Fut>(tries: u32, mut call: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut attempt = 1;
    loop {
        match call().await {
            Err(e) if attempt < tries && e.is_transient() => {
                tokio::time::sleep(backoff.next_delay()).await;
                attempt += 1;
            }
            res => return res,
        }
    }
}

impl ClientError {
    /// Whether trying again later may succeed (transport failure, 408, 429, 503).
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Transport(_) => true,
            ClientError::Api { status, .. } => {
                *status == StatusCode::SERVICE_UNAVAILABLE
                    || *status == StatusCode::TOO_MANY_REQUESTS
                    || *status == StatusCode::REQUEST_TIMEOUT
            }
            ClientError::Decode(_) | ClientError::Tls(_) => false,
        }
    }

    /// The API error code, if the server answered with one.
    pub fn code(&self) -> Option<wire::ErrorCode> {
        match self {
            ClientError::Api { body, .. } => Some(body.code),
            _ => None,
        }
    }
}

/// A device's view of the fleet API.
#[derive(Debug, Clone)]
pub struct FleetClient {
    http: reqwest::Client,
    base: String,
    credential: Option<String>,
    /// The key this device signs its secure-aggregation keys with, registered at enrollment.
    identity: Option<DeviceIdentity>,
    /// The enrolment authority this device pins, and its identity's certificate from it.
    enrolment: Enrolment,
}

/// A fresh device identity from the OS's randomness.
pub fn new_identity() -> DeviceIdentity {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).expect("the OS random source failed");
    DeviceIdentity::from_secret(secret)
}

/// A fresh enrolment authority from the OS's randomness (the operator's, see
/// [`EnrolmentAuthority`](starling_core::secagg::EnrolmentAuthority)).
pub fn new_enrolment_authority() -> starling_core::secagg::EnrolmentAuthority {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).expect("the OS random source failed");
    starling_core::secagg::EnrolmentAuthority::from_secret(secret)
}

impl FleetClient {
    /// A client for the coordinator at `base` (e.g. `https://coordinator.example:8443`),
    /// trusting the platform's CAs for `https://`.
    pub fn new(base: &str) -> Self {
        Self::with_tls(base, &TlsSettings::default()).expect("default tls settings always build")
    }

    /// A client for `base` that verifies the coordinator (and presents a device certificate)
    /// as `tls` says.
    pub fn with_tls(base: &str, tls: &TlsSettings) -> Result<Self, ClientError> {
        Ok(FleetClient {
            http: http_client(tls)?,
            base: base.trim_end_matches('/').to_owned(),
            credential: None,
            identity: None,
            enrolment: Enrolment::default(),
        })
    }

    /// A client that authenticates with `credential`.
    pub fn with_credential(base: &str, credential: &str) -> Self {
        FleetClient { credential: Some(credential.to_owned()), ..Self::new(base) }
    }

    /// The same connection settings, authenticating with `credential` (or not at all).
    pub fn set_credential(&mut self, credential: Option<&str>) {
        self.credential = credential.map(str::to_owned);
    }

    /// The credential this client authenticates with, if enrolled.
    pub fn credential(&self) -> Option<&str> {
        self.credential.as_deref()
    }

    /// The identity this device signs with in secure rounds, if it has one.
    pub fn identity(&self) -> Option<&DeviceIdentity> {
        self.identity.as_ref()
    }

    /// The same connection settings, signing with `identity` (restored with the credential).
    pub fn set_identity(&mut self, identity: Option<DeviceIdentity>) {
        self.identity = identity;
    }

    /// The enrolment authority this device pins and its identity's certificate from it.
    pub fn enrolment(&self) -> Enrolment {
        self.enrolment
    }

    /// Pins an enrolment authority and holds this identity's certificate from it (see
    /// [`Enrolment`]).
    pub fn set_enrolment(&mut self, enrolment: Enrolment) {
        self.enrolment = enrolment;
    }

    /// Trades an enrollment token for a credential, and keeps it. The device registers its
    /// identity key with it (a fresh one, unless this client already holds one), with its
    /// certificate from the enrolment authority when it holds one.
    pub async fn enroll(&mut self, enrollment_token: &str) -> Result<EnrollResponse, ClientError> {
        let identity_key = Some(self.identity.get_or_insert_with(new_identity).public());
        let request = EnrollRequest {
            enrollment_token: enrollment_token.to_owned(),
            identity_key,
            identity_certificate: self.enrolment.certificate,
        };
        let res: EnrollResponse = self.post(path::ENROLL, &request).await?;
        self.credential = Some(res.credential.clone());
        Ok(res)
    }

    /// Checks in, saying nothing of the device's conditions.
    pub async fn check_in(&self, population: &str) -> Result<CheckInResponse, ClientError> {
        self.check_in_with(population, &DeviceAttributes::default()).await
    }

    /// Checks in with the device's conditions, for runs that require some.
    pub async fn check_in_with(
        &self,
        population: &str,
        attributes: &DeviceAttributes,
    ) -> Result<CheckInResponse, ClientError> {
        let request =
            CheckInRequest { population: population.to_owned(), attributes: attributes.clone() };
        self.post(path::CHECK_IN, &request).await
    }

    /// Downloads a model by content hash.
    pub async fn model(&self, hash: &str) -> Result<TensorPayload, ClientError> {
        self.model_in(hash, starling_core::compression::Compression::F32).await
    }

    /// Downloads an imported pretrained model (a task's `base_model`), unverified: the caller
    /// checks its content hash.
    pub async fn base_model(
        &self,
        hash: &str,
    ) -> Result<starling_core::wire::BaseModelDownload, ClientError> {
        let res = self
            .authed(self.http.get(format!("{}{}", self.base, path::base_model(hash))))
            .send()
            .await?;
        let status = res.status();
        decode_answer(status, &res.bytes().await?)
    }

    /// Downloads an imported tokenizer's `tokenizer.json` (a task's `tokenizer`), unverified:
    /// the caller checks its content hash.
    pub async fn tokenizer(&self, hash: &str) -> Result<Vec<u8>, ClientError> {
        let url = format!("{}{}", self.base, path::tokenizer(hash));
        let res = self.authed(self.http.get(url)).send().await?;
        let status = res.status();
        let bytes = res.bytes().await?;
        if !status.is_success() {
            return Err(api_error(status, &bytes));
        }
        Ok(bytes.to_vec())
    }

    /// Downloads the tensors `run` trains of its model `hash` (f32).
    pub async fn trained_part(&self, run: RunId, hash: &str) -> Result<TensorPayload, ClientError> {
        let url = format!("{}{}", self.base, path::trained_part(run, hash));
        let res = self.authed(self.http.get(url)).send().await?;
        let status = res.status();
        decode_answer(status, &res.bytes().await?)
    }

    /// Downloads a model in a task's download encoding (`model_download`), still encoded:
    /// the payload's data is the model's values in `compression` ([`Self::model`] for f32).
    pub async fn model_in(
        &self,
        hash: &str,
        compression: starling_core::compression::Compression,
    ) -> Result<TensorPayload, ClientError> {
        let url = format!("{}{}", self.base, path::model_in(hash, compression));
        let res = self.authed(self.http.get(url)).send().await?;
        let status = res.status();
        decode_answer_with(status, &res.bytes().await?, codec::decode_large)
    }

    /// Uploads an update.
    pub async fn upload(
        &self,
        run: RunId,
        round: RoundIdx,
        update: &UploadRequest,
    ) -> Result<UploadAck, ClientError> {
        self.post(&path::upload(run, round), update).await
    }

    /// Uploads an update to the aggregator the coordinator assigned (the task's `upload_to`),
    /// with the ticket as credential; `Ok` once the aggregator took it into its reduction.
    pub async fn upload_to_aggregator(
        &self,
        target: &UploadTarget,
        run: RunId,
        round: RoundIdx,
        update: &UploadRequest,
    ) -> Result<UploadAck, ClientError> {
        let body = codec::to_vec(update).map_err(|e| ClientError::Decode(e.to_string()))?;
        self.post_to_aggregator(target, run, round, body).await
    }

    /// Posts an update already encoded (a CBOR [`UploadRequest`]) to the aggregator the
    /// coordinator assigned: [`Self::upload_to_aggregator`] for callers that hold the bytes.
    pub async fn post_to_aggregator(
        &self,
        target: &UploadTarget,
        run: RunId,
        round: RoundIdx,
        body: impl Into<reqwest::Body>,
    ) -> Result<UploadAck, ClientError> {
        if self.base.starts_with("https://") && !target.url.starts_with("https://") {
            // A coordinator reached over TLS that sends the update to a plain-HTTP address
            // (misconfigured, or someone on the path rewriting the task) would expose it.
            return Err(ClientError::Tls(format!(
                "refusing to send an update to {} in clear: the coordinator is reached over https",
                target.url
            )));
        }
        let url = format!("{}{}", target.url.trim_end_matches('/'), path::upload(run, round));
        let res = self
            .http
            .post(url)
            .header(TICKET_HEADER, &target.ticket)
            .header(CONTENT_TYPE, CBOR_MEDIA_TYPE)
            .body(body)
            .send()
            .await?;
        let status = res.status();
        decode_answer(status, &res.bytes().await?)
    }

    /// Sends a secure-aggregation stage message; `Ok` once it is durable at the coordinator.
    pub async fn secagg_send(
        &self,
        run: RunId,
        round: RoundIdx,
        message: &SecAggUpload,
    ) -> Result<(), ClientError> {
        let body = codec::to_vec(message).map_err(|e| ClientError::Decode(e.to_string()))?;
        let path = path::secagg(run, round);
        let (status, bytes) = self.post_raw(&path, body, CBOR_MEDIA_TYPE).await?;
        if status.is_success() { Ok(()) } else { Err(api_error(status, &bytes)) }
    }

    /// What this device's secure round needs from it next.
    pub async fn secagg_instruction(
        &self,
        run: RunId,
        round: RoundIdx,
    ) -> Result<SecAggInstruction, ClientError> {
        let url = format!("{}{}", self.base, path::secagg(run, round));
        let res = self.authed(self.http.get(url)).send().await?;
        let status = res.status();
        decode_answer(status, &res.bytes().await?)
    }

    /// Reports an evaluation.
    pub async fn evaluate(&self, run: RunId, report: &EvaluationReport) -> Result<(), ClientError> {
        let body = codec::to_vec(report).map_err(|e| ClientError::Decode(e.to_string()))?;
        let (status, bytes) = self.post_raw(&path::evaluations(run), body, CBOR_MEDIA_TYPE).await?;
        if status.is_success() { Ok(()) } else { Err(api_error(status, &bytes)) }
    }

    /// Posts raw bytes and returns status and body as they came; for tests of bad input.
    pub async fn post_raw(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
        content_type: &str,
    ) -> Result<(StatusCode, Vec<u8>), ClientError> {
        let res = self
            .authed(self.http.post(format!("{}{path}", self.base)))
            .header(CONTENT_TYPE, content_type)
            .body(body)
            .send()
            .await?;
        let status = res.status();
        Ok((status, res.bytes().await?.to_vec()))
    }

    async fn post<Req: Serialize, Res: DeserializeOwned>(
        &self,
        path: &str,
        req: &Req,
    ) -> Result<Res, ClientError> {
        let body = codec::to_vec(req).map_err(|e| ClientError::Decode(e.to_string()))?;
        let (status, bytes) = self.post_raw(path, body, CBOR_MEDIA_TYPE).await?;
        decode_answer(status, &bytes)
    }

    fn authed(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.credential {
            Some(c) => req.header(AUTHORIZATION, format!("Bearer {c}")),
            None => req,
        }
    }
}

/// A CBOR answer, or the error body of a non-2xx one.
fn decode_answer<T: DeserializeOwned>(status: StatusCode, bytes: &[u8]) -> Result<T, ClientError> {
    decode_answer_with(status, bytes, codec::decode)
}

/// [`decode_answer`] with the decoder given (a model's: [`codec::decode_large`]).
fn decode_answer_with<T>(
    status: StatusCode,
    bytes: &[u8],
    decode: fn(&[u8]) -> Result<T, codec::CodecError>,
) -> Result<T, ClientError> {
    if !status.is_success() {
        return Err(api_error(status, bytes));
    }
    decode(bytes).map_err(|e| ClientError::Decode(e.to_string()))
}

/// Decodes an error body, CBOR or JSON.
pub fn api_error(status: StatusCode, bytes: &[u8]) -> ClientError {
    let body = codec::decode::<ErrorBody>(bytes)
        .ok()
        .or_else(|| serde_json::from_slice(bytes).ok())
        .unwrap_or_else(|| ErrorBody {
            code: wire::ErrorCode::Internal,
            message: String::from_utf8_lossy(bytes).into_owned(),
        });
    ClientError::Api { status, body }
}

/// An operator's view of the admin API.
#[derive(Debug, Clone)]
pub struct AdminClient {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl AdminClient {
    /// A client for the coordinator at `base` with the operator token.
    pub fn new(base: &str, token: &str) -> Self {
        Self::with_tls(base, token, &TlsSettings::default())
            .expect("default tls settings always build")
    }

    /// A client for `base` verifying the coordinator as `tls` says.
    pub fn with_tls(base: &str, token: &str, tls: &TlsSettings) -> Result<Self, ClientError> {
        Ok(AdminClient {
            http: http_client(tls)?,
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
        })
    }

    /// Issues an enrollment token for at most `uses` devices of the `default` population.
    pub async fn enrollment_token(&self, uses: i64) -> Result<String, ClientError> {
        Ok(self.enrollment_token_for(uses, &["default"]).await?.token)
    }

    /// Issues an enrollment token for at most `uses` devices that may join `populations`.
    pub async fn enrollment_token_for(
        &self,
        uses: i64,
        populations: &[&str],
    ) -> Result<EnrollmentToken, ClientError> {
        let populations = populations.iter().map(|p| p.to_string()).collect();
        let request =
            NewEnrollmentToken { uses: Some(uses), ttl_secs: None, populations: Some(populations) };
        self.enrollment_token_with(&request).await
    }

    /// Creates a run from a plan (JSON as the API takes it).
    pub async fn create_run(&self, plan: &serde_json::Value) -> Result<RunView, ClientError> {
        self.send(reqwest::Method::POST, path::ADMIN_RUNS, Some(plan.clone())).await
    }

    /// One run.
    pub async fn run(&self, run: RunId) -> Result<RunView, ClientError> {
        self.send(reqwest::Method::GET, &path::admin_run(run), None).await
    }

    /// A run's rounds.
    pub async fn rounds(&self, run: RunId) -> Result<Vec<RoundView>, ClientError> {
        self.send(reqwest::Method::GET, &path::admin_rounds(run), None).await
    }

    /// One round of a run.
    pub async fn round(&self, run: RunId, round_idx: i64) -> Result<RoundView, ClientError> {
        self.send(reqwest::Method::GET, &path::admin_round(run, RoundIdx(round_idx)), None).await
    }

    /// The devices selected for one round of a run, and whose contribution reached it.
    pub async fn round_devices(
        &self,
        run: RunId,
        round_idx: i64,
    ) -> Result<Vec<RoundDeviceView>, ClientError> {
        let path = path::admin_round_devices(run, RoundIdx(round_idx));
        self.send(reqwest::Method::GET, &path, None).await
    }

    /// Every run, newest first.
    pub async fn runs(&self) -> Result<Vec<RunView>, ClientError> {
        self.send(reqwest::Method::GET, path::ADMIN_RUNS, None).await
    }

    /// A run's model versions.
    pub async fn models(&self, run: RunId) -> Result<Vec<ModelView>, ClientError> {
        self.send(reqwest::Method::GET, &path::admin_models(run), None).await
    }

    /// Imports a pretrained model, `file` a safetensors file of F32 tensors, under `name`; a
    /// plan starts from it with `init` `{"kind": "base_model", "hash": <its content_hash>}`.
    pub async fn import_base_model(
        &self,
        name: &str,
        file: Vec<u8>,
    ) -> Result<starling_core::admin::BaseModelView, ClientError> {
        self.import_file(path::ADMIN_BASE_MODELS, name, "application/octet-stream", file).await
    }

    /// Imports a Hugging Face tokenizer, `file` a `tokenizer.json`, under `name`; a plan names
    /// it with `model.tokenizer` set to its content hash.
    pub async fn import_tokenizer(
        &self,
        name: &str,
        file: Vec<u8>,
    ) -> Result<starling_core::admin::TokenizerView, ClientError> {
        self.import_file(path::ADMIN_TOKENIZERS, name, "application/json", file).await
    }

    /// Every imported tokenizer.
    pub async fn tokenizers(
        &self,
    ) -> Result<Vec<starling_core::admin::TokenizerView>, ClientError> {
        self.send(reqwest::Method::GET, path::ADMIN_TOKENIZERS, None).await
    }

    /// Posts a file to import at `path` under `name`, answering with the import's view.
    async fn import_file<T: DeserializeOwned>(
        &self,
        path: &str,
        name: &str,
        content_type: &'static str,
        file: Vec<u8>,
    ) -> Result<T, ClientError> {
        let url =
            reqwest::Url::parse_with_params(&format!("{}{path}", self.base), [("name", name)])
                .map_err(|e| ClientError::Decode(e.to_string()))?;
        let res = self
            .http
            .post(url)
            .header(AUTHORIZATION, format!("Bearer {}", self.token))
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .body(file)
            .send()
            .await?;
        let status = res.status();
        let bytes = res.bytes().await?;
        if !status.is_success() {
            return Err(api_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Every imported pretrained model.
    pub async fn base_models(
        &self,
    ) -> Result<Vec<starling_core::admin::BaseModelView>, ClientError> {
        self.send(reqwest::Method::GET, path::ADMIN_BASE_MODELS, None).await
    }

    /// A committed model as a file: `safetensors`, or `payload` (the CBOR devices download).
    pub async fn model_file(
        &self,
        run: RunId,
        version: i64,
        format: &str,
    ) -> Result<Vec<u8>, ClientError> {
        let path = format!("{}?format={format}", path::admin_model(run, version));
        // A model committed moments ago may still be having its bytes written (503): asked
        // again, as a device asks again for its download.
        retrying(MODEL_FILE_TRIES, || self.send_raw(reqwest::Method::GET, &path, None)).await
    }

    /// Part of a committed model as a safetensors file: `all`, or for a LoRA run `merged` (its
    /// base model with the adapters merged in) or `adapters`.
    pub async fn model_part_file(
        &self,
        run: RunId,
        version: i64,
        part: &str,
    ) -> Result<Vec<u8>, ClientError> {
        let path = format!("{}?format=safetensors&part={part}", path::admin_model(run, version));
        retrying(MODEL_FILE_TRIES, || self.send_raw(reqwest::Method::GET, &path, None)).await
    }

    /// A committed model's values, downloaded with the operator's credential.
    pub async fn model_payload(
        &self,
        run: RunId,
        version: i64,
    ) -> Result<TensorPayload, ClientError> {
        let bytes = self.model_file(run, version, "payload").await?;
        codec::decode(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// The run's model spec, which a central evaluator builds its models from (a 422 for a
    /// run of kind `tensors`, which has none).
    pub async fn model_spec(&self, run: RunId) -> Result<serde_json::Value, ClientError> {
        self.send(reqwest::Method::GET, &path::admin_model_spec(run), None).await
    }

    /// Reports a central evaluation of a committed model.
    pub async fn report_central_evaluation(
        &self,
        run: RunId,
        version: i64,
        evaluation: &CentralEvaluation,
    ) -> Result<(), ClientError> {
        let body =
            serde_json::to_value(evaluation).map_err(|e| ClientError::Decode(e.to_string()))?;
        let path = path::admin_model_evaluations(run, version);
        self.send_empty(reqwest::Method::POST, &path, Some(body)).await
    }

    /// Every enrollment token (never the token itself), newest first.
    pub async fn enrollment_tokens(&self) -> Result<Vec<EnrollmentTokenView>, ClientError> {
        self.send(reqwest::Method::GET, path::ADMIN_ENROLLMENT_TOKENS, None).await
    }

    /// Every enrolled device.
    pub async fn devices(&self) -> Result<Vec<DeviceView>, ClientError> {
        self.send(reqwest::Method::GET, path::ADMIN_DEVICES, None).await
    }

    /// Revokes a device's credential.
    pub async fn revoke_device(&self, device: DeviceId) -> Result<DeviceView, ClientError> {
        self.send(reqwest::Method::POST, &path::admin_revoke(device), None).await
    }

    /// Issues an enrollment token as `request` describes it (uses, lifetime, populations).
    pub async fn enrollment_token_with(
        &self,
        request: &NewEnrollmentToken,
    ) -> Result<EnrollmentToken, ClientError> {
        let body = serde_json::to_value(request).expect("a token request serializes");
        self.send(reqwest::Method::POST, path::ADMIN_ENROLLMENT_TOKENS, Some(body)).await
    }

    /// Stops a run.
    pub async fn stop(&self, run: RunId) -> Result<RunView, ClientError> {
        self.send(reqwest::Method::POST, &path::admin_stop(run), None).await
    }

    async fn send<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<T, ClientError> {
        let bytes = self.send_raw(method, path, body).await?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Like [`AdminClient::send`] for an answer without a body (204).
    async fn send_empty(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(), ClientError> {
        self.send_raw(method, path, body).await.map(drop)
    }

    async fn send_raw(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<Vec<u8>, ClientError> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header(AUTHORIZATION, format!("Bearer {}", self.token));
        if let Some(body) = body {
            req = req.json(&body);
        }
        let res = req.send().await?;
        let status = res.status();
        let bytes = res.bytes().await?;
        if !status.is_success() {
            return Err(api_error(status, &bytes));
        }
        Ok(bytes.to_vec())
    }
}
