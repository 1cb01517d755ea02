//! The stream's message order per body mode, driven without gRPC: an [`Exchange`] fed Envoy's
//! messages, against a router with one worker and the test tokenizer.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap as EnvoyHeaders, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};

use super::stream::{Exchange, Step};
use super::ExtProc;
use kvroute_api::dto::BodyLimits;

/// The router's metrics are not under test here.
struct NoRouteMetrics;

impl crate::RouteMetrics for NoRouteMetrics {
    fn decision(&self, _: &kvroute_core::router::RouteDecision) {}
    fn refusal(&self, _: &kvroute_core::router::RouteError) {}
}

fn ext() -> Arc<ExtProc> {
    ext_with(1, Default::default())
}

/// `n` workers at `10.0.0.(i+1):8000`.
fn ext_with(n: usize, settings: super::ExtProcSection) -> Arc<ExtProc> {
    let dir = std::env::temp_dir().join(format!("kvroute-extproc-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = kvroute_tokenize::testing::write_test_model(&dir).unwrap();
    let mut toml = format!("[models.m]\ntokenizer = {tokenizer:?}\n");
    for i in 0..n {
        toml += &format!(
            "\n[workers.{i}]\nendpoint = \"http://10.0.0.{}:8000/v1\"\nmodel = \"m\"\ntotal_kv_blocks = 1000\nmax_num_batched_tokens = 8192\n",
            i + 1
        );
    }
    /// The part of `kvroute serve`'s configuration this test needs.
    #[derive(serde::Deserialize)]
    struct Config {
        models: std::collections::BTreeMap<String, kvroute_tokenize::ModelSpec>,
        #[serde(default)]
        workers: std::collections::BTreeMap<u64, kvroute_core::workers::WorkerSpec>,
    }
    let config: Config = toml::from_str(&toml).unwrap();
    let router = Arc::new(kvroute_core::router::Router::new(Default::default()).unwrap());
    for (id, spec) in config.workers {
        router.upsert_worker(id, spec).unwrap();
    }
    let models = kvroute_tokenize::ModelRegistry::load_all(&config.models).unwrap();
    let limits = BodyLimits {
        max_allowed_worker_ids: 64,
        max_request_taints: 64,
    };
    Arc::new(ExtProc::new(
        router,
        models,
        limits,
        1 << 20,
        Arc::new(NoRouteMetrics),
        settings,
    ))
}

fn headers(mode: BodySendMode, early: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(EnvoyHeaders {
                headers: vec![HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/completions".to_vec(),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            send_body_without_waiting_for_header_response: early,
        }),
        ..Default::default()
    }
}

fn body(part: &[u8], end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: part.to_vec(),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn replies(s: Step) -> Vec<ProcessingResponse> {
    match s {
        Step::Reply(v) => v,
        Step::Immediate(r) => panic!("refused: {r:?}"),
    }
}

fn kind(r: &ProcessingResponse) -> &'static str {
    match r.response.as_ref().unwrap() {
        Response::RequestHeaders(_) => "request_headers",
        Response::RequestBody(_) => "request_body",
        Response::ResponseHeaders(_) => "response_headers",
        Response::ResponseBody(_) => "response_body",
        Response::RequestTrailers(_) => "request_trailers",
        Response::ResponseTrailers(_) => "response_trailers",
        _ => "other",
    }
}

const BODY: &[u8] =
    br#"{"model": "m", "prompt": "the sea and the ships upon it", "kvroute": {"priority": 1}}"#;

#[tokio::test]
async fn streamed_early_defers_the_headers_answer_then_continues_each_chunk() {
    let ext = ext();
    let mut ex = Exchange::new(ext.clone());
    assert!(replies(ex.on_message(headers(BodySendMode::Streamed, true)).await).is_empty());
    let (a, b) = BODY.split_at(20);
    assert!(replies(ex.on_message(body(a, false)).await).is_empty());
    let out = replies(ex.on_message(body(b, true)).await);
    let kinds: Vec<_> = out.iter().map(kind).collect();
    assert_eq!(kinds, ["request_headers", "request_body", "request_body"]);
    let Some(Response::RequestHeaders(h)) = &out[0].response else {
        unreachable!()
    };
    let set = &h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    let dest = set[0].header.as_ref().unwrap();
    assert_eq!(dest.key, "x-gateway-destination-endpoint");
    assert_eq!(dest.raw_value, b"10.0.0.1:8000");
    assert!(out[0].dynamic_metadata.is_some());
    // Forwarded unchanged in this mode: the continues carry no mutation.
    for r in &out[1..] {
        let Some(Response::RequestBody(b)) = &r.response else {
            unreachable!()
        };
        assert!(b.response.is_none());
    }
    assert_eq!(ext.router.active_bookings(), 1);
    ex.end("stream_closed");
    assert_eq!(ext.router.active_bookings(), 0);
}

#[tokio::test]
async fn buffered_in_chunks_continues_each_and_answers_the_last_with_the_destination() {
    let ext = ext();
    let mut ex = Exchange::new(ext.clone());
    let out = replies(ex.on_message(headers(BodySendMode::Streamed, false)).await);
    assert_eq!(
        out.iter().map(kind).collect::<Vec<_>>(),
        ["request_headers"]
    );
    let (a, b) = BODY.split_at(30);
    let out = replies(ex.on_message(body(a, false)).await);
    assert_eq!(out.iter().map(kind).collect::<Vec<_>>(), ["request_body"]);
    let out = replies(ex.on_message(body(b, true)).await);
    assert_eq!(out.len(), 1);
    let Some(Response::RequestBody(r)) = &out[0].response else {
        panic!("{out:?}")
    };
    let common = r.response.as_ref().unwrap();
    assert!(common.header_mutation.is_some() && common.body_mutation.is_some());
    // Dropping the exchange (the stream's task ended) frees the booking.
    assert_eq!(ext.router.active_bookings(), 1);
    drop(ex);
    assert_eq!(ext.router.active_bookings(), 0);
}

fn response_headers(served: Option<&str>) -> ProcessingRequest {
    let mut m = ProcessingRequest {
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: Some(EnvoyHeaders {
                headers: vec![HeaderValue {
                    key: ":status".into(),
                    raw_value: b"200".to_vec(),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        })),
        ..Default::default()
    };
    if let Some(s) = served {
        use envoy_types::pb::envoy::config::core::v3::Metadata;
        use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
        m.metadata_context = Some(Metadata {
            filter_metadata: [(
                "envoy.lb".to_string(),
                Struct {
                    fields: [(
                        "x-gateway-destination-endpoint-served".to_string(),
                        Value {
                            kind: Some(Kind::StringValue(s.to_string())),
                        },
                    )]
                    .into(),
                },
            )]
            .into(),
            ..Default::default()
        });
    }
    m
}

/// The destination header of a full-duplex answer.
fn destination(out: &[ProcessingResponse]) -> String {
    let Some(Response::RequestHeaders(h)) = &out[0].response else {
        panic!("{out:?}")
    };
    let set = &h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    String::from_utf8(set[0].header.as_ref().unwrap().raw_value.clone()).unwrap()
}

#[tokio::test]
async fn a_fallback_that_served_takes_the_booking_and_the_primary_keeps_its_own() {
    use kvroute_core::candidate::CandidateKey;
    let ext = ext_with(
        2,
        super::ExtProcSection {
            fallbacks: 1,
            ..Default::default()
        },
    );
    let load = |w| ext.router.load_of(CandidateKey::new(w, 0)).active_requests;
    // Served by the fallback.
    let mut ex = Exchange::new(ext.clone());
    ex.on_message(headers(BodySendMode::FullDuplexStreamed, false))
        .await;
    let out = replies(ex.on_message(body(BODY, true)).await);
    let dest = destination(&out);
    let (primary, fallback) = dest.split_once(',').expect("a primary and a fallback");
    let (p, f) = if primary.starts_with("10.0.0.1:") {
        (0, 1)
    } else {
        (1, 0)
    };
    assert_eq!((load(p), load(f)), (1, 0));
    replies(ex.on_message(response_headers(Some(fallback))).await);
    assert_eq!((load(p), load(f)), (0, 1), "moved to {fallback}");
    ex.end("ok");
    assert_eq!(ext.router.active_bookings(), 0);
    // Served by the primary, or not reported: it stays.
    for served in [Some(primary), None] {
        let mut ex = Exchange::new(ext.clone());
        ex.on_message(headers(BodySendMode::FullDuplexStreamed, false))
            .await;
        let out = replies(ex.on_message(body(BODY, true)).await);
        let dest = destination(&out);
        let first = dest.split(',').next().unwrap().to_string();
        let w = if first.starts_with("10.0.0.1:") { 0 } else { 1 };
        replies(
            ex.on_message(response_headers(served.map(|_| first.as_str())))
                .await,
        );
        assert_eq!(load(w), 1, "{served:?}");
        drop(ex);
        assert_eq!(ext.router.active_bookings(), 0);
    }
}
