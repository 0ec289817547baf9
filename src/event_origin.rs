// TEMPORARY stub until branch event-origin merges.
#[derive(Clone, Copy)]
pub enum Origin { Application, Captured, Resync }
pub fn with<T>(_origin: Origin, f: impl FnOnce() -> T) -> T { f() }
