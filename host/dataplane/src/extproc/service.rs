//! The gRPC server: Envoy's `ExternalProcessor` service, one task per stream, beside the gRPC
//! health service (`grpc.health.v1.Health`) that gateways probe.
//!
//! A stream's task owns its [`Exchange`] (and so the request's booking). It ends when Envoy
//! closes its side (the HTTP request is over), when the stream is reset (Envoy cancelled it: the
//! client went away, a timeout), or when Envoy stops reading our answers (the response stream
//! is dropped); whichever it is, the exchange ends and frees what it booked.
//!
//! The health service answers for the names the inference extension's protocol lists:
//! `liveness` (and the server, `""`) is `SERVING` while the process answers; `readiness` and
//! `envoy.service.ext_proc.v3.ExternalProcessor` are `SERVING` only while [`ExtProc::ready`]
//! (the models are loaded and a registered worker with an endpoint serves one of them), else
//! `NOT_SERVING`, re-checked every [`READINESS_EVERY`].

use std::future::Future;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

use super::stream::{Exchange, Step};
use super::ExtProc;

/// How often readiness is re-checked (workers come and go through the HTTP API).
pub const READINESS_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// The gRPC name of the ext_proc service, as health checks ask for it.
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Answers queued per stream before the stream's task waits for Envoy to read them.
const QUEUED_ANSWERS: usize = 16;

/// The `ExternalProcessor` implementation.
pub struct Service {
    ext: Arc<ExtProc>,
}

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(QUEUED_ANSWERS);
        tokio::spawn(run(self.ext.clone(), inbound, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// One stream, message by message, until it ends one way or another.
async fn run(
    ext: Arc<ExtProc>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    ext.metrics.stream_opened();
    let mut ex = Exchange::new(ext.clone());
    let outcome: &'static str = 'stream: loop {
        let msg = tokio::select! {
            m = inbound.message() => m,
            _ = tx.closed() => break 'stream "dropped",
        };
        let req = match msg {
            Ok(Some(r)) => r,
            // Envoy closed its side before the response ended.
            Ok(None) => break 'stream "stream_closed",
            Err(_) => break 'stream "reset",
        };
        // Routing may wait in the queue: a stream dropped meanwhile stops waiting.
        let step = tokio::select! {
            s = ex.on_message(req) => s,
            _ = tx.closed() => break 'stream "dropped",
        };
        match step {
            Step::Reply(answers) => {
                for a in answers {
                    if tx.send(Ok(a)).await.is_err() {
                        break 'stream "dropped";
                    }
                }
            }
            Step::Immediate(a) => {
                let _ = tx.send(Ok(*a)).await;
                break 'stream "immediate";
            }
        }
    };
    ex.end(outcome);
    drop(ex);
    ext.metrics.stream_closed();
}

/// Serves the endpoint picker on `listener` until `shutdown` resolves, then lets open streams
/// finish (the caller bounds how long).
pub async fn serve(
    ext: Arc<ExtProc>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let (reporter, health) = tonic_health::server::health_reporter();
    for name in ["", "liveness"] {
        reporter
            .set_service_status(name, tonic_health::ServingStatus::Serving)
            .await;
    }
    let readiness = {
        let ext = ext.clone();
        let mut last = None;
        tokio::spawn(async move {
            loop {
                let ready = ext.ready();
                if last != Some(ready) {
                    last = Some(ready);
                    let status = if ready {
                        tonic_health::ServingStatus::Serving
                    } else {
                        tonic_health::ServingStatus::NotServing
                    };
                    for name in ["readiness", SERVICE_NAME] {
                        reporter.set_service_status(name, status).await;
                    }
                    tracing::info!(ready, "ext_proc readiness");
                }
                tokio::time::sleep(READINESS_EVERY).await;
            }
        })
    };
    // A buffered body arrives in one message, and may come back in one: room for the largest.
    let max = ext.max_body_bytes().saturating_add(64 * 1024);
    let svc = ExternalProcessorServer::new(Service { ext })
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let served = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| format!("the ext_proc server failed: {e}"));
    readiness.abort();
    served
}
