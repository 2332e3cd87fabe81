//! The cores of one machine shared by the simulated devices on it (the simulator's
//! `Participant::sharing_cores`), so that no more of them train at once than it has cores.

#[cfg(feature = "tools")]
use std::sync::{Arc, Mutex};

/// The cores of one machine, shared by the simulated devices on it: a device trains only
/// while it holds a slot, and a slot is one core (a single-threaded rayon pool that flex's
/// kernels run in), so at most one thread per core trains and none waits on another's pool.
#[cfg(feature = "tools")]
pub(crate) struct TrainingSlots {
    free: Mutex<Vec<Arc<rayon::ThreadPool>>>,
    /// One permit per pool in `free`.
    available: Arc<tokio::sync::Semaphore>,
}

#[cfg(feature = "tools")]
impl TrainingSlots {
    /// One slot per core of this machine.
    pub(crate) fn one_per_core() -> std::io::Result<Arc<Self>> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pools = (0..cores)
            .map(|i| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .thread_name(move |_| format!("training-slot-{i}"))
                    .build()
                    .map(Arc::new)
                    .map_err(std::io::Error::other)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(TrainingSlots {
            free: Mutex::new(pools),
            available: Arc::new(tokio::sync::Semaphore::new(cores)),
        }))
    }

    /// Waits for a free slot.
    pub(super) async fn take(self: &Arc<Self>) -> TrainingSlot {
        let permit = self.available.clone().acquire_owned().await.expect("never closed");
        let pool = self.free.lock().expect("no panic holding it").pop().expect("one per permit");
        TrainingSlot { slots: self.clone(), pool, _permit: permit }
    }
}

/// A slot held: its pool goes back when it is dropped, and then (the permit dropping after
/// `drop` ran) the next device may take it.
#[cfg(feature = "tools")]
pub(super) struct TrainingSlot {
    slots: Arc<TrainingSlots>,
    pub(super) pool: Arc<rayon::ThreadPool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

#[cfg(feature = "tools")]
impl Drop for TrainingSlot {
    fn drop(&mut self) {
        self.slots.free.lock().expect("no panic holding it").push(self.pool.clone());
    }
}

/// Without the simulator, no device shares its cores.
#[cfg(not(feature = "tools"))]
pub(crate) enum TrainingSlots {}
