//! Verified reuse of a block's device-stepped weights by the next forward.
//!
//! When an optimizer has stepped every master of a block on the device and the
//! pool has written them back ([`crate::ResidencyPool::write_back_masters`]),
//! the slot holds what the host masters hold once that copy lands. The next
//! training forward starts with that block, and copying it again is the one
//! copy nothing can hide (its compute waits for it). So the runner lends the
//! slot as it is and, behind the call's other copies, copies the host masters
//! again into a scratch buffer and compares them byte for byte with the slot.
//! [`crate::run_blocks_with`] asks for the verdict before it returns anything,
//! and a mismatch (a master changed on the host after the step: `Var::set`, a
//! checkpoint loaded into the parameters) makes it run the call again from
//! fresh copies. A reuse is therefore never observable, whatever the caller
//! did to the masters in between.
//!
//! Where the comparison runs: the host copy goes into the scratch on the
//! transfer stream behind the call's second block's copy, and the compare
//! kernel runs on a stream of its own with the device's highest priority, so
//! that it takes SMs at the next kernel boundary instead of queueing behind
//! the compute stream's GEMMs; the lent slot's next load waits for it. On the
//! transfer stream itself (as before), the load of the call's third block
//! into the lent slot waited for that kernel, which ran only when the second
//! block's GEMMs let it (a 4.7 ms stall with bf16 masters, 14.7 with f32).
//! On the compute stream right after the lent block, it would make the second
//! block wait for the scratch copy, which with f32 masters lands after the
//! lent block's compute (two blocks' copies against one block's compute).
use crate::cuda::stage_len;
use candle_core::Result;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use std::sync::Arc;

/// One reused block's device copies: `(master, device address, bytes)`.
pub(crate) type Copies = Vec<(usize, u64, usize)>;

/// The scratch buffer, the verdict flag and the comparisons in flight.
pub(crate) struct Verifier {
    /// Bytes of the largest block's masters (256-byte aligned pieces).
    scratch_bytes: usize,
    /// Allocated at the first comparison: a model never stepped on the device
    /// pays nothing.
    scratch: Option<(CudaSlice<u8>, u64)>,
    /// Set to 1 by any comparison that found a difference since the last verdict.
    flag: CudaSlice<u32>,
    flag_ptr: u64,
    /// Runs the comparisons (highest priority) and reads the flag, without
    /// waiting for the transfer stream's later copies.
    check: Arc<CudaStream>,
    /// Reused blocks whose comparison is not issued yet: `(slot, copies)`.
    pub(crate) pending: Vec<(usize, Copies)>,
    /// Marks the end of the last comparison issued since the last verdict.
    issued: Option<Arc<CudaEvent>>,
    /// Slots whose comparison (ending at the event) may still read them: their
    /// next load waits for it ([`Self::before_refill`]).
    guards: Vec<(usize, Arc<CudaEvent>)>,
}

impl Verifier {
    /// The flag and scratch live on the transfer stream, which copies into
    /// the scratch; the comparisons run on a stream of their own.
    pub(crate) fn new(transfer: &Arc<CudaStream>, scratch_bytes: usize) -> Result<Self> {
        let w = candle_core::Error::wrap;
        let flag = transfer.alloc_zeros::<u32>(1).map_err(w)?;
        let flag_ptr = address(&flag, transfer);
        // Lower numbers are higher priorities: the range's second value.
        let (_, highest) = cudarc::driver::result::stream::get_priority_range().map_err(w)?;
        let check = transfer
            .context()
            .new_stream_with_priority(highest)
            .map_err(w)?;
        // The flag is a stream-ordered allocation on the transfer stream.
        check.join(transfer).map_err(w)?;
        Ok(Self {
            scratch_bytes: scratch_bytes.max(1),
            scratch: None,
            flag,
            flag_ptr,
            check,
            pending: Vec::new(),
            issued: None,
            guards: Vec::new(),
        })
    }

