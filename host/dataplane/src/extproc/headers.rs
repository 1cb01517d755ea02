//! What Envoy's messages say and what we say back, in Envoy's types: its header lists, the
//! request's filter metadata (the subset hint), header mutations, the `envoy.lb` dynamic metadata
//! and immediate responses. Kept apart from the stream's state machine so that one reads as the
//! protocol and this one as the encoding.

use axum::http::{HeaderMap, HeaderName, HeaderValue as HttpValue};
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap as EnvoyHeaders, HeaderValue,
    HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{HeaderMutation, ImmediateResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

use crate::proxy::error::{ErrorShape, ProxyError};

/// The header (and `envoy.lb` metadata key) naming the chosen endpoint, `IP:PORT`.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace Envoy's load balancer reads the destination from.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the subset hint, and its key.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";

/// The `envoy.lb` key (in the response path's filter metadata) naming the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The conformance suite's request header restricting the candidates: `IP` or `IP:PORT`
/// entries, comma-separated (`[ext_proc] conformance_hooks`).
pub const TEST_SELECTION: &str = "test-epp-endpoint-selection";
/// The conformance suite's response header: the endpoint that served, as the gateway reported it.
pub const CONFORMANCE_SERVED: &str = "x-conformance-test-served-endpoint";

/// Envoy's request headers: the pseudo-headers (`:path`, `:method`, `:status`) apart, the rest as
/// an HTTP header map (names Envoy sends are lower case; one that is not a valid header is
/// skipped, as an HTTP server would refuse it).
#[derive(Debug, Default)]
pub struct Headers {
    pub path: String,
    pub method: String,
    pub status: Option<u16>,
    pub map: HeaderMap,
}

impl Headers {
    pub fn read(h: Option<&EnvoyHeaders>) -> Headers {
        let mut out = Headers::default();
        for hv in h.map(|h| h.headers.as_slice()).unwrap_or_default() {
            // Envoy sends `raw_value` (bytes); `value` is the older string field.
            let v: &[u8] = if hv.raw_value.is_empty() {
                hv.value.as_bytes()
            } else {
                &hv.raw_value
            };
            match hv.key.as_str() {
                ":path" => out.path = String::from_utf8_lossy(v).into_owned(),
                ":method" => out.method = String::from_utf8_lossy(v).into_owned(),
                ":status" => out.status = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()),
                k if k.starts_with(':') => {}
                k => {
                    if let (Ok(name), Ok(value)) = (
                        HeaderName::from_bytes(k.as_bytes()),
                        HttpValue::from_bytes(v),
                    ) {
                        out.map.append(name, value);
                    }
                }
            }
        }
        out
    }
}

/// The subset hint in a request's filter metadata: `None` when absent (every endpoint is
/// eligible), else the `IP:PORT` entries (a list of strings, or one comma-separated string).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let v = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET)?;
    let mut out = Vec::new();
    match &v.kind {
        Some(Kind::ListValue(l)) => {
            for x in &l.values {
                if let Some(Kind::StringValue(s)) = &x.kind {
                    out.extend(split(s));
                }
            }
        }
        Some(Kind::StringValue(s)) => out.extend(split(s)),
        _ => {}
    }
    Some(out)
}

/// The endpoint that served the request, from the response path's filter metadata
/// (`envoy.lb` / `x-gateway-destination-endpoint-served`): `None` when the gateway did not say.
/// A list (or a comma-separated string) is read as its first entry.
pub fn served_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    let v = metadata?
        .filter_metadata
        .get(DESTINATION_NAMESPACE)?
        .fields
        .get(SERVED)?;
    match &v.kind {
        Some(Kind::StringValue(s)) => split(s).next(),
        Some(Kind::ListValue(l)) => l.values.iter().find_map(|x| match &x.kind {
            Some(Kind::StringValue(s)) => split(s).next(),
            _ => None,
        }),
        _ => None,
    }
}

/// The test selection header's entries (`IP` or `IP:PORT`), `None` when absent or empty.
pub fn test_selection(map: &HeaderMap) -> Option<Vec<String>> {
    let v = map.get(TEST_SELECTION)?.to_str().ok()?;
    let out: Vec<String> = split(v).collect();
    (!out.is_empty()).then_some(out)
}

