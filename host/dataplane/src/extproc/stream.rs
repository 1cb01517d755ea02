//! One ext_proc stream: the state of one HTTP request as Envoy walks it through its phases.
//!
//! Envoy's message order is the protocol: request headers, request body (one buffered message,
//! or chunks), maybe request trailers, then response headers, response body, maybe response
//! trailers. What we answer, and when, depends on the body mode Envoy's filter is configured
//! with, which Envoy announces in the first message's `protocol_config`:
//!
//! - `FULL_DUPLEX_STREAMED` (what the Gateway API Inference Extension's reference picker uses):
//!   Envoy streams the body without waiting, and holds the request until we answer. The headers'
//!   answer is deferred until the body's last chunk has been read and routed: it carries the
//!   destination header mutation and the `envoy.lb` metadata, and is followed by the body, sent
//!   back as streamed chunks (the `kvroute` object removed). Response body chunks are echoed.
//! - `STREAMED` with `send_body_without_waiting_for_header_response`: the same deferral, each body
//!   chunk then answered with "continue" (the body is forwarded unchanged).
//! - `BUFFERED` (and `BUFFERED_PARTIAL`, and an Envoy that sends no `protocol_config`): headers are
//!   answered at once with "continue"; the body arrives whole and its answer carries the header
//!   mutation, the metadata and, if the `kvroute` object was removed, the new body.
//!
//! The booking is a [`Lifecycle`] owned here: freed when the response body ends, and otherwise by
//! [`Exchange::end`] or dropping the exchange, whatever ended the stream.

use std::sync::Arc;
use std::time::Instant;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request, processing_response::Response,
    BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};

use super::headers::{self, Headers};
use super::ExtProc;
use crate::proxy::endpoint::Endpoint;
use crate::proxy::error::{ErrorShape, ProxyError};
use crate::proxy::lifecycle::Lifecycle;

/// Body chunks sent back to Envoy in full-duplex mode are at most this long (well under gRPC's
/// usual 4 MiB message limit).
const CHUNK: usize = 64 * 1024;

/// How Envoy sends the request body, and so when we answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Buffered,
    Duplex,
    /// Streamed without waiting for the headers' answer.
    StreamedEarly,
}

/// What to do after a message.
pub enum Step {
    /// Send these (maybe none) and read on.
    Reply(Vec<ProcessingResponse>),
    /// Send this immediate response and end the stream.
    Immediate(Box<ProcessingResponse>),
}

pub struct Exchange {
    ext: Arc<ExtProc>,
    mode: Mode,
    echo_response: bool,
    started: Instant,
    request_id: String,
    endpoint: Option<Endpoint>,
    headers: HeaderMap,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    chunks: usize,
    decided: bool,
    status: Option<u16>,
    life: Option<Lifecycle>,
    /// Where the request may be served: the primary first, then the fallbacks.
    targets: Vec<super::Target>,
    /// The served endpoint has been read (from the first response message that carried it).
    served: bool,
}

impl Exchange {
    pub fn new(ext: Arc<ExtProc>) -> Self {
        Self {
            ext,
            mode: Mode::Buffered,
            echo_response: false,
            started: Instant::now(),
            request_id: String::new(),
            endpoint: None,
            headers: HeaderMap::new(),
            subset: None,
            body: Vec::new(),
            chunks: 0,
            decided: false,
            status: None,
            life: None,
            targets: Vec::new(),
            served: false,
        }
    }