    /// Issues the comparisons pending for `only` (every slot when `None`): the
    /// host masters copied into the scratch buffer on `transfer`, compared with
    /// the slot's copies on the check stream. Returns the bytes copied.
    pub(crate) fn issue(
        &mut self,
        dev: &candle_core::CudaDevice,
        transfer: &Arc<CudaStream>,
        masters: &crate::HostMasters,
        only: Option<usize>,
    ) -> Result<u64> {
        if self.pending.is_empty() {
            return Ok(0); // every load asks; almost none has a check to issue
        }
        let w = candle_core::Error::wrap;
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(s, _)| only.is_none_or(|o| o == *s));
        self.pending = later;
        if now.is_empty() {
            return Ok(0);
        }
        if self.scratch.is_none() {
            let buf = transfer.alloc_zeros::<u8>(self.scratch_bytes).map_err(w)?;
            let p = address(&buf, transfer);
            self.scratch = Some((buf, p));
        }
        let scratch = self.scratch.as_ref().expect("allocated above").1;
        if self.issued.is_none() {
            transfer.memset_zeros(&mut self.flag).map_err(w)?;
        }
        let mut bytes = 0u64;
        for (slot, copies) in &now {
            // The scratch is refilled only after the comparison that read it.
            if let Some(last) = &self.issued {
                transfer.wait(last).map_err(w)?;
            }
            let mut at = scratch;
            for &(m, _, n) in copies {
                let (src, len) = crate::host::host_bytes(masters.get(m).var.as_tensor())?;
                debug_assert_eq!(len, n);
                // SAFETY: the scratch holds the largest block's masters in
                // 256-byte aligned pieces (sized like the staging buffers); the
                // master is a live host tensor of `len` bytes. The comparison
                // that reads the scratch waits for this copy, and the next
                // refill waits for that comparison (above).
                unsafe { crate::cuda::htod_async(at, src, len, transfer)? };
                at += stage_len(n) as u64;
                bytes += n as u64;
            }
            // The flag's reset and the copies come first.
            self.check.wait(&event(transfer)?).map_err(w)?;
            let mut at = scratch;
            for &(_, addr, n) in copies {
                // SAFETY: `addr` is the slot's copy of this master (n bytes,
                // 256-byte aligned), which no copy overwrites before the check
                // stream passes the kernel: the slot's next load waits for the
                // event recorded below (`before_refill`), and the pool's
                // `synchronize` (before the slot is freed) waits for it too.
                unsafe {
                    crate::cuda::bytes_differ(dev, &self.check, (at, addr, n), self.flag_ptr)?
                };
                at += stage_len(n) as u64;
            }
            let done = Arc::new(event(&self.check)?);
            self.guards.push((*slot, done.clone()));
            self.issued = Some(done);
        }
        Ok(bytes)
    }

    /// Orders `transfer`'s next work (a load refilling `slot`) after the
    /// comparison that reads the slot's lent copy, if one was issued.
    pub(crate) fn before_refill(&mut self, slot: usize, transfer: &CudaStream) -> Result<()> {
        let w = candle_core::Error::wrap;
        for (_, done) in self.guards.iter().filter(|(s, _)| *s == slot) {
            transfer.wait(done).map_err(w)?;
        }
        self.guards.retain(|(s, _)| *s != slot);
        Ok(())
    }

    /// Waits for every comparison issued (before slots or the scratch are
    /// freed, or refilled by a caller that synchronised).
    pub(crate) fn synchronize(&mut self) -> Result<()> {
        self.check.synchronize().map_err(candle_core::Error::wrap)?;
        self.guards.clear();
        Ok(())
    }

    /// Whether any comparison issued since the last verdict found a difference
    /// (waits for them; nothing issued: `false` at once).
    pub(crate) fn verdict(&mut self) -> Result<bool> {
        let w = candle_core::Error::wrap;
        if self.issued.take().is_none() {
            return Ok(false);
        }
        // The comparisons ran on this stream, before this read.
        let v = self.check.clone_dtoh(&self.flag).map_err(w)?;
        self.check.synchronize().map_err(w)?;
        self.guards.clear();
        Ok(v[0] != 0)
    }
}

fn event(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        ))
        .map_err(candle_core::Error::wrap)
}

fn address<T: cudarc::driver::DeviceRepr>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _g) = s.device_ptr(stream);
    p
}