/// Whether `address` (`IP:PORT`) is named by `entries`: the same `IP:PORT`, or its host alone
/// (every port of that host, as the conformance suite names pods by IP).
pub fn selected(address: &str, entries: &[String]) -> bool {
    let host = split_port(address).map_or(address, |(h, _)| h);
    entries.iter().any(|e| e == address || e == host)
}

/// `HOST:PORT` (`[V6]:PORT` too) split at the port.
pub fn split_port(address: &str) -> Option<(&str, u16)> {
    let (host, port) = address.rsplit_once(':')?;
    if host.contains(':') && !host.starts_with('[') {
        return None;
    }
    Some((host, port.parse().ok()?))
}

/// The address of a worker's data-parallel rank when each rank listens on its own port: the
/// endpoint's port plus the rank's offset in the worker (`None` past port 65535).
pub fn rank_address(address: &str, offset: u32) -> Option<String> {
    if offset == 0 {
        return Some(address.to_string());
    }
    let (host, port) = split_port(address)?;
    let port = u16::try_from(u32::from(port) + offset).ok()?;
    Some(format!("{host}:{port}"))
}

fn split(s: &str) -> impl Iterator<Item = String> + '_ {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(str::to_string)
}

/// The `IP:PORT` Envoy must connect to for a worker's `endpoint` (`http://HOST:PORT[/prefix]`):
/// the scheme and path go, a missing port is the scheme's.
pub fn address_of(endpoint: &str) -> Option<String> {
    let (scheme, rest) = match endpoint.split_once("://") {
        Some((s, r)) => (s, r),
        None => ("http", endpoint),
    };
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit('@').next()?;
    if authority.is_empty() {
        return None;
    }
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    if has_port {
        return Some(authority.to_string());
    }
    let port = if scheme.eq_ignore_ascii_case("https") {
        443
    } else {
        80
    };
    Some(format!("{authority}:{port}"))
}

