//! Per-tenant budgets: requests and tokens per minute (SPEC §9, "Budgets").
//!
//! A tenant listed with a budget may have at most `requests_per_minute` requests and
//! `tokens_per_minute` tokens admitted in any 60-second window; a request past either is refused
//! with [`OverBudget`] (HTTP 429 with `Retry-After`: the seconds until enough of the window has
//! passed for the request to fit). A request counts when it is admitted to routing (routed at once
//! or queued), as 1 request and `prompt tokens + expected output tokens`; a refused request counts
//! nothing. Requests that only ask (`book: false`) are neither checked nor counted. Tenants without
//! a budget are never refused.
//!
//! The window is 60 one-second buckets per tenant (time in whole seconds on the router's clock), so
//! a check is O(60) and the memory per tenant is fixed. A plain data structure: the router owns it
//! behind a lock.

use rustc_hash::FxHashMap;

/// The window, in seconds.
pub const WINDOW_SECS: u64 = 60;

/// One tenant's budget; `None` = unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantBudget {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
}

/// Which budget a request is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetKind {
    Requests,
    Tokens,
}

impl BudgetKind {
    /// The budget's configuration key (`fairness.tenants.NAME.<key>`).
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetKind::Requests => "requests_per_minute",
            BudgetKind::Tokens => "tokens_per_minute",
        }
    }
}

/// A request a tenant's budget refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "tenant {tenant:?} is over its {} budget (fairness.tenants.{tenant}.{} = {limit}; {used} used in the last 60 s, this request needs {need}){}",
    kind.as_str(), kind.as_str(),
    if *never { "; the request alone is larger than the budget".to_string() } else { format!("; retry in {retry_after_secs} s") }
)]
pub struct OverBudget {
    pub tenant: String,
    pub kind: BudgetKind,
    pub limit: u64,
    pub used: u64,
    pub need: u64,
    /// Seconds until the request would fit (at least 1; the whole window when it never can).
    pub retry_after_secs: u32,
    /// The request alone is larger than the budget: it never fits.
    pub never: bool,
}

/// One budget to check: which, its limit, what the request needs, and the bucket field it reads.
type Check = (BudgetKind, Option<u64>, u64, fn(&Bucket) -> u64);

#[derive(Clone, Copy, Default, Debug)]
struct Bucket {
    sec: u64,
    requests: u64,
    tokens: u64,
}

#[derive(Debug)]
struct Window {
    buckets: [Bucket; WINDOW_SECS as usize],
}

impl Window {
    fn new() -> Self {
        Self {
            buckets: [Bucket {
                sec: u64::MAX,
                ..Bucket::default()
            }; WINDOW_SECS as usize],
        }
    }

    /// Whether `b` is inside the window ending at `now` (the last 60 whole seconds, now included).
    fn live(b: &Bucket, now: u64) -> bool {
        b.sec != u64::MAX && b.sec <= now && b.sec + WINDOW_SECS > now
    }

    fn used(&self, now: u64, field: fn(&Bucket) -> u64) -> u64 {
        self.buckets
            .iter()
            .filter(|b| Self::live(b, now))
            .map(field)
            .sum()
    }

    /// Seconds until `used + need <= limit`, as buckets leave the window (need <= limit).
    fn wait(&self, now: u64, need: u64, limit: u64, field: fn(&Bucket) -> u64) -> u32 {
        let mut live: Vec<&Bucket> = self.buckets.iter().filter(|b| Self::live(b, now)).collect();
        live.sort_by_key(|b| b.sec);
        let mut used: u64 = live.iter().map(|b| field(b)).sum();
        for b in live {
            used -= field(b);
            if used + need <= limit {
                // bucket `b.sec` leaves the window at `b.sec + 60`
                return u32::try_from((b.sec + WINDOW_SECS - now).max(1)).unwrap_or(u32::MAX);
            }
        }
        1
    }

    fn add(&mut self, now: u64, tokens: u64) {
        let b = &mut self.buckets[(now % WINDOW_SECS) as usize];
        if b.sec != now {
            *b = Bucket {
                sec: now,
                requests: 0,
                tokens: 0,
            };
        }
        b.requests += 1;
        b.tokens += tokens;
    }
}

/// Every tenant's budget and window.
#[derive(Debug, Default)]
pub struct Budgets {
    limits: FxHashMap<String, TenantBudget>,
    windows: FxHashMap<String, Window>,
}

impl Budgets {
    /// Budgets for the tenants listed (tenants without a limit are dropped).
    pub fn new(limits: FxHashMap<String, TenantBudget>) -> Self {
        Self {
            limits: limits
                .into_iter()
                .filter(|(_, b)| b.requests_per_minute.is_some() || b.tokens_per_minute.is_some())
                .collect(),
            windows: FxHashMap::default(),
        }
    }

