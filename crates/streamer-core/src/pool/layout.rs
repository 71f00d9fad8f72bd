//! Where each of a block's weights sits in a slot.
use crate::host::HostMasters;
use candle_core::{DType, Result, Shape};

/// Offsets inside a slot are aligned to this many bytes (vector loads, tensor cores).
const ALIGN_BYTES: usize = 256;

/// One weight of a block, as laid out in a slot.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Name relative to the block's prefix (what the block's `VarBuilder` asks for).
    pub local: String,
    /// Index of the host master.
    pub master: usize,
    /// Offset in the slot, in elements of the compute dtype.
    pub offset: usize,
    /// Shape of the weight.
    pub shape: Shape,
}

/// Where each of a block's weights sits in a slot. Tied weights within a block
/// share one entry offset and are copied once.
#[derive(Debug, Clone, Default)]
pub struct BlockLayout {
    /// Every name the block uses.
    pub entries: Vec<Entry>,
    /// Distinct masters and their slot offsets: what one load copies.
    pub unique: Vec<(usize, usize)>,
    /// Elements of the slot this block occupies (compute dtype, with alignment).
    pub elems: usize,
}

impl BlockLayout {
    /// Adds `local`, of master `master` (of `shape`, taking `elems` elements
    /// of the slot), placing the master on its first use.
    pub(crate) fn push(
        &mut self,
        local: String,
        (master, elems): (usize, usize),
        shape: Shape,
        dtype: DType,
    ) {
        let offset = match self.unique.iter().find(|(m, _)| *m == master) {
            Some(&(_, off)) => off,
            None => {
                let align = (ALIGN_BYTES / dtype.size_in_bytes()).max(1);
                let off = self.elems.div_ceil(align) * align;
                self.unique.push((master, off));
                self.elems = off + elems;
                off
            }
        };
        self.entries.push(Entry {
            local,
            master,
            offset,
            shape,
        });
    }

    /// Fails unless every weight lies inside the block's `elems`, at an
    /// aligned offset, and has its master's element count: the CUDA engine
    /// copies and aliases by raw address, so a layout built by hand (its
    /// fields are public) must not place a weight outside its slot.
    pub(crate) fn check(&self, masters: &HostMasters, dtype: DType, name: &str) -> Result<()> {
        let align = (ALIGN_BYTES / dtype.size_in_bytes()).max(1);
        let bad = |what: String| candle_core::bail!("block {name:?}'s layout {what}");
        for &(m, off) in &self.unique {
            if m >= masters.len() {
                return bad(format!("names master {m} of {}", masters.len()));
            }
            let n = masters.get(m).slot_elems(dtype);
            if off % align != 0 || off + n > self.elems {
                return bad(format!(
                    "places master {m} ({n} elements) at {off}, unaligned or past its {} elements",
                    self.elems
                ));
            }
        }
        for e in &self.entries {
            let fits = (self.unique.iter()).any(|&(m, off)| m == e.master && off == e.offset);
            if !fits || e.shape.elem_count() != masters.get(e.master).shape().elem_count() {
                return bad(format!(
                    "entry {:?} disagrees with its master {}",
                    e.local, e.master
                ));
            }
        }
        Ok(())
    }

    /// Bytes of device memory the block's weights occupy.
    pub fn bytes(&self, dtype: DType) -> usize {
        self.elems * dtype.size_in_bytes()
    }
}
