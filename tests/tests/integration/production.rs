//! What a production deployment relies on, over real sockets: TLS and mutual TLS with the SDK,
//! every authentication boundary (device against device, device against the admin API, revoked
//! credentials, expired and used-up enrollment tokens), slow-client deadlines, and readiness
//! that follows the store; the OpenAPI document against the routes.

use starling_core::admin::NewEnrollmentToken;
use starling_core::codec;
use std::io::{Read, Write};
use std::time::Duration;

use reqwest::StatusCode;
use starling_client::protocol::{AdminClient, ClientError, FleetClient, TlsSettings};
use starling_core::wire::{self, CheckInResponse, ErrorCode};
use starling_core::{DeviceId, RoundIdx, RunId};
use starling_tests::*;

fn is_transport<T: std::fmt::Debug>(res: Result<T, ClientError>) -> bool {
    matches!(res, Err(ClientError::Transport(_)))
}

/// The SDK speaks TLS to the coordinator end to end (enroll, check in, download, upload) when it
/// trusts the coordinator's CA, and refuses a coordinator whose certificate chains elsewhere,
/// before sending anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_end_to_end_with_the_sdk_and_a_wrong_ca_is_refused() {
    let pki = TestPki::new().unwrap();
    let (_dir, db) = sqlite_db();
    let c = start_in_process_configured(&db, &pki.client_tls("ca.pem", None).unwrap(), |config| {
        config.tls = Some(pki.server_tls(false))
    })
    .await
    .unwrap();
    assert!(c.url.starts_with("https://"), "{}", c.url);
    let url = c.url.replace("127.0.0.1", "localhost");
    let token = c.admin.enrollment_token(1_000_000).await.unwrap();

    // A device that trusts the right CA: the whole protocol over TLS.
    let mut device = FleetClient::with_tls(&url, &pki.client_tls("ca.pem", None).unwrap()).unwrap();
    device.enroll(&token).await.unwrap();
    let run = RunId(c.admin.create_run(&one_round_plan(16, 1)).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let task = match device.check_in("default").await.unwrap() {
        CheckInResponse::Task(t) => t,
        other => panic!("expected a task, got {other:?}"),
    };
    let global = model_values(&device, &task.model_hash, &task.schema).await.unwrap();
    assert_eq!(global.len(), 16);
    device.upload(run, RoundIdx(0), &upload_request(&task, &delta(0, 0, 16), 10)).await.unwrap();
    wait_model(&c.admin, run, 1).await.unwrap();

    // By IP address too (the certificate names 127.0.0.1).
    let by_ip = FleetClient::with_tls(&c.url, &pki.client_tls("ca.pem", None).unwrap()).unwrap();
    let mut by_ip = by_ip;
    by_ip.enroll(&token).await.unwrap();

    // Trusting another CA: the handshake fails, nothing is enrolled.
    let before = c.admin.devices().await.unwrap().len();
    let mut wrong_ca =
        FleetClient::with_tls(&url, &pki.client_tls("other-ca.pem", None).unwrap()).unwrap();
    assert!(is_transport(wrong_ca.enroll(&token).await));
    let admin_wrong_ca =
        AdminClient::with_tls(&url, OPERATOR_TOKEN, &pki.client_tls("other-ca.pem", None).unwrap())
            .unwrap();
    assert!(is_transport(admin_wrong_ca.devices().await));
    // The platform's trust store does not know the test CA either.
    assert!(is_transport(FleetClient::new(&url).check_in("default").await));
    // Plain HTTP to the TLS port gets no API answer.
    let plain = FleetClient::new(&url.replace("https://", "http://"));
    assert!(plain.check_in("default").await.is_err());
    assert_eq!(c.admin.devices().await.unwrap().len(), before);
    c.running.shutdown().await.unwrap();

    // An impostor coordinator with a certificate for the same names from another CA.
    let (_dir2, db2) = sqlite_db();
    let impostor = starling_coordinator::tls::TlsConfig {
        cert: pki.path("impostor.pem"),
        key: pki.path("impostor.key"),
        client_ca: None,
    };
    let evil = start_in_process_configured(
        &db2,
        &pki.client_tls("other-ca.pem", None).unwrap(),
        |config| config.tls = Some(impostor),
    )
    .await
    .unwrap();
    let evil_url = evil.url.replace("127.0.0.1", "localhost");
    let mut fooled =
        FleetClient::with_tls(&evil_url, &pki.client_tls("ca.pem", None).unwrap()).unwrap();
    assert!(is_transport(fooled.enroll("stenr_anything").await));
    evil.running.shutdown().await.unwrap();

    // Unusable TLS material fails the start with the file named.
    let (_dir3, db3) = sqlite_db();
    let broken = starling_coordinator::tls::TlsConfig {
        cert: pki.path("server.key"),
        key: pki.path("server.key"),
        client_ca: None,
    };
    let err = start_in_process_configured(&db3, &TlsSettings::default(), |config| {
        config.tls = Some(broken)
    })
    .await
    .err()
    .expect("a key is not a certificate");
    assert!(err.to_string().contains("server.key"), "{err}");
    let err = TlsSettings::from_files(Some(&pki.path("missing.pem")), None, None).unwrap_err();
    assert!(err.to_string().contains("missing.pem"), "{err}");
}

