//! Loading: compiling a component (or a pipeline of them), configuring, self-testing and warming
//! it up, and installing the result as a new version; all off the request path.

use crate::error::{FallbackReason, PolicyError};
use crate::health::FailureWindow;
use crate::instance::InstanceError;
use crate::pipeline::{is_path, PipelineSpec};
use crate::plugin::{sha256_hex, CompiledPlugin, PluginKind};
use crate::selftest;
use crate::stage::Stage;
use crate::stats::PolicyStats;
use crate::wire::with_wit_decision;
use crate::DecisionContext;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::SystemTime;

use super::*;

impl PolicyRegistry {
    /// Compiles `bytes`, or reuses the compiled component of identical bytes still in use.
    pub(super) fn compile(&self, bytes: &[u8]) -> Result<Arc<CompiledPlugin>, PolicyError> {
        let digest = sha256_hex(bytes);
        if let Some(plugin) = self
            .compiled
            .lock()
            .get(&digest)
            .and_then(std::sync::Weak::upgrade)
        {
            return Ok(plugin);
        }
        let plugin = self.runtime.compile(bytes)?;
        let mut cache = self.compiled.lock();
        cache.retain(|_, p| p.strong_count() > 0);
        cache.insert(digest, Arc::downgrade(&plugin));
        Ok(plugin)
    }

