//! The paging shared by the listing endpoints (`GET /v1/sessions`, `GET /v1/tenants`): `after`
//! (list the entries whose keys sort after this one, the previous page's `next_after`) and
//! `limit` (default 100, at most [`MAX_PAGE`]). A bad `limit` or an unknown parameter is a 400
//! naming it.

use axum::extract::rejection::QueryRejection;
use axum::extract::Query;
use serde::Deserialize;

use super::error::ApiError;

/// Most entries one page lists.
pub const MAX_PAGE: usize = 1000;

/// A page's query, as sent.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<String>,
}

/// A page's query, checked.
pub struct Page {
    pub after: Option<String>,
    pub limit: usize,
}

impl Page {
    pub fn of(q: Result<Query<PageQuery>, QueryRejection>) -> Result<Self, ApiError> {
        let Query(q) = q.map_err(|e| ApiError::invalid_field("query", e.body_text()))?;
        let limit = match q.limit.as_deref() {
            None => 100,
            Some(l) => match l.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
                _ => {
                    return Err(ApiError::invalid_field(
                        "limit",
                        format!("must be an integer from 1 to {MAX_PAGE}, got {l:?}"),
                    ))
                }
            },
        };
        Ok(Self {
            after: q.after,
            limit,
        })
    }
}
