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
    /// Fallback endpoints named after the primary in `x-gateway-destination-endpoint` (and the
    /// `envoy.lb` metadata), in the policy's ranking: the gateway retries down the list. 0 = the
    /// primary alone (a gateway whose original-destination cluster reads one `IP:PORT` needs
    /// that). At most [`MAX_FALLBACKS`].
    pub fallbacks: usize,
    /// Each data-parallel rank of a worker is its own target, `IP:(PORT + rank - dp_start)` of
    /// the worker's endpoint (one engine API server per rank, as an InferencePool's
    /// `targetPorts` lists them), instead of one address with the rank in the
    /// `x-data-parallel-rank` header.
    pub dp_rank_ports: bool,
    /// The Gateway API Inference Extension conformance suite's test hooks: the request header
    /// `test-epp-endpoint-selection` restricts the candidates, and the response carries
    /// `x-conformance-test-served-endpoint`. Test-only: off in production, where a client must
    /// not steer its own routing.
    pub conformance_hooks: bool,
}

/// Most fallbacks `[ext_proc] fallbacks` may ask for.
pub const MAX_FALLBACKS: usize = 16;

impl ExtProcSection {
    /// Checks the values a type cannot: a problem named by its key.
    pub fn validate(&self) -> Result<(), String> {
        if self.fallbacks > MAX_FALLBACKS {
            return Err(format!(
                "ext_proc.fallbacks ({}) is over {MAX_FALLBACKS}",
                self.fallbacks
            ));
        }
        Ok(())
    }
}

fn listen_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) => kvroute_api::listen::parse_listen(&s)
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

    #[test]
    fn the_protocol_options_default_off_and_fallbacks_are_bounded() {
        let s: ExtProcSection = toml::from_str("").unwrap();
        assert_eq!(
            (s.fallbacks, s.dp_rank_ports, s.conformance_hooks),
            (0, false, false)
        );
        let s: ExtProcSection =
            toml::from_str("fallbacks = 3\ndp_rank_ports = true\nconformance_hooks = true")
                .unwrap();
        assert_eq!(
            (s.fallbacks, s.dp_rank_ports, s.conformance_hooks),
            (3, true, true)
        );
        assert!(s.validate().is_ok());
        let s: ExtProcSection = toml::from_str("fallbacks = 17").unwrap();
        assert!(s.validate().unwrap_err().contains("ext_proc.fallbacks"));
    }
}