/// Under mutual TLS, only devices with a certificate from the device CA reach the fleet API;
/// a certificate from another CA fails the handshake; the operator's API and the readiness probe
/// need no client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_only_devices_with_a_ca_certificate() {
    let pki = TestPki::new().unwrap();
    let (_dir, db) = sqlite_db();
    let c = start_in_process_configured(&db, &pki.client_tls("ca.pem", None).unwrap(), |config| {
        config.tls = Some(pki.server_tls(true))
    })
    .await
    .unwrap();
    let token = c.admin.enrollment_token(1_000_000).await.unwrap();

    let mut device =
        FleetClient::with_tls(&c.url, &pki.client_tls("ca.pem", Some("device")).unwrap()).unwrap();
    device.enroll(&token).await.unwrap();
    assert!(matches!(device.check_in("default").await, Ok(CheckInResponse::ComeBackLater { .. })));

    // No certificate: refused with a reason, at enrollment and with a valid credential alike.
    let mut bare = FleetClient::with_tls(&c.url, &pki.client_tls("ca.pem", None).unwrap()).unwrap();
    let refused = bare.enroll(&token).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Unauthorized));
    assert!(refused.to_string().contains("device certificate"), "{refused}");
    bare.set_credential(device.credential());
    assert_eq!(api_code(bare.check_in("default").await), Some(ErrorCode::Unauthorized));

    // A certificate from a CA the coordinator does not trust: no connection at all.
    let mut stranger =
        FleetClient::with_tls(&c.url, &pki.client_tls("ca.pem", Some("stranger")).unwrap())
            .unwrap();
    assert!(is_transport(stranger.enroll(&token).await));

    assert_eq!(c.admin.devices().await.unwrap().len(), 1, "only the certified device enrolled");
    let http = http_client_trusting(&pki.path("ca.pem")).unwrap();
    let ready = http.get(format!("{}/readyz", c.url)).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    c.running.shutdown().await.unwrap();
}