    /// Handles one message from Envoy.
    pub async fn on_message(&mut self, req: ProcessingRequest) -> Step {
        if let Some(pc) = &req.protocol_config {
            let duplex = BodySendMode::FullDuplexStreamed as i32;
            self.mode = if pc.request_body_mode == duplex {
                Mode::Duplex
            } else if pc.request_body_mode == BodySendMode::Streamed as i32
                && pc.send_body_without_waiting_for_header_response
            {
                Mode::StreamedEarly
            } else {
                Mode::Buffered
            };
            self.echo_response = pc.response_body_mode == duplex;
        }
        if self.subset.is_none() {
            self.subset = headers::subset_hint(req.metadata_context.as_ref());
        }
        let m = &self.ext.metrics;
        match req.request {
            None => Step::Reply(Vec::new()),
            Some(Request::RequestHeaders(h)) => {
                m.message("request_headers");
                self.on_request_headers(&h)
            }
            Some(Request::RequestBody(b)) => {
                m.message("request_body");
                self.on_request_body(b).await
            }
            Some(Request::RequestTrailers(_)) => {
                m.message("request_trailers");
                // Trailers end a body that did not say so itself.
                if self.mode != Mode::Buffered && !self.decided && self.endpoint.is_some() {
                    return match self.decide().await {
                        Step::Reply(mut v) => {
                            v.push(reply(
                                Response::RequestTrailers(TrailersResponse::default()),
                            ));
                            Step::Reply(v)
                        }
                        s => s,
                    };
                }
                Step::Reply(vec![reply(Response::RequestTrailers(
                    TrailersResponse::default(),
                ))])
            }
            Some(Request::ResponseHeaders(h)) => {
                m.message("response_headers");
                self.status = Headers::read(h.headers.as_ref()).status;
                let served = headers::served_endpoint(req.metadata_context.as_ref());
                self.attribute(served.as_deref());
                if h.end_of_stream {
                    self.end(self.outcome());
                }
                let answer = if self.ext.settings().conformance_hooks {
                    // As the suite's reference picker answers: what the gateway reported.
                    let v = served.unwrap_or_else(|| {
                        "fail: missing destination endpoint served metadata".to_string()
                    });
                    HeadersResponse {
                        response: Some(CommonResponse {
                            header_mutation: Some(headers::mutation(&[(
                                headers::CONFORMANCE_SERVED,
                                v,
                            )])),
                            ..Default::default()
                        }),
                    }
                } else {
                    HeadersResponse::default()
                };
                Step::Reply(vec![reply(Response::ResponseHeaders(answer))])
            }
            Some(Request::ResponseBody(b)) => {
                m.message("response_body");
                // A gateway that skips the response headers' message reports it here.
                let served = headers::served_endpoint(req.metadata_context.as_ref());
                self.attribute(served.as_deref());
                self.on_response_body(b)
            }
            Some(Request::ResponseTrailers(_)) => {
                m.message("response_trailers");
                self.end(self.outcome());
                Step::Reply(vec![reply(Response::ResponseTrailers(
                    TrailersResponse::default(),
                ))])
            }
        }
    }

