//! Reading what a rejected request left unread, so its client gets the answer.
//!
//! Many answers go out before the request body has been read: a 413 as soon as the body passes the
//! limit, a 401/403 from the admin guard, a 415 for a wrong content type, a 404 or 405 for a path
//! that takes no body. If the server then closes a connection whose client is still sending, the
//! kernel resets it: the client's next write fails (`EPIPE`, `ECONNRESET`) and, since most HTTP
//! clients send the whole body before they read, it never sees the answer, only a transport error.
//! (hyper does not drain a body the service left unread; it closes.)
//!
//! [`drain_leftovers`] wraps every request body so that a body dropped unfinished is handed back to
//! the middleware, which reads and discards the rest before the answer leaves, within
//! [`DRAIN_TIME`] and [`DRAIN_BYTES`]: the client finishes sending, reads its answer and may keep
//! the connection. Past either bound (or when the client waits on `Expect: 100-continue` for a
//! go-ahead the handler never gave), the answer goes out with `Connection: close`. This is the
//! "lingering close" of nginx and the request draining of Kestrel, done at the application layer.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};

/// The longest a rejected request's leftover body is read before its answer goes out.
pub const DRAIN_TIME: Duration = Duration::from_secs(2);

/// The most leftover bytes read and thrown away; a body announcing more is not drained.
pub const DRAIN_BYTES: u64 = 64 << 20;

/// What a handler left of a request body.
struct Leftover {
    body: Body,
    /// Whether anything polled the body (hyper sends `100 Continue` on the first poll).
    polled: bool,
}

type Slot = Arc<Mutex<Option<Leftover>>>;

/// A request body that, dropped before its end, puts the rest into the middleware's slot.
struct Returning {
    inner: Option<Body>,
    polled: bool,
    slot: Slot,
}

impl HttpBody for Returning {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        this.polled = true;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = Pin::new(inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            // Finished (or broken): nothing to hand back.
            this.inner = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        if let Some(body) = self.inner.take() {
            if !body.is_end_stream() {
                if let Ok(mut slot) = self.slot.lock() {
                    *slot = Some(Leftover {
                        body,
                        polled: self.polled,
                    });
                }
            }
        }
    }
}

/// Middleware: runs the request, then drains whatever its body still holds (see the module docs).
pub async fn drain_leftovers(req: Request, next: Next) -> Response {
    if req.body().is_end_stream() {
        // No body (every GET): nothing can be left over.
        return next.run(req).await;
    }
    let expects_continue = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let slot: Slot = Arc::new(Mutex::new(None));
    let req = req.map(|inner| {
        Body::new(Returning {
            inner: Some(inner),
            polled: false,
            slot: slot.clone(),
        })
    });
    let mut resp = next.run(req).await;
    let leftover = slot.lock().ok().and_then(|mut s| s.take());
    if let Some(left) = leftover {
        let drained = if expects_continue && !left.polled {
            // The client waits for a go-ahead before sending: reading would ask for the body.
            false
        } else {
            drain(left.body).await
        };
        if !drained {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
    }
    resp
}

/// Reads `body` to its end within [`DRAIN_TIME`] and [`DRAIN_BYTES`]; whether it got there.
async fn drain(mut body: Body) -> bool {
    use http_body_util::BodyExt;

    if body.size_hint().lower() > DRAIN_BYTES {
        return false;
    }
    tokio::time::timeout(DRAIN_TIME, async move {
        let mut left = DRAIN_BYTES;
        loop {
            match body.frame().await {
                None => return true,
                Some(Err(_)) => return false,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        let n = data.len() as u64;
                        if n > left {
                            return false;
                        }
                        left -= n;
                    }
                }
            }
        }
    })
    .await
    .unwrap_or(false)
}
