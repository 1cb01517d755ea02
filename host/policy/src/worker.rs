//! A named helper thread that runs jobs one at a time, in order, optionally at a lower CPU
//! priority than the threads that route: the runtime's maintenance thread (replacing instances
//! off the request path) and its compile thread.
//!
//! Compiling a component is the runtime's heaviest work (tens of milliseconds of Cranelift for a
//! Rust component, seconds for a Python one) and it must not take CPU from routing: on a 2-core
//! machine an upload compiled at the routers' priority (and on every core at once, by wasmtime's
//! parallel compilation) made routes sent meanwhile wait for the scheduler. So the runtime
//! compiles on one such thread, niced (see [`COMPILE_NICE`]), and serially.

use std::sync::mpsc;
use std::thread::JoinHandle;

/// How much lower than the process the compile thread runs (Linux nice levels, relative). At +10
/// the CFS weight is about a tenth of a nice-0 thread's: routes take the CPU first, yet a compile
/// still progresses beside other nice-0 work on a busy machine (at +19, about 1/70, an upload
/// could take minutes on a loaded box).
pub(crate) const COMPILE_NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

enum Message {
    Run(Job),
    Stop,
}

/// One helper thread and its job queue. Dropping it lets the jobs queued before finish, then
/// joins (handles may outlive it: what they send after is dropped unrun).
pub(crate) struct Worker {
    tx: mpsc::Sender<Message>,
    thread: Option<JoinHandle<()>>,
}

/// Sends jobs to a [`Worker`] without owning its thread (what the stages hold).
#[derive(Clone)]
pub(crate) struct WorkerHandle(mpsc::Sender<Message>);

impl WorkerHandle {
    /// Queues `job`; if the thread is gone (the runtime is being dropped) it is dropped unrun.
    pub(crate) fn submit(&self, job: impl FnOnce() + Send + 'static) {
        let _ = self.0.send(Message::Run(Box::new(job)));
    }
}

impl Worker {
    /// Starts the thread `name`, lowering its priority by `nice` (0: unchanged).
    pub(crate) fn spawn(name: &str, nice: i32) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Message>();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                if nice != 0 {
                    if let Err(e) = lower_priority(nice) {
                        tracing::warn!(error = %e, nice, "could not lower the priority of a policy helper thread");
                    }
                }
                while let Ok(Message::Run(job)) = rx.recv() {
                    job();
                }
            })?;
        Ok(Self {
            tx,
            thread: Some(thread),
        })
    }

    /// A handle that queues jobs on this thread.
    pub(crate) fn handle(&self) -> WorkerHandle {
        WorkerHandle(self.tx.clone())
    }

    /// Runs `job` on the thread and waits for its result (`None`: the thread is gone).
    pub(crate) fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let _ = done_tx.send(job());
        });
        self.tx.send(Message::Run(job)).ok()?;
        done_rx.recv().ok()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.tx.send(Message::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Lowers the calling thread's priority by `nice` levels (capped at 19). On Linux the nice value
/// is a property of the thread, so the other threads of the process keep theirs.
#[cfg(target_os = "linux")]
pub(crate) fn lower_priority(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
    // getpriority may legitimately answer -1: errno tells an error from that.
    // SAFETY: errno is thread-local; getpriority reads nothing of ours.
    let current = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid)
    };
    if current == -1 && std::io::Error::last_os_error().raw_os_error() != Some(0) {
        return Err(std::io::Error::last_os_error());
    }
    let target = current.saturating_add(nice).min(19);
    // SAFETY: plain system call on this thread's id.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, target) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Elsewhere the thread keeps the process's priority (the bound then is only the serial queue).
#[cfg(not(target_os = "linux"))]
pub(crate) fn lower_priority(_nice: i32) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_in_order_on_the_named_thread() {
        let w = Worker::spawn("kvroute-test-worker", 0).unwrap();
        let name = w.run(|| std::thread::current().name().map(str::to_string));
        assert_eq!(name, Some(Some("kvroute-test-worker".to_string())));
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for i in 0..5 {
            let order = order.clone();
            w.run(move || order.lock().unwrap().push(i));
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
        // Jobs queued through a handle run before the worker stops.
        let handle = w.handle();
        let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = ran.clone();
        handle.submit(move || r.store(true, std::sync::atomic::Ordering::SeqCst));
        drop(w);
        assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
        handle.submit(|| unreachable!("the thread is gone"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_niced_worker_runs_below_its_callers_priority() {
        let tid_nice = || {
            // SAFETY: as in `lower_priority`.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::getpriority(libc::PRIO_PROCESS, tid)
            }
        };
        let mine = tid_nice();
        let w = Worker::spawn("kvroute-test-niced", COMPILE_NICE).unwrap();
        let theirs = w.run(tid_nice).unwrap();
        assert_eq!(theirs, (mine + COMPILE_NICE).min(19));
        assert_eq!(tid_nice(), mine, "the caller's priority is unchanged");
    }
}
