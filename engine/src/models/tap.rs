//! Taps: intermediate activations of a forward, for finding where two backends part ways. While
//! [`start`]ed, the forward downloads each tapped buffer (the residual stream after every block, a block's
//! inputs and outputs) into one process-wide list, in forward order; [`stop`] returns it. Off by default:
//! then a tap is one relaxed atomic load, and no backend downloads anything.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::ops::Ops;

static ON: AtomicBool = AtomicBool::new(false);
static TAPS: Mutex<Vec<(String, Vec<f32>)>> = Mutex::new(Vec::new());

/// Starts recording (clearing what an earlier recording left).
pub fn start() {
    TAPS.lock().unwrap_or_else(|p| p.into_inner()).clear();
    ON.store(true, Ordering::SeqCst);
}

/// Stops recording; the taps `(name, values)` in the order the forward reached them.
pub fn stop() -> Vec<(String, Vec<f32>)> {
    ON.store(false, Ordering::SeqCst);
    std::mem::take(&mut *TAPS.lock().unwrap_or_else(|p| p.into_inner()))
}

/// `x` (all its rows) under `name`, while recording.
pub fn put<O: Ops>(o: &mut O, name: impl FnOnce() -> String, x: &O::Buf) {
    if ON.load(Ordering::Relaxed) {
        let values = o.download(x);
        TAPS.lock().unwrap_or_else(|p| p.into_inner()).push((name(), values));
    }
}
