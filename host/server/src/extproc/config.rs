//! `[ext_proc]`: where `kvroute serve --ext-proc` listens for Envoy's external processing calls.

use std::net::SocketAddr;

use serde::{Deserialize, Deserializer, Serialize};

/// The endpoint picker's settings (API.md §5, `[ext_proc]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExtProcSection {
    /// Address of the gRPC server (`IP:PORT` or `HOST:PORT`, port 0 picks one and logs it);
    /// absent = off. Needs at least one `[models.NAME]`, like the proxy.
    #[serde(deserialize_with = "listen_opt")]
    pub listen: Option<SocketAddr>,
}

fn listen_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) => crate::listen::parse_listen(&s)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_is_read_as_an_address_and_a_bad_one_is_named() {
        let s: ExtProcSection = toml::from_str("listen = \"127.0.0.1:9002\"").unwrap();
        assert_eq!(s.listen, Some(SocketAddr::from(([127, 0, 0, 1], 9002))));
        let s: ExtProcSection = toml::from_str("").unwrap();
        assert_eq!(s.listen, None);
        let e = toml::from_str::<ExtProcSection>("listen = \"9002\"").unwrap_err();
        assert!(e.to_string().contains("not an address to listen on"), "{e}");
        let e = toml::from_str::<ExtProcSection>("port = 1").unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
    }
}
