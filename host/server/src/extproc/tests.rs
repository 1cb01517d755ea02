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
use crate::config::ServeConfig;
use crate::http::dto::BodyLimits;
use crate::http::metrics::Metrics;

fn ext() -> Arc<ExtProc> {
    let dir = std::env::temp_dir().join(format!("kvroute-extproc-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = kvroute_tokenize::testing::write_test_model(&dir).unwrap();
    let config: ServeConfig = toml::from_str(&format!(
        "[models.m]\ntokenizer = {:?}\n\n[workers.0]\nendpoint = \"http://10.0.0.1:8000/v1\"\nmodel = \"m\"\ntotal_kv_blocks = 1000\nmax_num_batched_tokens = 8192\n",
        tokenizer
    ))
    .unwrap();
    let router = Arc::new(kvroute_core::router::Router::new(config.router_config()).unwrap());
    config.register_workers(&router).unwrap();
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
        Metrics::new(),
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
