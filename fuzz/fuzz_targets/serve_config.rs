//! The `kvroute serve --config` file: TOML parsed into `ServeConfig`, then validated.
//!
//! Asserts: no panic; a configuration `validate` accepts builds a router and registers all its
//! workers (as `serve` then does), and writes back to TOML that reads to the same configuration.
//! Inputs that mention `listen` are skipped: a `HOST:PORT` there is resolved through the system
//! resolver, which is neither ours to fuzz nor quick.
#![no_main]

use std::path::Path;

use kvroute_core::router::Router;
use kvroute_server::config::ServeConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if text.contains("listen") {
        return;
    }
    let Ok(config) = ServeConfig::from_toml_str(text, Path::new("")) else {
        return;
    };
    if config.validate().is_err() {
        return;
    }
    let router = Router::new(config.router_config()).expect("a validated config builds a router");
    let workers = config
        .register_workers(&router)
        .expect("a validated config registers its workers");
    assert_eq!(workers.len(), config.workers.len());
    assert!(config.http_threads() >= 1);
    if let Ok(back) = toml::to_string(&config) {
        let again = ServeConfig::from_toml_str(&back, Path::new(""))
            .unwrap_or_else(|e| panic!("written config does not read back: {e}\n{back}"));
        assert_eq!(again, config, "config changed through TOML:\n{back}");
    }
});
