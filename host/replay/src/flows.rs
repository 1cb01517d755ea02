//! Who waits for whom in a closed-loop workload: each request's session and tenant, the requests
//! it waits for and the think time after them. [`crate::agents`] builds them beside its requests,
//! a [`crate::trace::Trace`] carries them, and the simulator releases a request when those it
//! waits for have finished (docs/SIMULATOR.md, "Agentic workload"). Their own module so the
//! trace (which carries them) and the generator (which builds a trace) depend on them, not on
//! each other.

use serde::Serialize;

/// One session of the workload.
#[derive(Clone, Debug, Serialize)]
pub struct AgentSession {
    /// Its parent's index, for a subagent.
    pub parent: Option<u32>,
    pub tenant: u32,
    /// Its requests (turns), in order.
    pub requests: Vec<u32>,
}

/// What the simulator needs besides the requests: who waits for whom.
#[derive(Clone, Debug, Default)]
pub struct AgentFlows {
    /// Per request: its session.
    pub session: Vec<u32>,
    /// Per request: the requests that must finish before it starts (empty: it starts at its
    /// trace arrival time).
    pub deps: Vec<Vec<u32>>,
    /// Per request: the think time between the last of its deps finishing and its start, ms.
    pub think_ms: Vec<f64>,
    pub sessions: Vec<AgentSession>,
}

impl AgentFlows {
    /// The session id request `i` is routed with (subagents carry their own).
    pub fn session_id(&self, i: usize) -> String {
        format!("agent-{}", self.session[i])
    }

    /// The parent session id request `i` is routed with: a subagent's turns name their parent's
    /// session, as agent harnesses do (the server reads it from their headers), so the router
    /// can start a subagent where its parent is bound (SPEC §12).
    pub fn parent_session_id(&self, i: usize) -> Option<String> {
        self.sessions[self.session[i] as usize]
            .parent
            .map(|p| format!("agent-{p}"))
    }

    /// The tenant request `i` is routed with.
    pub fn tenant(&self, i: usize) -> String {
        format!("tenant-{}", self.sessions[self.session[i] as usize].tenant)
    }
}
