//! The router's tenants as an operator reads them (`GET /v1/tenants`): each one's fair-queueing
//! weight and attained service, what it has waiting, and its budgets beside what the last 60 s
//! used. Fair queueing and budgets decide who is served and who is refused; without this read an
//! operator sees their effect only in the clients' latencies and 429s.
//!
//! Called by the HTTP layer, never on the serving path. It takes the queue's lock, lets it go,
//! then the budgets' lock: never both at once, so it adds no lock order to the router's. Each half
//! is consistent in itself; a request admitted between the two may show in one and not the other.

use std::collections::BTreeSet;

use serde::Serialize;

use super::Router;
use crate::budget::Budgets;
use crate::queue::{FairConfig, TenantStanding};

/// One tenant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TenantView {
    pub tenant: String,
    /// Its fair-queueing weight (`[fairness.tenants.NAME] weight`, else `[fairness]
    /// default_weight`); `None` without fair queueing.
    pub weight: Option<f64>,
    /// Its decayed attained service, tokens; `None` without fair queueing.
    pub attained_tokens: Option<f64>,
    /// Its requests waiting in the router's queue.
    pub waiting_requests: usize,
    /// Their prompt tokens.
    pub waiting_prompt_tokens: u64,
    /// Its budgets; `None` when it has none.
    pub budget: Option<BudgetView>,
}

/// A tenant's budgets and what the sliding minute holds against them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BudgetView {
    /// `[fairness.tenants.NAME] requests_per_minute`; `None`: no limit.
    pub requests_per_minute: Option<u64>,
    /// `[fairness.tenants.NAME] tokens_per_minute`; `None`: no limit.
    pub tokens_per_minute: Option<u64>,
    /// Requests admitted in the last 60 s.
    pub used_requests: u64,
    /// Their tokens (prompt plus expected output) in the last 60 s.
    pub used_tokens: u64,
}

impl Router {
    /// Every tenant the router knows of, by name: the configured ones (a weight or a budget),
    /// those fair queueing keeps an account of (until its service decays below one token) and
    /// those with a request waiting.
    pub fn tenants(&self) -> Vec<TenantView> {
        let now = self.clock_secs();
        let mut standing = self.queue.lock().tenants(now);
        for t in self.configured_tenants() {
            standing.entry(t.to_string()).or_default();
        }
        let budgets = self.budgets.lock();
        let fair = self.config.fairness.as_ref();
        standing
            .into_iter()
            .map(|(tenant, s)| {
                let budget = budget_view(&budgets, &tenant, now);
                view(tenant, s, fair, budget)
            })
            .collect()
    }

    /// One tenant, known or not: what applies to it now (a tenant the router has not seen has
    /// nothing waiting and no service, but its weight and budget are already set).
    pub fn tenant(&self, tenant: &str) -> TenantView {
        let now = self.clock_secs();
        let s = self.queue.lock().tenant(tenant, now);
        let budget = budget_view(&self.budgets.lock(), tenant, now);
        view(tenant.to_string(), s, self.config.fairness.as_ref(), budget)
    }

    /// The tenants the configuration names (`[fairness.tenants.NAME]`: a weight or a budget),
    /// in name order.
    pub fn configured_tenants(&self) -> BTreeSet<&str> {
        let weights = self
            .config
            .fairness
            .iter()
            .flat_map(|f| f.tenant_weights.keys());
        weights
            .chain(self.config.budgets.keys())
            .map(String::as_str)
            .collect()
    }
}

/// `tenant`'s budgets at `now_secs`, when it has any. The budgets' window runs on whole seconds
/// of the router's clock, as admission counts them.
fn budget_view(budgets: &Budgets, tenant: &str, now_secs: f64) -> Option<BudgetView> {
    let b = budgets.limits().get(tenant)?;
    let (used_requests, used_tokens) = budgets.used(tenant, now_secs as u64);
    Some(BudgetView {
        requests_per_minute: b.requests_per_minute,
        tokens_per_minute: b.tokens_per_minute,
        used_requests,
        used_tokens,
    })
}

fn view(
    tenant: String,
    s: TenantStanding,
    fair: Option<&FairConfig>,
    budget: Option<BudgetView>,
) -> TenantView {
    TenantView {
        weight: fair.map(|f| f.weight(&tenant)),
        attained_tokens: fair.map(|_| s.attained_tokens),
        waiting_requests: s.waiting_requests,
        waiting_prompt_tokens: s.waiting_prompt_tokens,
        budget,
        tenant,
    }
}
