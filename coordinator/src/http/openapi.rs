//! The OpenAPI document, generated from the handlers' own annotations: every API route is
//! registered through `utoipa_axum::routes!`, so a route and its documentation cannot part.
//! Served at `/openapi.json`; `docs/openapi.json` is the checked-in copy a test keeps equal.

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;

use super::AppState;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Starling coordinator",
        description = "Fleet API (devices, CBOR bodies, device credentials) and admin API \
                       (operators, JSON bodies, the operator token). Errors carry an ErrorBody \
                       with a stable `code`.",
        license(name = "Apache-2.0")
    ),
    modifiers(&Credentials),
    tags(
        (name = "fleet", description = "What devices call; CBOR (application/cbor)."),
        (name = "admin", description = "What operators and the dashboard call; JSON."),
        (name = "aggregation", description = "What aggregator nodes call; CBOR, the cluster secret."),
        (name = "observability", description = "Metrics and live state; operator token."),
        (name = "health", description = "Liveness and readiness probes; no credential."),
    )
)]
struct ApiDoc;

/// The two bearer credentials.
struct Credentials;

impl Modify for Credentials {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for (name, what) in [
            ("device", "the credential a device got at enrollment"),
            ("operator", "the coordinator's operator token"),
            ("aggregator", "the secret shared by the coordinator and its aggregators"),
        ] {
            let mut scheme = Http::new(HttpAuthScheme::Bearer);
            scheme.description = Some(what.to_owned());
            components.add_security_scheme(name, SecurityScheme::Http(scheme));
        }
    }
}

/// Every API route with its operation, in one router (before the per-API layers).
pub fn api_routes() -> [OpenApiRouter<AppState>; 3] {
    [
        super::fleet::routes().merge(super::aggregation::routes()),
        super::admin::routes(),
        super::live::routes().merge(super::health_routes()),
    ]
}

/// The OpenAPI document of every API route.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    for routes in api_routes() {
        doc.merge(routes.into_openapi());
    }
    edge_answers(&mut doc);
    doc
}

/// Answers the HTTP edge gives every route of a kind, whatever its handler says: a path id
/// that does not parse is 400 and one that names nothing 404; a body of another media type is
/// 415. Added here once rather than repeated on each handler, where they were forgotten.
fn edge_answers(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::path::ParameterIn;
    use utoipa::openapi::{Content, RefOr, Response};
    for item in doc.paths.paths.values_mut() {
        for operation in
            [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch]
                .into_iter()
                .flatten()
        {
            let cbor = operation
                .tags
                .as_ref()
                .is_some_and(|tags| tags.iter().any(|t| t == "fleet" || t == "aggregation"));
            let media = if cbor { "application/cbor" } else { "application/json" };
            let error = |description: &str| {
                let mut response = Response::new(description);
                let schema = RefOr::Ref(utoipa::openapi::Ref::from_schema_name("ErrorBody"));
                response.content.insert(media.to_owned(), RefOr::T(Content::new(Some(schema))));
                RefOr::T(response)
            };
            let responses = &mut operation.responses.responses;
            let has_path_ids = operation
                .parameters
                .iter()
                .flatten()
                .any(|p| matches!(p, RefOr::T(p) if p.parameter_in == ParameterIn::Path));
            if has_path_ids {
                responses
                    .entry("400".to_owned())
                    .or_insert_with(|| error("a path parameter does not parse"));
                responses.entry("404".to_owned()).or_insert_with(|| error("no such resource"));
            }
            if operation.request_body.is_some() {
                responses.entry("415".to_owned()).or_insert_with(|| {
                    error(if cbor {
                        "the body is not application/cbor"
                    } else {
                        "the body is not application/json"
                    })
                });
            }
        }
    }
}