/// Headers to set, overwriting any the request carries.
pub fn mutation(set: &[(&str, String)]) -> HeaderMutation {
    HeaderMutation {
        set_headers: set
            .iter()
            .map(|(k, v)| HeaderValueOption {
                header: Some(HeaderValue {
                    key: (*k).to_string(),
                    raw_value: v.clone().into_bytes(),
                    ..Default::default()
                }),
                append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                ..Default::default()
            })
            .collect(),
        remove_headers: Vec::new(),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": "IP:PORT[,IP:PORT...]"}}`: the same value
/// as the header (the protocol forbids the two to differ).
pub fn destination_metadata(address: &str) -> Struct {
    let inner = Struct {
        fields: [(DESTINATION.to_string(), string(address))].into(),
    };
    Struct {
        fields: [(
            DESTINATION_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// The answer Envoy sends the client instead of forwarding: the proxy's error body (in the shape
/// of the endpoint's clients), its status, `Retry-After` when the error has one, and the request
/// id.
pub fn immediate(e: &ProxyError, request_id: &str, shape: ErrorShape) -> ImmediateResponse {
    let mut set = vec![("content-type", "application/json".to_string())];
    if let Some(s) = e.0.retry_after {
        set.push(("retry-after", s.to_string()));
    }
    if !request_id.is_empty() {
        set.push(("x-request-id", request_id.to_string()));
    }
    ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(e.status().as_u16()),
        }),
        headers: Some(mutation(&set)),
        body: e.body_for(shape),
        grpc_status: None,
        details: e.code().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    #[test]
    fn an_endpoint_becomes_the_address_envoy_connects_to() {
        assert_eq!(
            address_of("http://10.0.0.7:8000").as_deref(),
            Some("10.0.0.7:8000")
        );
        assert_eq!(
            address_of("http://10.0.0.7:8000/v1/").as_deref(),
            Some("10.0.0.7:8000")
        );
        assert_eq!(
            address_of("https://10.0.0.7").as_deref(),
            Some("10.0.0.7:443")
        );
        assert_eq!(
            address_of("http://10.0.0.7").as_deref(),
            Some("10.0.0.7:80")
        );
        assert_eq!(
            address_of("http://[::1]:9000/x").as_deref(),
            Some("[::1]:9000")
        );
        assert_eq!(address_of("http://[::1]").as_deref(), Some("[::1]:80"));
        assert_eq!(
            address_of("10.0.0.7:8000").as_deref(),
            Some("10.0.0.7:8000")
        );
        assert_eq!(address_of("http://"), None);
    }

    fn hint(v: Value) -> Metadata {
        Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET.to_string(), v)].into(),
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:80"), string(" 10.0.0.2:80 ")],
            })),
        };
        assert_eq!(
            subset_hint(Some(&hint(list))),
            Some(vec!["10.0.0.1:80".to_string(), "10.0.0.2:80".to_string()])
        );
        assert_eq!(
            subset_hint(Some(&hint(string("10.0.0.1:80,10.0.0.3:80")))),
            Some(vec!["10.0.0.1:80".to_string(), "10.0.0.3:80".to_string()])
        );
        // Present but empty: nothing is eligible (503), which is not the same as absent.
        let empty = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![] })),
        };
        assert_eq!(subset_hint(Some(&hint(empty))), Some(vec![]));
    }

    #[test]
    fn envoy_headers_are_read_with_their_pseudo_headers_apart() {
        let h = EnvoyHeaders {
            headers: vec![
                HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/completions?x=1".to_vec(),
                    ..Default::default()
                },
                HeaderValue {
                    key: "x-kvroute-priority".into(),
                    value: "3".into(),
                    ..Default::default()
                },
                HeaderValue {
                    key: "bad name".into(),
                    raw_value: b"x".to_vec(),
                    ..Default::default()
                },
            ],
        };
        let r = Headers::read(Some(&h));
        assert_eq!(r.path, "/v1/completions?x=1");
        assert_eq!(r.map.get("x-kvroute-priority").unwrap(), "3");
        assert_eq!(r.map.len(), 1);
    }

    #[test]
    fn the_served_endpoint_is_read_from_the_envoy_lb_metadata() {
        let md = |v: Value| Metadata {
            filter_metadata: [(
                DESTINATION_NAMESPACE.to_string(),
                Struct {
                    fields: [(SERVED.to_string(), v)].into(),
                },
            )]
            .into(),
            ..Default::default()
        };
        assert_eq!(served_endpoint(None), None);
        assert_eq!(served_endpoint(Some(&Metadata::default())), None);
        assert_eq!(
            served_endpoint(Some(&md(string(" 10.0.0.2:8000 ")))).as_deref(),
            Some("10.0.0.2:8000")
        );
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.3:8000")],
            })),
        };
        assert_eq!(
            served_endpoint(Some(&md(list))).as_deref(),
            Some("10.0.0.3:8000")
        );
        // The subset hint's namespace is not the served endpoint's.
        assert_eq!(served_endpoint(Some(&hint(string("10.0.0.1:80")))), None);
    }

    #[test]
    fn selection_entries_name_an_address_or_every_port_of_a_host() {
        let e = vec!["10.0.0.1".to_string(), "10.0.0.2:8001".to_string()];
        assert!(selected("10.0.0.1:8000", &e));
        assert!(selected("10.0.0.1:9999", &e));
        assert!(selected("10.0.0.2:8001", &e));
        assert!(!selected("10.0.0.2:8000", &e));
        assert!(!selected("10.0.0.10:8000", &e));
        assert!(selected("[::1]:80", &["[::1]".to_string()]));
        let mut map = HeaderMap::new();
        assert_eq!(test_selection(&map), None);
        map.insert(TEST_SELECTION, HttpValue::from_static(" , "));
        assert_eq!(test_selection(&map), None);
        map.insert(
            TEST_SELECTION,
            HttpValue::from_static("10.0.0.1, 10.0.0.2:8001"),
        );
        assert_eq!(test_selection(&map), Some(e));
    }

    #[test]
    fn a_rank_port_is_the_endpoint_port_plus_the_rank_offset() {
        assert_eq!(
            rank_address("10.0.0.1:8000", 0).as_deref(),
            Some("10.0.0.1:8000")
        );
        assert_eq!(
            rank_address("10.0.0.1:8000", 3).as_deref(),
            Some("10.0.0.1:8003")
        );
        assert_eq!(rank_address("[::1]:8000", 1).as_deref(), Some("[::1]:8001"));
        assert_eq!(rank_address("10.0.0.1:65535", 1), None);
        assert_eq!(split_port("::1"), None);
    }

    #[test]
    fn the_destination_rides_in_the_envoy_lb_namespace() {
        let m = destination_metadata("10.0.0.1:8000");
        let Some(Kind::StructValue(inner)) = &m.fields[DESTINATION_NAMESPACE].kind else {
            panic!("{m:?}")
        };
        assert_eq!(
            inner.fields[DESTINATION].kind,
            Some(Kind::StringValue("10.0.0.1:8000".into()))
        );
    }
}
