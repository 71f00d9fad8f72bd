//! The project's integration tests, one module per topic. Every test body takes a
//! `&Device` and is turned into a CPU test and (with `--features cuda`) a CUDA test
//! by `candle_streamer::test_device!`.

mod attention;
mod bad_inputs;
mod batch_generate;
mod bf16_state;
mod bnb_fixtures;
mod calibrate;
mod chat_template;
mod common;
mod crash;
mod cross_entropy;
mod cuda_chain;
mod decoder_backward;
mod device_budget;
mod dist;
mod doc_paths;
mod families;
mod faults;
mod fused_linear;
mod fused_mlp;
mod fused_ops;
mod fuzz;
mod host_plan;
mod lora;
mod lora_budget;
mod loss_curve;
mod micro_batch;
mod mlp_budget;
mod models;
mod optim;
mod pool;
mod pretrained;
mod quant;
mod quant_checkpoint;
mod quant_stream;
mod report;
mod side_effects;
mod soak;
mod training;