/// Every boundary between devices, the operator and the admin API, on both stores' code path
/// (SQLite here; the store conformance suite covers revocation on Postgres).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_auth_boundary_holds() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 3).await.unwrap();
    let run = RunId(c.admin.create_run(&one_round_plan(16, 1)).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let tasks = futures_util::future::join_all(devices.iter().map(|d| d.check_in("default"))).await;
    let selected = tasks.iter().position(|t| matches!(t, Ok(CheckInResponse::Task(_)))).unwrap();
    let Ok(CheckInResponse::Task(task)) = &tasks[selected] else { unreachable!() };
    let other = (selected + 1) % 3;
    let update = upload_request(task, &delta(0, 0, 16), 10);

    // A device cannot act for another: the unselected one cannot upload into the round.
    assert_eq!(
        api_code(devices[other].upload(run, RoundIdx(0), &update).await),
        Some(ErrorCode::NotSelected)
    );
    // A device credential is not an operator credential, nor the reverse.
    let device_as_admin = AdminClient::new(&c.url, devices[0].credential().unwrap());
    assert_eq!(api_code(device_as_admin.devices().await), Some(ErrorCode::Unauthorized));
    assert_eq!(
        api_code(device_as_admin.create_run(&one_round_plan(16, 1)).await),
        Some(ErrorCode::Unauthorized)
    );
    assert_eq!(
        api_code(device_as_admin.revoke_device(DeviceId(1)).await),
        Some(ErrorCode::Unauthorized)
    );
    let metrics = http_client()
        .get(format!("{}/metrics", c.url))
        .bearer_auth(devices[0].credential().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), StatusCode::UNAUTHORIZED);
    let operator_as_device = FleetClient::with_credential(&c.url, OPERATOR_TOKEN);
    assert_eq!(
        api_code(operator_as_device.check_in("default").await),
        Some(ErrorCode::Unauthorized)
    );

    // Revocation: the selected device is cut off mid-round; the others are not.
    let listed = c.admin.devices().await.unwrap();
    assert_eq!(listed.len(), 3);
    let victim = DeviceId(listed[selected].device_id);
    let view = c.admin.revoke_device(victim).await.unwrap();
    assert!(view.revoked);
    assert_eq!(
        api_code(devices[selected].upload(run, RoundIdx(0), &update).await),
        Some(ErrorCode::Unauthorized)
    );
    assert_eq!(
        api_code(devices[selected].check_in("default").await),
        Some(ErrorCode::Unauthorized)
    );
    assert_eq!(
        api_code(devices[selected].model(&task.model_hash).await),
        Some(ErrorCode::Unauthorized)
    );
    assert!(devices[other].check_in("default").await.is_ok());
    assert_eq!(c.admin.round(run, 0).await.unwrap().n_reported.unwrap(), 0, "nothing was stored");
    assert_eq!(api_code(c.admin.revoke_device(DeviceId(999)).await), Some(ErrorCode::NotFound));
    let revoked: Vec<bool> = c.admin.devices().await.unwrap().iter().map(|d| d.revoked).collect();
    assert_eq!(revoked.iter().filter(|r| **r).count(), 1);

    // Enrollment tokens: use limits and expiry.
    let token = |uses: Option<i64>, ttl_secs: Option<i64>| NewEnrollmentToken {
        uses,
        ttl_secs,
        populations: None,
    };
    let twice = c.admin.enrollment_token_with(&token(Some(2), None)).await.unwrap();
    for _ in 0..2 {
        FleetClient::new(&c.url).enroll(&twice.token).await.unwrap();
    }
    assert_eq!(
        api_code(FleetClient::new(&c.url).enroll(&twice.token).await),
        Some(ErrorCode::Unauthorized)
    );
    let brief = c.admin.enrollment_token_with(&token(Some(5), Some(1))).await.unwrap();
    assert!(brief.expires_at_ms.is_some());
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        api_code(FleetClient::new(&c.url).enroll(&brief.token).await),
        Some(ErrorCode::Unauthorized)
    );
    assert!(c.admin.enrollment_token_with(&token(Some(0), None)).await.is_err());
    // A token must say how many devices it enrolls: an unlimited one once minted 2 000 devices
    // that took every cohort slot.
    let unlimited = c.admin.enrollment_token_with(&token(None, None)).await;
    assert_eq!(api_code(unlimited), Some(ErrorCode::InvalidField));
    assert_eq!(c.admin.devices().await.unwrap().len(), 5);
    c.running.shutdown().await.unwrap();
}

/// Writes `head` to the coordinator, then waits for what it answers (or its closing).
fn raw_exchange(addr: std::net::SocketAddr, head: &[u8]) -> (Vec<u8>, Duration) {
    let started = std::time::Instant::now();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    stream.write_all(head).unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    (answer, started.elapsed())
}

