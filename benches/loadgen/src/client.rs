//! A minimal blocking HTTP/1.1 client: one keep-alive connection, one request in flight.
//!
//! Why not hyper on tokio: the server and this generator share two cores, so the generator must
//! cost as little CPU per request as possible, and the open-loop phase needs send times more precise
//! than tokio's 1 ms timer wheel (a late send inflates the latency measured from the schedule). A
//! blocking socket per thread sends precomputed request bytes with one `write` and sleeps with
//! `nanosleep` (tens of µs late, not up to 1 ms). The parser handles what the two servers measured
//! here send: `Content-Length` or chunked bodies, and `Connection: close`.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};

pub struct Conn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    body: Vec<u8>,
    /// Connections opened, including the first (a reconnect follows `Connection: close`).
    pub connects: u64,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            stream: None,
            buf: Vec::with_capacity(64 << 10),
            body: Vec::with_capacity(64 << 10),
            connects: 0,
        }
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
            self.connects += 1;
        }
        Ok(self.stream.as_mut().expect("just set"))
    }

    /// Sends one complete request (head and body) and reads the response. Returns the status and
    /// the body. On an I/O error the connection is dropped (the next call reconnects).
    pub fn call(&mut self, request: &[u8]) -> io::Result<(u16, &[u8])> {
        match self.call_inner(request) {
            Ok((status, close)) => {
                if close {
                    self.stream = None;
                }
                Ok((status, &self.body))
            }
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 16 << 10];
        let n = self.stream()?.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            ));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    fn call_inner(&mut self, request: &[u8]) -> io::Result<(u16, bool)> {
        self.stream()?.write_all(request)?;
        self.buf.clear();
        self.body.clear();
        let r = loop {
            if let Some(r) = parse_response(&self.buf, &mut self.body)? {
                break r;
            }
            self.fill()?;
        };
        Ok((r.status, r.close))
    }
}

/// A complete response at the front of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub status: u16,
    /// The server will close the connection after it.
    pub close: bool,
    /// Bytes of the buffer it takes (the next response starts there).
    pub len: usize,
}

/// Parses the response at the front of `buf`: `None` until it is complete. The body (de-chunked)
/// is appended to `body`, which is cleared first.
pub fn parse_response(buf: &[u8], body: &mut Vec<u8>) -> io::Result<Option<Parsed>> {
    body.clear();
    let Some(p) = find(buf, b"\r\n\r\n") else {
        return Ok(None);
    };
    let head_end = p + 4;
    let head =
        std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("response head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut content_length = None;
    let mut chunked = false;
    let mut close = status_line.starts_with("HTTP/1.0");
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = Some(
                value
                    .parse::<usize>()
                    .map_err(|_| bad("bad content-length"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        }
    }
    let end = if chunked {
        let mut pos = head_end;
        loop {
            let Some(p) = find(&buf[pos..], b"\r\n") else {
                return Ok(None);
            };
            let line_end = pos + p;
            let size_str =
                std::str::from_utf8(&buf[pos..line_end]).map_err(|_| bad("bad chunk size"))?;
            let size_str = size_str.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_str, 16).map_err(|_| bad("bad chunk size"))?;
            let data_start = line_end + 2;
            if buf.len() < data_start + size + 2 {
                return Ok(None);
            }
            if size == 0 {
                break data_start + 2;
            }
            body.extend_from_slice(&buf[data_start..data_start + size]);
            pos = data_start + size + 2;
        }
    } else {
        let len = content_length.unwrap_or(0);
        if buf.len() < head_end + len {
            return Ok(None);
        }
        body.extend_from_slice(&buf[head_end..head_end + len]);
        head_end + len
    };
    Ok(Some(Parsed {
        status,
        close,
        len: end,
    }))
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The bytes of a request with a JSON body.
pub fn request(method: &str, path: &str, host: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// One request, checked: a status other than 2xx is an error carrying the body.
pub fn call_ok(conn: &mut Conn, req: &[u8]) -> Result<Vec<u8>, String> {
    match conn.call(req) {
        Ok((s, body)) if (200..300).contains(&s) => Ok(body.to_vec()),
        Ok((s, body)) => Err(format!("HTTP {s}: {}", String::from_utf8_lossy(body))),
        Err(e) => Err(e.to_string()),
    }
}
