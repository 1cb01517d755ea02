//! Listen addresses as operators write them (`IP:PORT` or `HOST:PORT`), for every server this
//! process runs (the HTTP API, the ext_proc gRPC server): one parser, one error message.

use std::net::SocketAddr;

use serde::Deserialize;

/// Parses a listen address: `IP:PORT` (`127.0.0.1:8080`, `[::1]:8080`) or `HOST:PORT`
/// (`localhost:8080`), resolved now; a name takes the first address it resolves to.
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if s.rsplit_once(':')
        .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    {
        return Err(format!(
            "{s:?} is not an address to listen on: use IP:PORT or HOST:PORT, e.g. 127.0.0.1:8080"
        ));
    }
    match s.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| format!("{s:?} resolves to no address")),
        Err(e) => Err(format!("cannot resolve {s:?}: {e}")),
    }
}

pub fn deserialize_listen<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let s = String::deserialize(d)?;
    parse_listen(&s).map_err(serde::de::Error::custom)
}
