//! Whose rights a piece of work runs with. A layer's table belongs to its user: everything that
//! reads or writes it runs as the role that called edit_feature or record_edit (its privileges,
//! triggers, defaults, casts), or, in the relay, as the table's owner in a restricted context, as
//! PostgreSQL itself does for VACUUM and ANALYZE. Only the outbox and per-feature state are written
//! as the extension's owner.

use std::cell::RefCell;

use pgrx::pg_sys;

/// A user id and security context, as GetUserIdAndSecContext gives them.
#[derive(Clone, Copy)]
pub struct Identity {
    pub user: pg_sys::Oid,
    pub context: i32,
}

pub fn current() -> Identity {
    let (mut user, mut context) = (pg_sys::Oid::INVALID, 0);
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    Identity { user, context }
}

/// Runs as another user until dropped, also when an ERROR unwinds through it (a transaction or
/// subtransaction abort would restore the user too).
pub struct As {
    saved: Identity,
}

impl As {
    /// `extra`: security-context flags to add, e.g. SECURITY_RESTRICTED_OPERATION.
    /// SECURITY_LOCAL_USERID_CHANGE is always added: SET ROLE inside is refused, as in a SECURITY
    /// DEFINER function.
    pub fn enter(user: pg_sys::Oid, context: i32, extra: u32) -> Self {
        let saved = current();
        let flags = context | (pg_sys::SECURITY_LOCAL_USERID_CHANGE | extra) as i32;
        unsafe { pg_sys::SetUserIdAndSecContext(user, flags) };
        As { saved }
    }
}

impl Drop for As {
    fn drop(&mut self) {
        unsafe { pg_sys::SetUserIdAndSecContext(self.saved.user, self.saved.context) };
    }
}

thread_local! {
    /// The callers of the edit functions now running, innermost last.
    static CALLERS: RefCell<Vec<Identity>> = const { RefCell::new(Vec::new()) };
}

/// Records `who` as the caller of the edit now starting until dropped.
pub struct Calling;

impl Calling {
    pub fn push(who: Identity) -> Self {
        CALLERS.with(|c| c.borrow_mut().push(who));
        Calling
    }
}

impl Drop for Calling {
    fn drop(&mut self) {
        CALLERS.with(|c| c.borrow_mut().pop());
    }
}

/// The caller of the innermost running edit; None outside one.
pub fn caller() -> Option<Identity> {
    CALLERS.with(|c| c.borrow().last().copied())
}