/// A client that stalls in its headers is disconnected, one that stalls in its body gets 408
/// with the `timeout` code, and the coordinator keeps serving everyone else meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_time_out() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process_configured(&db, &TlsSettings::default(), |config| {
        config.timeouts = starling_coordinator::http::Timeouts {
            header: Duration::from_secs(1),
            body_grace: Duration::from_secs(1),
            body_min_rate: 1 << 40,
            ..Default::default()
        }
    })
    .await
    .unwrap();
    let addr = c.running.addr;
    let stalled_headers = tokio::task::spawn_blocking(move || {
        raw_exchange(addr, b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Ty")
    });
    let stalled_body = tokio::task::spawn_blocking(move || {
        raw_exchange(
            addr,
            b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\nContent-Length: 100\r\n\r\n\xa1",
        )
    });
    // Meanwhile the coordinator serves others. (A fresh client each time: with a 1 s header
    // deadline the server may also close idle keep-alive connections after 1 s, and a pooled
    // one could be reused just as it closes; the SDK's pool lets idle connections go after 5 s,
    // under the default 10 s.)
    let fresh_admin = || AdminClient::new(&c.url, OPERATOR_TOKEN);
    assert!(fresh_admin().enrollment_token(1).await.is_ok());
    let (answer, took) = stalled_headers.await.unwrap();
    assert!(took < Duration::from_secs(10), "headers stalled for {took:?}");
    assert!(!String::from_utf8_lossy(&answer).contains("200 OK"));
    let (answer, took) = stalled_body.await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let body: wire::ErrorBody =
        codec::decode(&answer[head_end..]).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(body.code, ErrorCode::Timeout);
    assert!(took < Duration::from_secs(10), "body stalled for {took:?}");
    assert!(fresh_admin().enrollment_token(1).await.is_ok());
    c.running.shutdown().await.unwrap();
}

/// `/readyz` (and `/healthz`) answer 503 while the store refuses connections and 200 again once
/// it is back; `/livez` answers throughout.
#[sqlx::test(migrations = false)]
async fn readiness_follows_the_store(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let db_name = opts.get_database().unwrap().to_owned();
    let c = start_in_process(&pg_url(&opts)).await.unwrap();
    let http = http_client();
    let status = |path: &'static str| {
        let (http, url) = (http.clone(), c.url.clone());
        async move { http.get(format!("{url}{path}")).send().await.unwrap().status() }
    };
    for path in ["/readyz", "/healthz", "/livez"] {
        assert_eq!(status(path).await, StatusCode::OK, "{path}");
    }
    let maintenance = sqlx::PgPool::connect(&std::env::var("DATABASE_URL").unwrap()).await.unwrap();
    let set_connections = |allowed: bool| {
        let (pool, name) = (maintenance.clone(), db_name.clone());
        async move {
            // The name is the test database's own, made by sqlx::test.
            let sql = format!("ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS {allowed}");
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await.unwrap();
            if !allowed {
                // The store's pool, not the leadership lock (losing that stops the coordinator,
                // see leadership_loss_stops_the_coordinator).
                sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> $2")
                    .bind(&name)
                    .bind(starling_coordinator::store::LEADER_APPLICATION_NAME)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    };
    set_connections(false).await;
    let down = wait_for("readiness to fail", Duration::from_secs(30), || async {
        Ok((status("/readyz").await == StatusCode::SERVICE_UNAVAILABLE).then_some(()))
    })
    .await;
    let (healthz, livez) = (status("/healthz").await, status("/livez").await);
    set_connections(true).await;
    down.unwrap();
    assert_eq!(healthz, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(livez, StatusCode::OK);
    wait_for("readiness to return", Duration::from_secs(30), || async {
        Ok((status("/readyz").await == StatusCode::OK).then_some(()))
    })
    .await
    .unwrap();
    c.running.shutdown().await.unwrap();
}

/// The served OpenAPI document is the one generated from the handlers, equals the checked-in
/// `docs/openapi.json` (`STARLING_UPDATE_OPENAPI=1` rewrites it), and every operation in it is a
/// route that exists: asked without credentials, each answers something other than the
/// router's "no such route" 404 or a 405.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_matches_the_routes() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let http = http_client();
    let served: serde_json::Value =
        http.get(format!("{}/openapi.json", c.url)).send().await.unwrap().json().await.unwrap();
    let generated = serde_json::to_value(starling_coordinator::http::openapi::document()).unwrap();
    assert_eq!(served, generated);
    let checked_in = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
    let pretty = serde_json::to_string_pretty(&generated).unwrap() + "\n";
    if std::env::var_os("STARLING_UPDATE_OPENAPI").is_some() {
        std::fs::write(&checked_in, &pretty).unwrap();
    }
    assert_eq!(
        std::fs::read_to_string(&checked_in).unwrap_or_default(),
        pretty,
        "docs/openapi.json is stale: run the test with STARLING_UPDATE_OPENAPI=1"
    );

    let paths = generated["paths"].as_object().unwrap();
    // The paths clients build (core::wire::path) are exactly the ones the handlers serve.
    let mut documented: Vec<&str> = paths.keys().map(String::as_str).collect();
    let mut built = starling_core::wire::path::COORDINATOR.to_vec();
    documented.sort_unstable();
    built.sort_unstable();
    assert_eq!(documented, built, "core::wire::path::COORDINATOR and the OpenAPI paths differ");
    let mut operations = 0;
    for (path, item) in paths {
        let concrete = path
            .replace("{run_id}", "1")
            .replace("{round_idx}", "0")
            .replace("{device_id}", "1")
            .replace("{hash}", &"0".repeat(64));
        for method in item.as_object().unwrap().keys() {
            let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let res =
                http.request(method.clone(), format!("{}{concrete}", c.url)).send().await.unwrap();
            let status = res.status();
            let body = res.text().await.unwrap_or_default();
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            assert!(
                !(status == StatusCode::NOT_FOUND && body.contains("no such route")),
                "{method} {path} is documented but not routed"
            );
            if item[method.as_str().to_lowercase()]["security"].is_array() {
                assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path} without credentials");
            }
            operations += 1;
        }
    }
    assert!(operations >= 21, "only {operations} operations documented");

    // The answers the edge gives every route of a kind are documented on each, in
    // the media type the route speaks, and the server-enforced bounds are in the schemas.
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            let responses = op["responses"].as_object().unwrap();
            let documented = |status: &str| responses.contains_key(status);
            if path.contains('{') {
                assert!(documented("400") && documented("404"), "{method} {path}: 400/404");
            }
            if op.get("requestBody").is_some() {
                assert!(documented("415"), "{method} {path}: 415");
            }
            let tags = op["tags"].as_array().unwrap();
            if tags.iter().any(|t| t == "fleet" || t == "aggregation") {
                for (status, response) in responses.iter().filter(|(s, _)| *s >= &"400".to_owned())
                {
                    if let Some(content) = response.get("content") {
                        assert!(
                            content.get("application/cbor").is_some(),
                            "{method} {path} {status}: errors are CBOR"
                        );
                    }
                }
            }
        }
    }
    let schemas = &generated["components"]["schemas"];
    assert_eq!(schemas["NewEnrollmentToken"]["properties"]["ttl_secs"]["minimum"], 1);
    assert_eq!(schemas["Plan"]["properties"]["rounds"]["minimum"], 1);
    assert!(
        schemas["ModelPlan"]["description"].as_str().unwrap().contains("neither is refused"),
        "{}",
        schemas["ModelPlan"]
    );
    let res = http
        .get(format!("{}/v1/admin/runs/not-a-number", c.url))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // And an undocumented path is the router's 404.
    let res = http.get(format!("{}/v1/nothing-here", c.url)).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    c.running.shutdown().await.unwrap();
}

