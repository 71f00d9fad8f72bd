//! The decoder's tests on the CPU, crate-locally: the very test bodies of the
//! workspace's `tests/models.rs` (which the integration binary runs on CPU and,
//! with `--features cuda`, on CUDA), turned into plain `#[test]`s by a local
//! `test_device!`.

/// Stands in for `candle_streamer::test_device!` (the root package is not a
/// dependency of this crate): a CPU test `name::cpu`.
mod candle_streamer {
    macro_rules! test_device {
        ($name:ident) => {
            mod $name {
                #[test]
                fn cpu() -> anyhow::Result<()> {
                    super::$name(&candle_core::Device::Cpu)
                }
            }
        };
    }
    pub(crate) use test_device;
}

include!("../../tests/models.rs");