    /// The tenants with a budget and their limits.
    pub fn limits(&self) -> &FxHashMap<String, TenantBudget> {
        &self.limits
    }

    /// Whether any tenant has a budget.
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Admits a request of `tenant` needing `tokens` at `now_secs` (whole seconds) and counts it,
    /// or refuses it, counting nothing. The requests budget is checked first.
    pub fn admit(&mut self, tenant: &str, tokens: u64, now_secs: u64) -> Result<(), OverBudget> {
        let Some(limit) = self.limits.get(tenant) else {
            return Ok(());
        };
        let w = self
            .windows
            .entry(tenant.to_string())
            .or_insert_with(Window::new);
        let checks: [Check; 2] = [
            (BudgetKind::Requests, limit.requests_per_minute, 1, |b| {
                b.requests
            }),
            (BudgetKind::Tokens, limit.tokens_per_minute, tokens, |b| {
                b.tokens
            }),
        ];
        for (kind, max, need, field) in checks {
            let Some(max) = max else { continue };
            let used = w.used(now_secs, field);
            if used.saturating_add(need) <= max {
                continue;
            }
            let never = need > max;
            let retry_after_secs = if never {
                WINDOW_SECS as u32
            } else {
                w.wait(now_secs, need, max, field)
            };
            return Err(OverBudget {
                tenant: tenant.to_string(),
                kind,
                limit: max,
                used,
                need,
                retry_after_secs,
                never,
            });
        }
        w.add(now_secs, tokens);
        Ok(())
    }

    /// What `tenant` has used in the window ending at `now_secs`: (requests, tokens).
    pub fn used(&self, tenant: &str, now_secs: u64) -> (u64, u64) {
        self.windows.get(tenant).map_or((0, 0), |w| {
            (
                w.used(now_secs, |b| b.requests),
                w.used(now_secs, |b| b.tokens),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(req: Option<u64>, tok: Option<u64>) -> Budgets {
        let mut m = FxHashMap::default();
        m.insert(
            "acme".to_string(),
            TenantBudget {
                requests_per_minute: req,
                tokens_per_minute: tok,
            },
        );
        m.insert("free".to_string(), TenantBudget::default());
        Budgets::new(m)
    }

    #[test]
    fn requests_budget_refuses_then_frees_as_the_window_moves() {
        let mut b = budgets(Some(3), None);
        b.admit("acme", 10, 100).unwrap();
        b.admit("acme", 10, 110).unwrap();
        b.admit("acme", 10, 110).unwrap();
        let e = b.admit("acme", 10, 120).unwrap_err();
        assert_eq!(e.kind, BudgetKind::Requests);
        assert_eq!((e.used, e.limit, e.need), (3, 3, 1));
        // the request of second 100 leaves the window at 160: 40 s from 120
        assert_eq!(e.retry_after_secs, 40);
        assert!(!e.never);
        assert_eq!(
            e.to_string(),
            "tenant \"acme\" is over its requests_per_minute budget (fairness.tenants.acme.requests_per_minute = 3; 3 used in the last 60 s, this request needs 1); retry in 40 s"
        );
        // a refusal counts nothing
        assert_eq!(b.used("acme", 120), (3, 30));
        assert!(b.admit("acme", 10, 159).is_err());
        b.admit("acme", 10, 160).unwrap();
        // other tenants, and tenants without limits, are never refused
        for _ in 0..100 {
            b.admit("free", 1_000_000, 120).unwrap();
            b.admit("someone", 1_000_000, 120).unwrap();
        }
    }

    #[test]
    fn tokens_budget_waits_for_enough_to_leave() {
        let mut b = budgets(None, Some(1_000));
        b.admit("acme", 400, 0).unwrap();
        b.admit("acme", 400, 30).unwrap();
        let e = b.admit("acme", 500, 45).unwrap_err();
        assert_eq!(e.kind, BudgetKind::Tokens);
        // dropping second 0's 400 is enough: at 60, 15 s from now
        assert_eq!(e.retry_after_secs, 15);
        let e = b.admit("acme", 1_000, 45).unwrap_err();
        // both must leave: second 30's leaves at 90
        assert_eq!(e.retry_after_secs, 45);
        let e = b.admit("acme", 1_001, 45).unwrap_err();
        assert!(e.never);
        assert_eq!(e.retry_after_secs, 60);
        assert!(e
            .to_string()
            .ends_with("the request alone is larger than the budget"));
        b.admit("acme", 500, 60).unwrap();
    }

    #[test]
    fn an_old_bucket_is_reused_not_added_to() {
        let mut b = budgets(Some(2), None);
        b.admit("acme", 0, 5).unwrap();
        b.admit("acme", 0, 65).unwrap(); // same slot, next minute
        assert_eq!(b.used("acme", 65), (1, 0));
        b.admit("acme", 0, 66).unwrap();
        assert!(b.admit("acme", 0, 66).is_err());
    }
}