    fn on_request_headers(&mut self, h: &HttpHeaders) -> Step {
        self.started = Instant::now();
        let read = Headers::read(h.headers.as_ref());
        self.request_id = crate::proxy::request_id(&read.map);
        self.headers = read.map;
        let path = read.path.split('?').next().unwrap_or_default();
        self.endpoint = match Endpoint::from_path(path) {
            Some(e) => Some(e),
            None => {
                return self.refuse(ProxyError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!(
                        "the endpoint picker routes POST /v1/completions, /v1/chat/completions, /v1/messages and /v1/responses, not {} {path}",
                        read.method
                    ),
                ))
            }
        };
        if h.end_of_stream {
            return self.refuse(ProxyError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "the request has no body",
            ));
        }
        match self.mode {
            Mode::Buffered => Step::Reply(vec![reply(Response::RequestHeaders(
                HeadersResponse::default(),
            ))]),
            // Answered with the destination once the body is read.
            Mode::Duplex | Mode::StreamedEarly => Step::Reply(Vec::new()),
        }
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Step {
        if self.endpoint.is_none() || self.decided {
            // A body without headers, or after the decision: nothing to route.
            return Step::Reply(vec![reply(Response::RequestBody(BodyResponse::default()))]);
        }
        self.chunks += 1;
        if self.body.len() + b.body.len() > self.ext.max_body_bytes() {
            return self.refuse(ProxyError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "the request body is over limits.max_body_bytes ({} bytes)",
                    self.ext.max_body_bytes()
                ),
            ));
        }
        if self.body.is_empty() {
            self.body = b.body;
        } else {
            self.body.extend_from_slice(&b.body);
        }
        if b.end_of_stream {
            return self.decide().await;
        }
        match self.mode {
            // Envoy in streamed (not full-duplex) mode waits for an answer to each chunk.
            Mode::Buffered => {
                Step::Reply(vec![reply(Response::RequestBody(BodyResponse::default()))])
            }
            Mode::Duplex | Mode::StreamedEarly => Step::Reply(Vec::new()),
        }
    }

    /// The body is whole: route, book, and answer with the destination.
    async fn decide(&mut self) -> Step {
        self.decided = true;
        let Some(endpoint) = self.endpoint else {
            return Step::Reply(Vec::new());
        };
        let t0 = Instant::now();
        let body = Bytes::from(std::mem::take(&mut self.body));
        let picked = self
            .ext
            .pick(
                endpoint,
                &self.headers,
                body,
                &self.request_id,
                self.subset.as_deref(),
                self.started,
            )
            .await;
        let pick = match picked {
            Ok(p) => p,
            Err(e) => {
                let secs = t0.elapsed().as_secs_f64();
                self.ext.metrics.refused(
                    Some(endpoint.label()),
                    e.status().as_u16(),
                    e.code(),
                    Some(secs),
                );
                return self.immediate(&e);
            }
        };
        let had_length = self.headers.contains_key("content-length");
        let destination = pick.destination();
        let mut set = pick.set;
        let metadata = Some(headers::destination_metadata(&destination));
        let mut out = Vec::new();
        match self.mode {
            Mode::Buffered => {
                let body_mutation = pick.body_changed.then(|| {
                    set.push(("content-length", pick.forward_body.len().to_string()));
                    BodyMutation {
                        mutation: Some(Mutation::Body(pick.forward_body.to_vec())),
                    }
                });
                let mut r = reply(Response::RequestBody(BodyResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(headers::mutation(&set)),
                        body_mutation,
                        clear_route_cache: true,
                        ..Default::default()
                    }),
                }));
                r.dynamic_metadata = metadata;
                out.push(r);
            }
            Mode::Duplex => {
                if had_length {
                    set.push(("content-length", pick.forward_body.len().to_string()));
                }
                out.push(headers_answer(&set, metadata));
                let body = &pick.forward_body;
                let n = body.len().div_ceil(CHUNK).max(1);
                for i in 0..n {
                    let part =
                        &body[(i * CHUNK).min(body.len())..((i + 1) * CHUNK).min(body.len())];
                    out.push(reply(Response::RequestBody(BodyResponse {
                        response: Some(CommonResponse {
                            body_mutation: Some(BodyMutation {
                                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                                    body: part.to_vec(),
                                    end_of_stream: i + 1 == n,
                                    ..Default::default()
                                })),
                            }),
                            ..Default::default()
                        }),
                    })));
                }
            }
            Mode::StreamedEarly => {
                out.push(headers_answer(&set, metadata));
                for _ in 0..self.chunks {
                    out.push(reply(Response::RequestBody(BodyResponse::default())));
                }
            }
        }
        self.ext
            .metrics
            .picked(endpoint.label(), t0.elapsed().as_secs_f64());
        tracing::debug!(
            request_id = %self.request_id,
            destination = %destination,
            worker_id = pick.life.worker,
            dp_rank = pick.life.dp_rank,
            "ext_proc picked"
        );
        self.life = Some(pick.life);
        self.targets = pick.targets;
        Step::Reply(out)
    }

    /// The gateway reported which endpoint served (the protocol's
    /// `x-gateway-destination-endpoint-served`): when it is not the primary, the booking moves
    /// to the candidate that served, with the prompt tokens that one had cached (none when the
    /// gateway went outside the list), and the metrics count where requests were served.
    fn attribute(&mut self, served: Option<&str>) {
        if self.served || self.targets.is_empty() {
            return;
        }
        let m = &self.ext.metrics;
        let Some(served) = served else {
            // Reported on a later message, or not at all.
            return;
        };
        self.served = true;
        let primary = &self.targets[0];
        if served == primary.address {
            m.served("primary");
            return;
        }
        let (label, to, cached) = match self.targets.iter().find(|t| t.address == served) {
            Some(t) => ("fallback", Some(t.key), t.cached_tokens),
            None => ("unlisted", self.ext.candidate_at(served), 0),
        };
        m.served(label);
        let (Some(to), Some(life)) = (to, self.life.as_mut()) else {
            tracing::warn!(request_id = %self.request_id, served, "ext_proc: the endpoint that served is not a known worker; the booking stays");
            return;
        };
        if life.is_done() {
            return;
        }
        match self.ext.router().move_booking(&life.request_id, to, cached) {
            Ok(from) => {
                m.moved(label);
                life.worker = to.worker_id;
                life.dp_rank = to.dp_rank;
                tracing::info!(
                    request_id = %self.request_id,
                    served,
                    from = %from,
                    to = %to,
                    "ext_proc: served by a fallback, booking moved"
                );
            }
            Err(e) => {
                tracing::warn!(request_id = %self.request_id, served, error = %e, "ext_proc: the booking was not moved");
            }
        }
    }

    fn on_response_body(&mut self, b: HttpBody) -> Step {
        if let Some(life) = self.life.as_mut() {
            if !b.body.is_empty() {
                life.on_data(&Bytes::copy_from_slice(&b.body));
            }
        }
        if b.end_of_stream {
            self.end(self.outcome());
        }
        let answer = if self.echo_response {
            BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                            body: b.body,
                            end_of_stream: b.end_of_stream,
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                }),
            }
        } else {
            BodyResponse::default()
        };
        Step::Reply(vec![reply(Response::ResponseBody(answer))])
    }

    /// How a response that ended normally is recorded: by the engine's status.
    fn outcome(&self) -> &'static str {
        match self.status {
            Some(s) if (400..500).contains(&s) => "engine_refused",
            Some(s) if s >= 500 => "engine_error_status",
            _ => "ok",
        }
    }

    /// Ends the request's booking (if any, and not already ended) with `outcome`.
    pub fn end(&mut self, outcome: &'static str) {
        if let Some(life) = self.life.as_mut() {
            if !life.is_done() {
                life.finish(outcome);
            }
        }
    }

    /// An immediate response for an error before the decision (no endpoint label yet).
    fn refuse(&mut self, e: ProxyError) -> Step {
        self.ext.metrics.refused(
            self.endpoint.map(Endpoint::label),
            e.status().as_u16(),
            e.code(),
            None,
        );
        self.immediate(&e)
    }

    fn immediate(&self, e: &ProxyError) -> Step {
        tracing::info!(
            request_id = %self.request_id,
            status = e.status().as_u16(),
            code = e.code(),
            "ext_proc immediate response"
        );
        Step::Immediate(Box::new(reply(Response::ImmediateResponse(
            headers::immediate(
                e,
                &self.request_id,
                self.endpoint
                    .map_or(ErrorShape::OpenAi, Endpoint::error_shape),
            ),
        ))))
    }
}

fn reply(r: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

/// The request headers' answer carrying the destination.
fn headers_answer(
    set: &[(&'static str, String)],
    metadata: Option<envoy_types::pb::google::protobuf::Struct>,
) -> ProcessingResponse {
    let mut r = reply(Response::RequestHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: Some(headers::mutation(set)),
            clear_route_cache: true,
            ..Default::default()
        }),
    }));
    r.dynamic_metadata = metadata;
    r
}
