//! A port's partition key table: `ibv_query_pkey` and `ibv_get_pkey_index`.
//!
//! P_Keys are given and returned in host byte order (the verbs take and give network order).
//! Queue pairs name a P_Key by its index in this table
//! ([`ConnectOptions::pkey_index`](crate::ConnectOptions::pkey_index)). RoCE ports (rxe) have a
//! table of one entry, the default full-membership key `0xffff`; iWARP ports (siw) an empty one.

use ibverbs_sys as ffi;

use crate::device::Context;
use crate::error::{cvt, Error, Result};

impl Context {
    /// Reads entry `index` of `port`'s P_Key table (`ibv_query_pkey()`), in host byte order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for port 0 or an index at or above the port's
    /// [`pkey_tbl_len`](crate::PortAttr::pkey_tbl_len), before the verb; as
    /// [`query_port`](Self::query_port) for a port the device does not have; [`Error::Verb`] if
    /// the table cannot be read.
    #[doc(alias = "ibv_query_pkey")]
    pub fn query_pkey(&self, port: u8, index: u16) -> Result<u16> {
        const VERB: &str = "ibv_query_pkey";
        let len = self.pkey_table_len(port, VERB)?;
        if index >= len {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "index is not below the port's pkey_tbl_len",
            });
        }
        self.query_pkey_unchecked(port, index)
    }

    /// `ibv_query_pkey` of an index known to be in the table.
    fn query_pkey_unchecked(&self, port: u8, index: u16) -> Result<u16> {
        let mut pkey: ffi::__be16 = 0;
        crate::error::clear_errno();
        // SAFETY: valid context and out-pointer; the verb reads the table from sysfs.
        let ret = unsafe { ffi::ibv_query_pkey(self.as_raw(), port, i32::from(index), &mut pkey) };
        cvt("ibv_query_pkey", ret)?;
        Ok(u16::from_be(pkey))
    }

    /// Every entry of `port`'s P_Key table, in index order (`ibv_query_pkey()` for each index
    /// below the port's [`pkey_tbl_len`](crate::PortAttr::pkey_tbl_len)), in host byte order.
    ///
    /// # Errors
    /// As [`query_pkey`](Self::query_pkey).
    #[doc(alias = "ibv_query_pkey")]
    pub fn pkey_table(&self, port: u8) -> Result<Vec<u16>> {
        let len = self.pkey_table_len(port, "ibv_query_pkey")?;
        (0..len).map(|i| self.query_pkey_unchecked(port, i)).collect()
    }

    /// The index of `pkey` (host byte order) in `port`'s P_Key table (`ibv_get_pkey_index()`),
    /// the number [`ConnectOptions::pkey_index`](crate::ConnectOptions::pkey_index) takes;
    /// `None` when the table does not hold it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for port 0; as [`query_port`](Self::query_port) for a port the
    /// device does not have; [`Error::Verb`] of `ibv_get_pkey_index` if the table cannot be read
    /// (any failure but the walk running past the table's end).
    #[doc(alias = "ibv_get_pkey_index")]
    pub fn pkey_index(&self, port: u8, pkey: u16) -> Result<Option<u16>> {
        const VERB: &str = "ibv_get_pkey_index";
        self.pkey_table_len(port, VERB)?;
        crate::error::clear_errno();
        // SAFETY: valid context; the port exists (queried above). The verb reads the table entry
        // by entry until it finds the key or an entry cannot be read.
        let ret = unsafe { ffi::ibv_get_pkey_index(self.as_raw(), port, pkey.to_be()) };
        if let Ok(i) = u16::try_from(ret) {
            return Ok(Some(i));
        }
        let err = if ret == -1 { Error::last_os(VERB) } else { Error::from_ret(VERB, ret) };
        match err.raw_os_error() {
            // The walk read past the table's last entry: the key is not there. Checked against
            // the table itself, so that a failure on an entry inside it is not taken for that.
            Some(libc::ENOENT | libc::EINVAL) | None => {
                if self.pkey_table(port)?.contains(&pkey) {
                    Err(err)
                } else {
                    Ok(None)
                }
            }
            _ => Err(err),
        }
    }

    /// The port's `pkey_tbl_len`, for `verb`; port 0 refused by name.
    fn pkey_table_len(&self, port: u8, verb: &'static str) -> Result<u16> {
        if port == 0 {
            return Err(Error::InvalidArgument { verb, reason: "ports are numbered from 1" });
        }
        Ok(self.query_port(port)?.pkey_tbl_len())
    }
}