    /// Loads a component under `name` (a new version if the name exists): checks it is a policy
    /// component, compiles it, configures it with `config` (`{}` when `None`), self-tests it on
    /// synthetic decisions of 1, 8 and 64 candidates, warms its instances, and — when `activate`,
    /// or when `name` is the active policy — makes it active with one atomic swap.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        config: Option<&str>,
        activate: bool,
    ) -> Result<PolicyInfo, PolicyError> {
        validate_name(name)?;
        let config = normalize_config(config)?;
        let _admin = self.admin.lock();
        let plugin = self.compile(bytes)?;
        self.install(name, Build::Component { plugin, config }, activate)
    }

    /// Loads a pipeline under `name` (see [`PipelineSpec`]); relative `.wasm` paths are resolved
    /// against `base_dir` (default: the working directory).
    pub fn load_pipeline(
        &self,
        name: &str,
        spec: &PipelineSpec,
        base_dir: Option<&Path>,
        activate: bool,
    ) -> Result<PolicyInfo, PolicyError> {
        validate_name(name)?;
        spec.validate()?;
        let _admin = self.admin.lock();
        self.install(
            name,
            Build::Pipeline {
                spec: spec.clone(),
                base_dir: base_dir.map(Path::to_path_buf),
            },
            activate,
        )
    }

    /// Checks a component as `load` would (compile, configure, self-test) without keeping it.
    pub fn check(&self, bytes: &[u8], config: Option<&str>) -> Result<PolicyInfo, PolicyError> {
        let config = normalize_config(config)?;
        let plugin = self.compile(bytes)?;
        let version = self.build("check", 0, Build::Component { plugin, config })?;
        Ok(version.info(false))
    }

    /// Builds a version and records it under `name`; activates it when asked or when `name` is the
    /// active policy. Caller holds the admin lock.
    pub(super) fn install(
        &self,
        name: &str,
        build: Build,
        activate: bool,
    ) -> Result<PolicyInfo, PolicyError> {
        // The number is taken only when the version is installed, so a refused version leaves no
        // trace, its number included (the admin lock is held: no other install runs meanwhile).
        let number = self.state.lock().versions.get(name).map_or(1, |v| v + 1);
        let version = match self.build(name, number, build) {
            Ok(v) => Arc::new(v),
            Err(e) => {
                tracing::warn!(policy = name, code = e.code(), error = %e, "policy refused; nothing changed");
                return Err(e);
            }
        };
        let mut state = self.state.lock();
        state.versions.insert(name.to_string(), number);
        let name_active = self
            .active
            .load()
            .as_ref()
            .is_some_and(|a| &*a.policy.name == name);
        state.policies.insert(name.to_string(), version.clone());
        let now_active = activate || name_active;
        if now_active {
            self.set_active(&mut state, Some(version.clone()), true);
        }
        tracing::info!(
            policy = name,
            version = number,
            digest = version.digest(),
            active = now_active,
            "policy loaded"
        );
        Ok(version.info(now_active))
    }

    /// Resolves a pipeline stage's component: a loaded single-component policy or a file.
    pub(super) fn resolve(
        &self,
        component: &str,
        base_dir: Option<&Path>,
    ) -> Result<(Arc<CompiledPlugin>, String), PolicyError> {
        if is_path(component) {
            let path = match base_dir {
                Some(dir) if Path::new(component).is_relative() => dir.join(component),
                _ => PathBuf::from(component),
            };
            let bytes = std::fs::read(&path).map_err(|e| PolicyError::Io {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
            let plugin = self
                .compile(&bytes)
                .map_err(|e| PolicyError::Pipeline(format!("component {}: {e}", path.display())))?;
            return Ok((plugin, "{}".to_string()));
        }
        let version = self.get(component).ok_or_else(|| {
            PolicyError::Pipeline(format!(
                "stage component {component:?} is neither a loaded policy nor a .wasm path"
            ))
        })?;
        match &version.source {
            Source::Component { plugin } => Ok((plugin.clone(), version.config.clone())),
            Source::Pipeline { .. } => Err(PolicyError::Pipeline(format!(
                "stage component {component:?} is itself a pipeline; stages must be components"
            ))),
        }
    }

    /// Configures the stages, self-tests, and warms the instances of a new version.
    pub(super) fn build(
        &self,
        name: &str,
        number: u64,
        build: Build,
    ) -> Result<PolicyVersion, PolicyError> {
        let shared = self.runtime.shared.clone();
        let policy_name: Arc<str> = Arc::from(name);
        let stats = Arc::new(PolicyStats::default());
        let new_stage = |plugin: Arc<CompiledPlugin>, config: String, weight: f64| {
            Arc::new(Stage::new(
                plugin,
                config,
                weight,
                policy_name.clone(),
                shared.clone(),
                stats.clone(),
            ))
        };
        let (source, config, scorers, selector, digest) = match build {
            Build::Component { plugin, config } => {
                let digest = plugin.digest.clone();
                let stage = new_stage(plugin.clone(), config.clone(), 1.0);
                (
                    Source::Component { plugin },
                    config,
                    vec![stage],
                    None,
                    digest,
                )
            }
            Build::Pipeline { spec, base_dir } => {
                let mut canonical = String::from("kvroute-pipeline-v1\n");
                let mut scorers = Vec::new();
                for (i, s) in spec.stages.iter().enumerate() {
                    let (plugin, default_config) =
                        self.resolve(&s.component, base_dir.as_deref())?;
                    if plugin.info.kind == PluginKind::Selector {
                        return Err(PolicyError::Pipeline(format!(
                            "stages[{i}] ({}) is a selector plugin: put it in `selector`",
                            s.component
                        )));
                    }
                    let config = s.config.as_ref().map_or(default_config, |v| v.to_string());
                    canonical.push_str(&format!(
                        "scorer {} {} {}\n",
                        plugin.digest, s.weight, config
                    ));
                    scorers.push(new_stage(plugin, config, s.weight));
                }
                let selector = match &spec.selector {
                    Some(sel) => {
                        let (plugin, default_config) =
                            self.resolve(&sel.component, base_dir.as_deref())?;
                        let config = sel
                            .config
                            .as_ref()
                            .map_or(default_config, |v| v.to_string());
                        canonical.push_str(&format!("selector {} {}\n", plugin.digest, config));
                        Some(new_stage(plugin, config, 1.0))
                    }
                    None => None,
                };
                let config = serde_json::to_string(&spec).unwrap_or_default();
                let digest = sha256_hex(canonical.as_bytes());
                (
                    Source::Pipeline { spec, base_dir },
                    config,
                    scorers,
                    selector,
                    digest,
                )
            }
        };
        let version = PolicyVersion {
            name: policy_name.clone(),
            version: number,
            digest,
            loaded_at: SystemTime::now(),
            config,
            source,
            scorers,
            selector,
            stats,
            consecutive_failures: AtomicU32::new(0),
            recent: FailureWindow::new(self.config().failure_window as usize),
            last_failure: parking_lot::Mutex::new(None),
        };

        // Configure one instance per stage: a rejected configuration surfaces verbatim.
        for stage in version.stages() {
            let inst = stage.new_instance().map_err(|e| match e {
                InstanceError::ConfigRejected(m) => PolicyError::ConfigRejected(m),
                InstanceError::Failed { during, message } => {
                    PolicyError::Trapped { during, message }
                }
            })?;
            stage.put(inst);
        }
        // Self-test on synthetic decisions, drawn like traffic on the router's taint table and
        // block size (see selftest.rs).
        let table = self
            .last_taints
            .load_full()
            .map_or_else(TaintTable::default, |t| (*t).clone());
        let block_size = self.last_block_size.load(Relaxed);
        let ticks = shared.setup_ticks;
        let draw = selftest::Draw::fresh();
        // Booked and ask-only alternate over the sizes, from a random start: both kinds are
        // always tested, and which size gets which is not fixed.
        let first_ask_only = draw.coin();
        for (i, n) in selftest::SELF_TEST_SIZES.into_iter().enumerate() {
            let ask_only = first_ask_only ^ (i % 2 == 1);
            let (req, cols) = draw.decision(n, &table, block_size, ask_only);
            let ctx = DecisionContext {
                taints: &table,
                block_size: req.block_size,
            };
            with_wit_decision(&req, &cols, kvroute_core::Stage::Aggregated, |wreq, wc| {
                version.run(wreq, wc, ctx, ticks, true)
            })
            .map_err(|f| {
                PolicyError::SelfTest(format!("{n} candidates: {} ({})", f.reason, f.detail))
            })?;
        }
        // The serving deadline: a policy that cannot answer an 8-candidate decision in time
        // even once in three tries would fall back on every decision, and be taken out by the
        // automatic restore after a few. Refusing it here says why at once. Each try first
        // warms its instance without a deadline (a missed deadline replaces the instance, and a
        // first call is slow), so three tries are three warm calls. This runs before the warm-up
        // below, which leaves every pooled instance synced to the router's context.
        {
            let (req, cols) = draw.decision(8, &table, block_size, draw.coin());
            let ctx = DecisionContext {
                taints: &table,
                block_size: req.block_size,
            };
            let mut in_time = false;
            for _ in 0..3 {
                with_wit_decision(&req, &cols, kvroute_core::Stage::Aggregated, |wreq, wc| {
                    version.run(wreq, wc, ctx, ticks, true)
                })
                .map_err(|f| {
                    PolicyError::SelfTest(format!("8 candidates: {} ({})", f.reason, f.detail))
                })?;
                match with_wit_decision(&req, &cols, kvroute_core::Stage::Aggregated, |wreq, wc| {
                    version.run(wreq, wc, ctx, shared.deadline_ticks, true)
                }) {
                    Ok(_) => {
                        in_time = true;
                        break;
                    }
                    Err(f) if f.reason == FallbackReason::Deadline => {}
                    Err(f) => {
                        return Err(PolicyError::SelfTest(format!(
                            "8 candidates, serving deadline: {} ({})",
                            f.reason, f.detail
                        )))
                    }
                }
            }
            if !in_time {
                return Err(PolicyError::SelfTest(format!(
                    "8 candidates: no answer within the serving deadline of {} µs \
                     (policy_runtime.deadline_us) in 3 warm tries; every decision would fall \
                     back. Make decide faster, or raise the deadline",
                    shared.config.deadline_us
                )));
            }
        }
        // Warm: make the pool's instances and run one decision on each (first calls are slow),
        // then hand them the router's current taint table.
        let target = shared.instances_per_stage;
        let router_taints = self.last_taints.load_full();
        for stage in version.stages() {
            stage.refill(target);
            let mut warmed = Vec::new();
            while let Some(inst) = stage.take_pooled() {
                warmed.push(inst);
            }
            for inst in &mut warmed {
                let (req, cols) = draw.decision(8, &table, block_size, draw.coin());
                let ctx = DecisionContext {
                    taints: &table,
                    block_size: req.block_size,
                };
                with_wit_decision(&req, &cols, kvroute_core::Stage::Aggregated, |wreq, wc| {
                    inst.decide(wreq, wc, ctx, ticks)
                })
                .map_err(|f| {
                    PolicyError::SelfTest(format!("warm-up: {} ({})", f.reason, f.detail))
                })?;
                if let Some(t) = &router_taints {
                    let ctx = DecisionContext {
                        taints: t,
                        block_size: self.last_block_size.load(Relaxed),
                    };
                    inst.sync_context(ctx, ticks).map_err(|f| {
                        PolicyError::SelfTest(format!("set-context: {} ({})", f.reason, f.detail))
                    })?;
                }
            }
            for inst in warmed {
                stage.put(inst);
            }
        }
        Ok(version)
    }
}
