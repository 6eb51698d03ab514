//! A spinning thread team for the decode path's parallel loops.
//!
//! A batch-1 decode step runs a few hundred short parallel loops (one per projection or expert phase,
//! each streaming 0.06-4 MB of weights, tens to hundreds of µs). Issued to rayon from the engine's thread,
//! each loop is a cross-thread handoff: the job is injected, a sleeping worker is woken through a futex
//! and the caller sleeps until it is done, several µs each way (measured: 7 % of decode samples in futex
//! wake/sleep). The team keeps `threads - 1` helpers spinning on an epoch counter between loops, as
//! OpenMP's active wait does (llama.cpp decode on this machine: 45.7 tok/s active, 24.1 passive), and the
//! caller works on the loop itself: a loop starts within ~100 ns and ends when its last task does.
//! Helpers park on a condvar after [`SPIN`] without work, so an idle engine burns no CPU, and every wait
//! yields the core now and then, so a descheduled teammate (another process on the cores) is not waited
//! out by a spinning one (what made llama.cpp's active wait collapse beside a training run).
//!
//! [`for_each_mut`] is the one entry point. Called from a rayon worker (prefill's parallel loops, which
//! may nest a GEMV) it runs on rayon; called from inside a team task it runs serially; otherwise on the
//! team. Only one loop runs on the team at a time (a second caller waits for the first).

use std::any::Any;
use std::cell::Cell;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a helper spins without work before it parks (a decode step's serial gaps are µs; requests
/// come seconds apart).
const SPIN: Duration = Duration::from_millis(2);

/// `f(i, &mut items[i])` for every item, in parallel (each item is visited exactly once, by one thread).
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    if items.len() <= 1 || IN_TASK.get() {
        return items.iter_mut().enumerate().for_each(|(i, x)| f(i, x));
    }
    if rayon::current_thread_index().is_some() {
        return items.par_iter_mut().enumerate().for_each(|(i, x)| f(i, x));
    }
    match team() {
        Some(team) => team.run(items, &f),
        None => items.iter_mut().enumerate().for_each(|(i, x)| f(i, x)),
    }
}

/// The number of threads [`for_each_mut`] spreads a loop over from the engine's thread.
pub fn threads() -> usize {
    team().map_or(1, |t| t.helpers + 1)
}

thread_local! {
    /// Set while this thread runs a team task (a nested loop then runs serially on it).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// The team sized like rayon's global pool (`--threads`), made on first use; `None` with one thread.
fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<Team>> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = rayon::current_num_threads();
        (threads > 1).then(|| Team::new(threads - 1))
    })
    .as_ref()
}

/// One loop being run: the caller's closure over the caller's items, both on the caller's stack.
struct Job {
    /// `call(i)` runs the loop body on item `i`.
    call: *const (dyn Fn(usize) + Sync),
    len: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    /// The first panic of a task, re-raised on the caller's thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

struct Shared {
    /// Bumped for every loop; helpers spin on it.
    epoch: AtomicU64,
    /// The running loop, or null once its caller retracted it.
    job: AtomicPtr<Job>,
    /// Helpers between taking `job` and leaving it: the caller waits for 0 before its stack frame ends.
    inside: AtomicUsize,
    parked: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

struct Team {
    shared: Arc<Shared>,
    helpers: usize,
    /// One loop at a time.
    caller: Mutex<()>,
}

impl Team {
    fn new(helpers: usize) -> Team {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: AtomicPtr::new(ptr::null_mut()),
            inside: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        for h in 0..helpers {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("nextn-team-{}", h + 1))
                .spawn(move || helper(&shared))
                .expect("spawn a decode team thread");
        }
        Team { shared, helpers, caller: Mutex::new(()) }
    }

    fn run<T: Send>(&self, items: &mut [T], f: &(impl Fn(usize, &mut T) + Sync)) {
        let _one_loop = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let base = SendPtr(items.as_mut_ptr());
        let body = move |i: usize| {
            // SAFETY: `i < items.len()` (claimed from `next` below) and each index is claimed by exactly
            // one thread, so this is the only reference to `items[i]`; `items` outlives the loop because
            // `run` returns only after every task is done and no helper is inside the job.
            let item = unsafe { &mut *base.get().add(i) };
            f(i, item)
        };
        let body: &(dyn Fn(usize) + Sync) = &body;
        let job = Job {
            // SAFETY (lifetime erasure): the pointer is only dereferenced by helpers that are counted in
            // `inside` while `job` still points here; `run` retracts `job` and waits for `inside == 0`
            // before `body` goes out of scope.
            call: unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), *const (dyn Fn(usize) + Sync)>(body) },
            len: items.len(),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let s = &*self.shared;
        s.job.store(&job as *const Job as *mut Job, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.parked.load(SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        work_on(&job);
        let mut spins = 0u32;
        while job.done.load(SeqCst) < job.len {
            relax(&mut spins);
        }
        s.job.store(ptr::null_mut(), SeqCst);
        while s.inside.load(SeqCst) != 0 {
            relax(&mut spins);
        }
        if let Some(p) = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(p);
        }
    }
}

/// Claim and run tasks of `job` until none are left.
fn work_on(job: &Job) {
    IN_TASK.set(true);
    loop {
        let i = job.next.fetch_add(1, SeqCst);
        if i >= job.len {
            break;
        }
        // SAFETY: `call` points at the caller's closure, alive while the job is published (see `run`).
        let call = unsafe { &*job.call };
        // A task's panic is kept for the caller (which re-raises it once the loop is over), not lost
        // with a helper thread.
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| call(i))) {
            job.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
        }
        job.done.fetch_add(1, SeqCst);
    }
    IN_TASK.set(false);
}