/// When the connection holding the leadership lock dies, Postgres releases the lock and another
/// coordinator may take over: this one stops serving with `LeadershipLost` instead of driving
/// runs alongside it.
#[sqlx::test(migrations = false)]
async fn leadership_loss_stops_the_coordinator(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let c = start_in_process(&url).await.unwrap();
    assert!(c.admin.enrollment_token(1).await.is_ok());
    let maintenance = sqlx::PgPool::connect(&url).await.unwrap();
    let killed: Vec<(bool,)> = sqlx::query_as(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
    )
    .bind(opts.get_database().unwrap())
    .bind(starling_coordinator::store::LEADER_APPLICATION_NAME)
    .fetch_all(&maintenance)
    .await
    .unwrap();
    assert_eq!(killed.len(), 1, "exactly one connection holds the lock");
    let ended = tokio::time::timeout(Duration::from_secs(20), c.running.wait()).await;
    let res = ended.expect("the coordinator kept serving after losing the lock");
    assert!(matches!(res, Err(starling_coordinator::ServeError::LeadershipLost)), "{res:?}");
    // A successor takes the lock and serves the same store.
    let successor = start_in_process(&url).await.unwrap();
    assert!(successor.admin.enrollment_token(1).await.is_ok());
    successor.running.shutdown().await.unwrap();
}
