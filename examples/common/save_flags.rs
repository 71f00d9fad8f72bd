//! The flags of the training examples' saves and progress: `--resume`,
//! `--save-every`, `--log-every`.

/// How a training example saves, resumes and reports.
#[derive(clap::Args, Debug)]
pub struct SaveFlags {
    /// Continue from the last complete save in --out.
    #[arg(long)]
    pub resume: bool,
    /// Save every N steps (and at the end).
    #[arg(long, default_value_t = 100)]
    pub save_every: usize,
    /// When stderr is not a terminal, a progress line (step, loss, tokens/s,
    /// ETA) every N steps; 0: about 20 lines a run.
    #[arg(long, default_value_t = 0)]
    pub log_every: usize,
}
