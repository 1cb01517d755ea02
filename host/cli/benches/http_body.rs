//! What reading a request body costs in the axum app, with and without the middleware that
//! drains what rejected requests leave unread (`host/src/http/drain.rs`), side by side in one run.
//!
//! Each iteration sends one in-memory request through a `Router` whose handler takes the body as
//! the API's handlers do ([`RawBody`] under a [`BodyLimit`]); no sockets. The difference between
//! the two rows is the middleware's price on every request that has a body.
//!
//! `cargo bench -p kvroute-host --bench http_body -- --warm-up-time 2 --measurement-time 6`

use std::hint::black_box;

use axum::body::Body;
use axum::http::Request;
use axum::routing::post;
use axum::{middleware, Extension, Router};
use criterion::{criterion_group, criterion_main, Criterion};
use kvroute_server::http::drain::drain_leftovers;
use kvroute_server::http::error::{BodyLimit, RawBody};
use tower::ServiceExt;

async fn handler(RawBody(body): RawBody) -> String {
    body.len().to_string()
}

fn app(drain: bool) -> Router {
    let app = Router::new()
        .route("/v1/route", post(handler))
        .layer(Extension(BodyLimit(1 << 20)));
    if drain {
        app.layer(middleware::from_fn(drain_leftovers))
    } else {
        app
    }
}

fn http_body(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    for (name, size) in [("5KB", 5_300usize), ("29KB", 29_000)] {
        let body = bytes::Bytes::from(vec![b' '; size]);
        let mut g = c.benchmark_group(format!("http_body_{name}"));
        for (label, drain) in [("plain", false), ("drain_layer", true)] {
            let router = app(drain);
            g.bench_function(label, |b| {
                b.iter(|| {
                    let req = Request::post("/v1/route")
                        .header("content-type", "application/json")
                        .header("content-length", size)
                        .body(Body::from(body.clone()))
                        .expect("request");
                    let resp = rt
                        .block_on(router.clone().oneshot(req))
                        .expect("infallible");
                    black_box(resp.status())
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, http_body);
criterion_main!(benches);
