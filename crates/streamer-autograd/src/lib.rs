//! placeholder

mod adamw;
mod optim_state;
mod sgd;

pub use adamw::CpuAdamW;
pub use sgd::{CpuSgd, ParamsSgd};