fn helper(s: &Shared) {
    let mut seen = s.epoch.load(SeqCst);
    loop {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(SeqCst) == seen {
            relax(&mut spins);
            if spins.is_multiple_of(YIELD_EVERY) && idle_since.elapsed() > SPIN {
                let mut g = s.park.lock().unwrap_or_else(|e| e.into_inner());
                s.parked.fetch_add(1, SeqCst);
                while s.epoch.load(SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.parked.fetch_sub(1, SeqCst);
            }
        }
        seen = s.epoch.load(SeqCst);
        // Enter, then check the job is still published: the caller retracts it before waiting for
        // `inside == 0`, so a job seen after entering stays alive until this helper leaves.
        s.inside.fetch_add(1, SeqCst);
        let job = s.job.load(SeqCst);
        if !job.is_null() {
            // SAFETY: see above.
            work_on(unsafe { &*job });
        }
        s.inside.fetch_sub(1, SeqCst);
    }
}

/// Spin iterations between `sched_yield`s while waiting (~tens of µs of `pause`).
const YIELD_EVERY: u32 = 1024;

/// One iteration of a wait loop: a spin hint, and every [`YIELD_EVERY`] a yield, so a thread the waiter
/// depends on that was descheduled (another process on the cores) gets to run instead of the waiter
/// spinning out its time slice; with nothing else runnable the yield returns at once.
fn relax(spins: &mut u32) {
    std::hint::spin_loop();
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(YIELD_EVERY) {
        std::thread::yield_now();
    }
}

/// The items' base pointer, shared by the threads of one loop (each dereferences distinct indices).
struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: only used inside `Team::run`, where each thread touches a distinct item of a `T: Send` slice.
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item is visited exactly once, loops run back to back and after the helpers parked, and a
    /// loop nested inside a task runs (serially) without deadlock.
    #[test]
    fn every_item_once_back_to_back_after_parking_and_nested() {
        let run = || {
            for round in 0..2000usize {
                let mut xs = vec![0usize; 1 + round % 37];
                for_each_mut(&mut xs, |i, x| *x += i + round);
                assert!(xs.iter().enumerate().all(|(i, &x)| x == i + round), "round {round}");
            }
            std::thread::sleep(SPIN * 3);
            let mut outer = vec![vec![0u32; 8]; 5];
            for_each_mut(&mut outer, |i, row| for_each_mut(row, |j, x| *x = (i * 10 + j) as u32));
            for (i, row) in outer.iter().enumerate() {
                assert!(row.iter().enumerate().all(|(j, &x)| x == (i * 10 + j) as u32));
            }
        };
        // From a thread outside rayon's pool (the team), and from inside it (rayon).
        std::thread::spawn(run).join().unwrap();
        rayon::scope(|_| run());
    }

    /// A task's panic reaches the caller, and the team still works afterwards.
    #[test]
    fn a_task_panic_reaches_the_caller() {
        std::thread::spawn(|| {
            let mut xs = vec![0u8; 64];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for_each_mut(&mut xs, |i, _| assert!(i != 40, "task 40 fails"));
            }));
            assert!(r.is_err());
            for_each_mut(&mut xs, |i, x| *x = i as u8);
            assert!(xs.iter().enumerate().all(|(i, &x)| x == i as u8));
        })
        .join()
        .unwrap();
    }

    /// Two threads issuing loops at once take turns.
    #[test]
    fn concurrent_callers_take_turns() {
        let handles: Vec<_> = (0..3)
            .map(|c| {
                std::thread::spawn(move || {
                    for r in 0..500usize {
                        let mut xs = vec![0usize; 16];
                        for_each_mut(&mut xs, |i, x| *x = i * c + r);
                        assert!(xs.iter().enumerate().all(|(i, &x)| x == i * c + r));
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
    }
}
