//! Batched decoding (`generate_batch`): many sequences per weight visit give
//! exactly what each sequence gives alone through `generate` (greedy and
//! sampled), resident and streamed, with prompts of different lengths and
//! more prompts than slots (finished sequences make room for queued ones);
//! requests that cannot run fail alone; and the prompts file's parsing and
//! resume (`prompt_file`).
use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::collections::BTreeMap;
use streamer_core::StreamConfig;
use streamer_models::prompt_file::{
    completed_lines, find_stop, output_line, parse_prompt_line, LineOutcome, OutputFile,
};
use streamer_models::{
    generate, generate_batch, init_weights, BatchLimits, BatchOutput, BatchRequest, BatchRun,
    BatchSink, ChatMessage, DecodeRates, Finish, Generated, Llama, LlamaConfig, Placement,
    SplitMix64,
};

fn stream(dev: &Device) -> StreamConfig {
    crate::common::stream(dev, DType::F32, 1)
}

/// The tiny preset, resident, streamed and split (its first layer resident,
/// the rest streamed), from the same seeded weights, and streamed over an
/// NF4 base quantized from them (the quantized bases decode through the
/// same batched path).
fn tiny_models(dev: &Device) -> Result<Vec<(&'static str, Llama)>> {
    let cfg = LlamaConfig::preset("tiny")?;
    let w = init_weights(&cfg, 11)?;
    let nf4 = streamer_quant::QuantScheme::parse("nf4")?;
    let src = streamer_core::WeightSource::Tensors(w.clone());
    Ok(vec![
        (
            "resident",
            Llama::resident(VarBuilder::from_tensors(w.clone(), DType::F32, dev), &cfg)?,
        ),
        (
            "streamed nf4",
            Llama::streamed_quantize_on_load(&src, nf4, &cfg, stream(dev))?,
        ),
        (
            "split",
            Llama::streamed_keeping(&src, &cfg, stream(dev), 1)?,
        ),
        ("streamed", Llama::from_tensors(w, &cfg, stream(dev))?),
    ])
}

/// Prompts of lengths `lens` of random bytes, with `max_tokens` cycling
/// through `news`.
fn requests(lens: &[usize], news: &[usize], temperature: f64, vocab: usize) -> Vec<BatchRequest> {
    let mut rng = SplitMix64::new(5);
    lens.iter()
        .enumerate()
        .map(|(i, &n)| BatchRequest {
            id: i,
            prompt: (0..n).map(|_| rng.below(vocab) as u32).collect(),
            max_tokens: news[i % news.len()],
            temperature,
            top_p: 0.9,
            seed: 100 + i as u64,
        })
        .collect()
}

/// Every request's output by id.
fn run_batch(
    model: &Llama,
    reqs: &[BatchRequest],
    batch: usize,
) -> Result<BTreeMap<usize, BatchOutput>> {
    let mut outs = BTreeMap::new();
    generate_batch(model, reqs.to_vec(), batch, &[], &mut |o: BatchOutput| {
        outs.insert(o.id, o);
        Ok(())
    })?;
    Ok(outs)
}

/// Each request alone through `generate`, compared with the batch's output.
fn check_against_alone(
    model: &Llama,
    reqs: &[BatchRequest],
    outs: &BTreeMap<usize, BatchOutput>,
    what: &str,
) -> Result<()> {
    for r in reqs {
        let alone = generate(
            model,
            &r.prompt,
            r.max_tokens,
            r.temperature,
            r.top_p,
            r.seed,
            |_| (),
        )?;
        let out = outs
            .get(&r.id)
            .ok_or_else(|| anyhow::anyhow!("{what}: no output for {}", r.id))?;
        let got = out
            .result
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        ensure!(
            got.tokens == alone,
            "{what}: request {} (prompt of {}): batched {:?}, alone {alone:?}",
            r.id,
            r.prompt.len(),
            got.tokens
        );
        ensure!(got.finish == Finish::Length && alone.len() == r.max_tokens);
    }
    Ok(())
}

fn batched_greedy_equals_one_by_one_tiny(dev: &Device) -> Result<()> {
    let lens = [5, 1, 17, 9, 3, 12, 2];
    let news = [12, 4, 9, 16, 6];
    for (name, model) in tiny_models(dev)? {
        let reqs = requests(&lens, &news, 0.0, 256);
        // 3 slots for 7 prompts: slots are refilled while others decode.
        for batch in [3, 7] {
            let outs = run_batch(&model, &reqs, batch)?;
            ensure!(
                outs.len() == reqs.len(),
                "{} outputs for {} requests",
                outs.len(),
                reqs.len()
            );
            check_against_alone(&model, &reqs, &outs, &format!("{name}, batch {batch}"))?;
        }
        ensure!(
            model.cached_positions()? == 0,
            "{name}: the cache is left empty"
        );
    }
    Ok(())
}
candle_streamer::test_device!(batched_greedy_equals_one_by_one_tiny);

/// Sequences whose kv cache lives in host memory (`BatchLimits::host_kv`)
/// decode exactly as alone: some slots on the host, every slot on the host;
/// more host sequences than sequences is refused. In the second workload the
/// first step reserves 16 positions a slot (twice its longest prompt, 5) and
/// the third sequence (3 + 30 tokens, in slot 2: a host slot in every
/// split below) outgrows them, so the cache grows, its host part laid out
/// anew, while that sequence is in flight.
fn batched_host_kv_equals_one_by_one(dev: &Device) -> Result<()> {
    let workloads: [(&[usize], &[usize]); 2] = [
        (&[5, 1, 17, 9, 3, 12, 2], &[12, 4, 9, 16, 6]),
        (&[5, 1, 3, 9, 40, 2], &[12, 4, 30]),
    ];
    for (name, model) in tiny_models(dev)? {
        for ((lens, news), (sequences, host_kv)) in workloads
            .iter()
            .flat_map(|w| [(3, 1), (4, 2), (3, 3)].map(|split| (*w, split)))
        {
            let reqs = requests(lens, news, 0.0, 256);
            let limits = BatchLimits {
                sequences,
                step_rows: 64,
                host_kv,
            };
            let mut log = StepLog::default();
            generate_batch(&model, reqs.clone(), limits, &[], &mut log)?;
            let what = format!("{name}, {sequences} sequences, {host_kv} on the host");
            ensure!(
                log.outs.len() == reqs.len(),
                "{what}: {} outputs",
                log.outs.len()
            );
            check_against_alone(&model, &reqs, &log.outs, &what)?;
        }
        let limits = BatchLimits {
            sequences: 2,
            step_rows: 64,
            host_kv: 3,
        };
        let reqs = requests(&[4, 2], &[3], 0.0, 256);
        let e = generate_batch(&model, reqs, limits, &[], &mut StepLog::default())
            .expect_err("more host sequences than sequences");
        ensure!(
            e.to_string()
                .contains("3 sequences with their kv cache in host memory"),
            "{e}"
        );
    }
    Ok(())
}
candle_streamer::test_device!(batched_host_kv_equals_one_by_one);

/// `HostBuffer`, where the host kv cache lives: tensors copied in at an
/// offset come back out equal (bf16 and f32), host reads see every copy
/// enqueued before them, host writes reach the next upload, a strided
/// region comes up packed, and copies outside the buffer or of the wrong
/// size are refused before anything moves.
fn host_buffer_round_trips(dev: &Device) -> Result<()> {
    use candle_core::{Shape, Tensor};
    use streamer_device::{HostBuffer, Region};
    // A tensor of `shape` from the bytes at `at`.
    let up = |buf: &HostBuffer, at: usize, shape: Shape, dtype: DType| {
        let n = shape.elem_count() * dtype.size_in_bytes();
        buf.upload_region(Region::flat(at, n), &shape, dtype, dev)
    };
    let mut buf = HostBuffer::zeroed(4096, dev)?;
    ensure!(buf.len() == 4096 && buf.bytes()?.iter().all(|&b| b == 0));
    let a = Tensor::arange(0f32, 96., dev)?.reshape((2, 3, 16))?;
    let b = (Tensor::arange(0f32, 64., dev)? * 0.5)?.to_dtype(DType::BF16)?;
    buf.download(128, &a)?;
    buf.download(1024, &b)?;
    let back = up(&buf, 128, (2, 3, 16).into(), DType::F32)?;
    ensure!((back - &a)?.abs()?.sum_all()?.to_scalar::<f32>()? == 0.0);
    let back = up(&buf, 1024, (64,).into(), DType::BF16)?;
    ensure!(
        back.to_dtype(DType::F32)?.to_vec1::<f32>()? == b.to_dtype(DType::F32)?.to_vec1::<f32>()?
    );
    // The host sees the copies: f32 1.0 at element 1 of `a`.
    ensure!(buf.bytes()?[132..136] == 1f32.to_ne_bytes());
    buf.bytes_mut()?[128..132].copy_from_slice(&7f32.to_ne_bytes());
    let first = up(&buf, 128, (1,).into(), DType::F32)?;
    ensure!(first.to_vec1::<f32>()? == [7.0]);
    // A strided region: the second f32 of each of `a`'s 6 rows of 16.
    let region = Region {
        at: 128 + 4,
        blocks: 2,
        block_stride: 3 * 64,
        rows: 3,
        pitch: 64,
        len: 4,
    };
    let col = buf.upload_region(region, &(6,).into(), DType::F32, dev)?;
    ensure!(col.to_vec1::<f32>()? == [1.0, 17.0, 33.0, 49.0, 65.0, 81.0]);
    let e = buf.download(4000, &a).expect_err("past the end");
    ensure!(e.to_string().contains("outside its 4096 bytes"), "{e}");
    let e = up(&buf, 4090, (2,).into(), DType::F32).expect_err("past the end");
    ensure!(
        e.to_string().contains("8 bytes") && e.to_string().contains("outside its 4096"),
        "{e}"
    );
    let e = buf
        .upload_region(Region::flat(0, 12), &(2,).into(), DType::F32, dev)
        .expect_err("12 bytes for 8");
    ensure!(
        e.to_string()
            .contains("a region of 12 bytes for a tensor of 8"),
        "{e}"
    );
    Ok(())
}
candle_streamer::test_device!(host_buffer_round_trips);

/// Records every step's sequences and rows, and the outputs.
#[derive(Default)]
struct StepLog {
    steps: Vec<(usize, usize)>,
    outs: BTreeMap<usize, BatchOutput>,
}

impl BatchSink for StepLog {
    fn done(&mut self, out: BatchOutput) -> candle_core::Result<()> {
        self.outs.insert(out.id, out);
        Ok(())
    }
    fn step(&mut self, tokens: usize, rows: usize) {
        self.steps.push((tokens, rows));
    }
}

/// `step_rows` bounds a step's rows (but for the first prompt admitted to a
/// step), spreads the prompts over more steps, and changes no output.
fn batched_step_rows_bound_steps(dev: &Device) -> Result<()> {
    let lens = [5, 1, 17, 9, 3, 12, 2, 6];
    let longest = 17;
    for (name, model) in tiny_models(dev)? {
        let reqs = requests(&lens, &[8, 3, 5], 0.0, 256);
        let mut free = StepLog::default();
        generate_batch(&model, reqs.clone(), 4, &[], &mut free)?;
        let limits = BatchLimits {
            sequences: 4,
            step_rows: 8,
            host_kv: 0,
        };
        let mut bound = StepLog::default();
        generate_batch(&model, reqs.clone(), limits, &[], &mut bound)?;
        for &(seqs, rows) in &bound.steps {
            // Over the bound only with one prompt beside one-row sequences.
            ensure!(
                rows <= 8 || rows <= seqs - 1 + longest,
                "{name}: a step of {seqs} sequences computed {rows} rows"
            );
        }
        ensure!(
            bound.steps.iter().map(|s| s.1).max() < free.steps.iter().map(|s| s.1).max(),
            "{name}: the bound lowered no step's rows: {:?} vs {:?}",
            bound.steps,
            free.steps
        );
        ensure!(bound.outs == free.outs, "{name}: outputs differ");
        check_against_alone(&model, &reqs, &bound.outs, name)?;
    }
    Ok(())
}
candle_streamer::test_device!(batched_step_rows_bound_steps);

fn batched_sampling_equals_one_by_one_tiny(dev: &Device) -> Result<()> {
    // Temperature 1.0: each token depends on every logit and on the
    // sequence's own sampler, not on its neighbours in the batch.
    for (name, model) in tiny_models(dev)? {
        let reqs = requests(&[4, 11, 2, 7], &[10, 5, 14], 1.0, 256);
        let outs = run_batch(&model, &reqs, 2)?;
        check_against_alone(&model, &reqs, &outs, &format!("{name}, sampled"))?;
    }
    Ok(())
}
candle_streamer::test_device!(batched_sampling_equals_one_by_one_tiny);

/// A streamed model looks its rows up in the embedding table on the host (on
/// CUDA through a page-locked buffer made at the first step and grown when a
/// step has more rows); the resident model looks them up on the device. Their
/// greedy tokens agree through steps of growing and shrinking rows.
fn batched_host_embedding_rows_equal_resident(dev: &Device) -> Result<()> {
    let models = tiny_models(dev)?;
    let (resident, streamed) = (&models[0].1, &models[3].1);
    let reqs = requests(&[2, 40, 3, 25, 1, 63, 8], &[5, 9, 3], 0.0, 256);
    for batch in [1, 3, 7, 2] {
        let (want, got) = (
            run_batch(resident, &reqs, batch)?,
            run_batch(streamed, &reqs, batch)?,
        );
        for (id, w) in &want {
            let g = got
                .get(id)
                .ok_or_else(|| anyhow::anyhow!("no output for {id}"))?;
            let tokens = |o: &BatchOutput| o.result.as_ref().map(|g| g.tokens.clone()).ok();
            ensure!(
                tokens(w).is_some() && tokens(w) == tokens(g),
                "batch {batch}, request {id}: resident {:?}, streamed {:?}",
                tokens(w),
                tokens(g)
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(batched_host_embedding_rows_equal_resident);

fn batched_streamed_copies_each_layer_once_a_step(dev: &Device) -> Result<()> {
    // Four prompts of one token, 8 tokens each: one-by-one is 4 x 8
    // forwards; batched, 8 forwards, each copying every layer once.
    let cfg = LlamaConfig::preset("tiny")?;
    let model = Llama::from_tensors(init_weights(&cfg, 11)?, &cfg, stream(dev))?;
    let reqs = requests(&[1, 1, 1, 1], &[8], 0.0, 256);
    let bytes = |m: &Llama| -> Result<u64> { Ok(m.stats()?.expect("streamed").h2d_bytes) };
    let before = bytes(&model)?;
    run_batch(&model, &reqs, 4)?;
    let batched = bytes(&model)? - before;
    for r in &reqs {
        generate(&model, &r.prompt, r.max_tokens, 0.0, 1.0, 0, |_| ())?;
    }
    let alone = bytes(&model)? - before - batched;
    ensure!(
        batched > 0 && alone == 4 * batched,
        "host-to-device bytes: batched {batched}, one by one {alone}"
    );
    Ok(())
}
candle_streamer::test_device!(batched_streamed_copies_each_layer_once_a_step);

/// A model whose first layers stay on the device (`Llama::streamed_keeping`)
/// decodes the same tokens as the model streaming every layer, with LoRA
/// adapters too, copies only its other layers (the same bytes a layer, so 3
/// of 4 layers' bytes), gives every weight back, holds no more window slots
/// than streamed layers, and refuses to keep all layers or to train.
fn batched_split_keeps_first_layers(dev: &Device) -> Result<()> {
    let cfg = LlamaConfig::preset("tiny")?;
    let w = init_weights(&cfg, 11)?;
    let src = streamer_core::WeightSource::Tensors(w.clone());
    let streamed = Llama::from_tensors(w, &cfg, stream(dev))?;
    let split = Llama::streamed_keeping(&src, &cfg, stream(dev), 1)?;
    let reqs = requests(&[5, 1, 17, 9, 3], &[12, 4, 9], 0.0, 256);
    let bytes = |m: &Llama| -> Result<u64> { Ok(m.stats()?.expect("streamed").h2d_bytes) };
    let (s0, k0) = (bytes(&streamed)?, bytes(&split)?);
    let want = run_batch(&streamed, &reqs, 3)?;
    let got = run_batch(&split, &reqs, 3)?;
    ensure!(got == want, "split and streamed outputs differ");
    let (s1, k1) = (bytes(&streamed)? - s0, bytes(&split)? - k0);
    ensure!(
        s1 > 0 && 4 * k1 == 3 * s1,
        "host-to-device bytes: split {k1}, streamed {s1}"
    );
    let (a, b) = (streamed.weights()?, split.weights()?);
    let flat = |t: &candle_core::Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
    let names = |w: &std::collections::HashMap<String, candle_core::Tensor>| {
        w.keys().cloned().collect::<std::collections::BTreeSet<_>>()
    };
    ensure!(names(&a) == names(&b), "split gives {:?}", names(&b));
    for (name, t) in &a {
        ensure!(flat(t)? == flat(&b[name])?, "{name} differs");
    }
    // LoRA adapters (B nonzero, so they change the tokens) act on the
    // resident layers as on the streamed ones.
    let adapters = || -> Result<streamer_models::LoraAdapters> {
        let lcfg = streamer_models::LoraConfig::new(4, 16.0, 0.0, &["q_proj", "up_proj"])?;
        let a = streamer_models::LoraAdapters::init(&lcfg, &cfg, dev, 7)?;
        for (name, v) in a.vars() {
            if name.contains("lora_B") {
                v.set(&(v.as_tensor().ones_like()? * 0.05)?)?;
            }
        }
        Ok(a)
    };
    streamed.set_lora(Some(adapters()?))?;
    split.set_lora(Some(adapters()?))?;
    let adapted = run_batch(&streamed, &reqs, 3)?;
    ensure!(adapted != want, "the adapters changed no token");
    ensure!(
        run_batch(&split, &reqs, 3)? == adapted,
        "split and streamed differ with adapters"
    );
    // Keeping 3 of 4 layers streams one through one slot, not the window of 2
    // asked for (the pool allocates no slot beyond its blocks, and the plan
    // counts none).
    let one = Llama::streamed_keeping(&src, &cfg, stream(dev), 3)?;
    let window = one
        .streamed_layers()
        .expect("streamed")
        .lock_pool()?
        .window();
    ensure!(window == 1, "one streamed layer in a window of {window}");
    ensure!(
        run_batch(&one, &reqs, 3)? == want,
        "keeping 3 layers changed the outputs"
    );
    let all = Llama::streamed_keeping(&src, &cfg, stream(dev), 4).expect_err("keeps every layer");
    ensure!(all.to_string().contains("Llama::resident"), "{all}");
    let train = split
        .into_trainable()
        .expect_err("a split model does not train");
    ensure!(train.to_string().contains("streamed_keeping"), "{train}");
    Ok(())
}
candle_streamer::test_device!(batched_split_keeps_first_layers);

/// A sink that records outputs and stops a sequence at a given token.
struct StopAt {
    token: u32,
    outs: Vec<BatchOutput>,
}

impl BatchSink for StopAt {
    fn done(&mut self, out: BatchOutput) -> candle_core::Result<()> {
        self.outs.push(out);
        Ok(())
    }

    fn stop(&mut self, _: &BatchRequest, tokens: &[u32]) -> bool {
        tokens.last() == Some(&self.token)
    }
}

fn batched_bad_requests_fail_alone_and_finish_reasons(dev: &Device) -> Result<()> {
    let cfg = LlamaConfig {
        max_position_embeddings: 24,
        ..LlamaConfig::bytes(32, 2, 4, 2)
    };
    let model = Llama::resident(
        VarBuilder::from_tensors(init_weights(&cfg, 3)?, DType::F32, dev),
        &cfg,
    )?;
    let mut reqs = requests(&[6, 30, 0, 20, 4, 3], &[10], 0.0, 256);
    reqs[3].max_tokens = 50;
    reqs[5].prompt[1] = 256;
    let outs = run_batch(&model, &reqs, 2)?;
    let err = |id: usize| outs[&id].result.clone().err().unwrap_or_default();
    ensure!(
        err(5).contains("token 256 (position 1)") && err(5).contains("vocabulary of 256"),
        "{}",
        err(5)
    );
    ensure!(
        err(1).contains("30 tokens") && err(1).contains("context of 24"),
        "{}",
        err(1)
    );
    ensure!(err(2).contains("empty"), "{}", err(2));
    check_against_alone(
        &model,
        &[reqs[0].clone(), reqs[4].clone()],
        &outs,
        "beside bad requests",
    )?;
    // A prompt of 20 in a context of 24 gets 5 tokens (the last at position
    // 24 is not fed), the first 5 of what `generate` gives.
    let alone = generate(&model, &reqs[3].prompt, 5, 0.0, 1.0, 0, |_| ())?;
    ensure!(
        outs[&3].result
            == Ok(Generated {
                tokens: alone,
                finish: Finish::Context
            }),
        "{:?}",
        outs[&3].result
    );
    // End-of-sequence and caller stops: the stream up to them.
    let r = &reqs[0];
    let full = generate(&model, &r.prompt, r.max_tokens, 0.0, 1.0, 0, |_| ())?;
    let (cut, token) = (3, full[3]);
    let first = full.iter().position(|&t| t == token).expect("present");
    ensure!(first <= cut);
    let mut eos_outs = Vec::new();
    generate_batch(
        &model,
        vec![r.clone()],
        2,
        &[token],
        &mut |o: BatchOutput| {
            eos_outs.push(o);
            Ok(())
        },
    )?;
    let want = Generated {
        tokens: full[..first].to_vec(),
        finish: Finish::Eos,
    };
    ensure!(eos_outs[0].result == Ok(want), "{:?}", eos_outs[0].result);
    let mut sink = StopAt {
        token,
        outs: Vec::new(),
    };
    generate_batch(&model, vec![r.clone()], 2, &[], &mut sink)?;
    let want = Generated {
        tokens: full[..=first].to_vec(),
        finish: Finish::Stop,
    };
    ensure!(sink.outs[0].result == Ok(want), "{:?}", sink.outs[0].result);
    Ok(())
}
candle_streamer::test_device!(batched_bad_requests_fail_alone_and_finish_reasons);

fn batched_matches_one_by_one_transformers_fixtures(dev: &Device) -> Result<()> {
    // A Hugging Face Llama with its tokenizer, and Mistral with a sliding
    // window of 16 that prompts of 20 and generations of 12 cross. Their
    // embeddings are untied: streamed on a GPU, a cached decode looks its
    // rows up in host memory, and its greedy tokens equal the resident ones,
    // as do those of the model keeping its first layer on the device.
    for name in ["llama-tokenizer", "mistral-window16", "qwen3"] {
        let dir = crate::families::fixture(name)?;
        let mut each = Vec::new();
        for placement in [
            Placement::Resident {
                device: dev.clone(),
                dtype: DType::F32,
            },
            Placement::Streamed(stream(dev)),
            Placement::Split {
                stream: stream(dev),
                resident_layers: 1,
            },
        ] {
            let model = Llama::from_pretrained(&dir, placement)?.model;
            let vocab = model.config().vocab_size;
            let reqs = requests(&[20, 3, 8, 14, 1], &[12, 7], 0.0, vocab);
            let outs = run_batch(&model, &reqs, 2)?;
            check_against_alone(&model, &reqs, &outs, name)?;
            each.push(outs);
        }
        ensure!(
            each[0] == each[1] && each[0] == each[2],
            "{name}: resident, streamed and split outputs differ"
        );
    }
    Ok(())
}
candle_streamer::test_device!(batched_matches_one_by_one_transformers_fixtures);

#[test]
fn prompt_lines_parse_and_errors_name_line_and_field() -> Result<()> {
    let p = parse_prompt_line(
        2,
        r#"{"prompt": "Once", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 9, "stop": ["\n", "END"], "id": "a1"}"#,
    )?;
    ensure!(p.line == 2 && p.prompt == "Once" && p.max_tokens == Some(7));
    ensure!(p.temperature == Some(0.0) && p.top_p == Some(0.5) && p.seed == Some(9));
    ensure!(p.stop == ["\n", "END"] && p.passthrough["id"] == "a1");
    let chat = parse_prompt_line(
        3,
        r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}"#,
    )?;
    ensure!(
        chat.messages
            == Some(vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi")
            ])
            && chat.prompt.is_empty()
    );
    let cases = [
        ("{\"prompt\": \"x\"", "not valid JSON"),
        ("[1]", "JSON object"),
        ("{\"max_tokens\": 3}", "no \"prompt\" or \"messages\""),
        ("{\"prompt\": \"x\", \"n\": 2}", "unsupported field `n`"),
        ("{\"messages\": []}", "`messages` must be a non-empty list"),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": []}]}",
            "messages[0] has `tool_calls`",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": [1]}]}",
            "messages[0].content must be a string",
        ),
        (
            "{\"prompt\": \"x\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}",
            "not both",
        ),
        ("{\"prompt\": \"x\", \"top_p\": 1.5}", "`top_p` must be"),
        (
            "{\"prompt\": \"x\", \"max_tokens\": -1}",
            "`max_tokens` must be",
        ),
        ("{\"prompt\": \"x\", \"stop\": \"\"}", "`stop` must be"),
        ("{\"prompt\": 3}", "`prompt` must be a string"),
    ];
    for (text, want) in cases {
        let e = parse_prompt_line(41, text)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        ensure!(
            e.starts_with("line 41: ") && e.contains(want),
            "{text}: {e}"
        );
    }
    ensure!(find_stop("ab\ncdEND", &["END".into(), "\n".into()]) == Some(2));
    ensure!(find_stop("abc", &["x".into()]).is_none());
    Ok(())
}

#[test]
fn output_file_resumes_after_a_cut_last_line() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("batch-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("out.jsonl");
    let _ = std::fs::remove_file(&path);
    let meta = parse_prompt_line(1, r#"{"prompt": "x", "id": 5}"#)?.passthrough;
    let ok = LineOutcome::Text {
        text: "hi\n\"there\"",
        prompt_tokens: 3,
        tokens: 4,
        finish_reason: "stop",
    };
    {
        let (mut out, done) = OutputFile::open_resume(&path)?;
        ensure!(done.is_empty());
        out.append(&output_line(1, &meta, &ok))?;
        out.append(&output_line(
            3,
            &Default::default(),
            &LineOutcome::Error("too long"),
        ))?;
    }
    // A run killed in the middle of writing line 4's result.
    let whole = std::fs::read_to_string(&path)?;
    std::fs::write(&path, format!("{whole}{{\"line\": 4, \"te"))?;
    let (mut out, done) = OutputFile::open_resume(&path)?;
    ensure!(done.iter().copied().eq([1, 3]), "{done:?}");
    out.append(&output_line(4, &Default::default(), &ok))?;
    drop(out);
    let text = std::fs::read_to_string(&path)?;
    ensure!(
        text.starts_with(&whole) && text.lines().count() == 3,
        "{text}"
    );
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap_or_default())?;
    ensure!(
        first["text"] == "hi\n\"there\"" && first["id"] == 5 && first["finish_reason"] == "stop"
    );
    ensure!(completed_lines(&text)?.iter().copied().eq([1, 3, 4]));
    // A file that is not ours is refused, not overwritten.
    std::fs::write(&path, "hello\n")?;
    let e = OutputFile::open_resume(&path)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(e.contains("output line 1 is not a result"), "{e}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The batch a device budget holds: the most sequences whose estimate fits
/// (the next one would not), the kv cache counted as the cache reserves it (2
/// x layers x kv heads x head dim x positions rounded up to 16), and a budget
/// without room for one sequence refused with what one needs.
#[test]
fn batch_plan_sequences_for_budget() -> Result<()> {
    use streamer_models::batch_plan::kv_bytes_per_sequence;
    use streamer_models::{
        sequences_for_budget, BatchMemory, BatchPlacement, BatchShape, LayerFootprint,
    };
    let cfg = LlamaConfig::llama31_8b();
    let streamed = BatchPlacement::Streamed {
        window: 2,
        resident: 0,
    };
    let window = (streamed, LayerFootprint::dense(&cfg, DType::BF16));
    let (capacity, step_rows) = (544, 16384);
    // 32 layers, 8 kv heads of 128, 544 positions, bf16.
    ensure!(kv_bytes_per_sequence(&cfg, DType::BF16, capacity) == 2 * 32 * 8 * 128 * 544 * 2);
    ensure!(kv_bytes_per_sequence(&cfg, DType::BF16, 530) == 2 * 32 * 8 * 128 * 544 * 2);
    let budget = 24usize << 30;
    let n = sequences_for_budget(
        &cfg,
        DType::BF16,
        window,
        (capacity, step_rows, 1 << 14),
        budget,
    )?;
    let total = |sequences| {
        BatchMemory::of(
            &cfg,
            DType::BF16,
            window,
            BatchShape {
                sequences,
                host_sequences: 0,
                capacity,
                step_rows,
            },
        )
        .total()
    };
    ensure!(total(n) <= budget && total(n + 1) > budget, "{n} sequences");
    // Weights: two layers, the final norm and the head (128256 x 4096) in
    // bf16 (a streamed decode looks the untied embedding up on the host);
    // resident, every layer and the embedding too.
    let shape = BatchShape {
        sequences: n,
        host_sequences: 0,
        capacity,
        step_rows,
    };
    let m = BatchMemory::of(&cfg, DType::BF16, window, shape);
    let (table, norm) = (128256 * 4096 * 2, 4096 * 2);
    ensure!(
        m.weights == 2 * cfg.layer_params() * 2 + table + norm,
        "{m:?}"
    );
    let resident = (BatchPlacement::Resident, window.1);
    let r = BatchMemory::of(&cfg, DType::BF16, resident, shape);
    let all = 32 * cfg.layer_params() * 2 + 2 * table + norm;
    ensure!(r.weights == all, "{r:?}");
    // Tied, the table is the head: on the device either way.
    let tied = LlamaConfig {
        tie_word_embeddings: true,
        ..cfg.clone()
    };
    let t = BatchMemory::of(&tied, DType::BF16, window, shape);
    ensure!(t.weights == m.weights, "{t:?}");
    ensure!((250..300).contains(&n), "{n} sequences in 24 GiB");
    // Capped by the caller's most.
    ensure!(
        sequences_for_budget(&cfg, DType::BF16, window, (capacity, step_rows, 10), budget)? == 10
    );
    let e = sequences_for_budget(&cfg, DType::BF16, window, (capacity, step_rows, 8), 4 << 30)
        .expect_err("4 GiB holds the weights but not one step");
    ensure!(
        matches!(streamer_device::Error::find(&e),
            Some(&streamer_device::Error::OutOfMemory { needed, free, .. })
                if free == 4 << 30 && needed > free),
        "{e}"
    );
    ensure!(e.to_string().contains("holds no sequence of 544"), "{e}");
    Ok(())
}

/// Round rates of an H200-class GPU (50 GB/s over PCIe, 3 TB/s device
/// memory, 700 TFLOP/s) and FlexGen's workload: prompts of 512 tokens, 32
/// generated, up to 4096 sequences.
fn rates_and_run() -> (DecodeRates, BatchRun) {
    let rates = DecodeRates {
        h2d_bytes_per_s: 50e9,
        device_bytes_per_s: 3e12,
        flops_per_s: 700e12,
    };
    let run = BatchRun {
        capacity: 544,
        step_rows: 16384,
        most: 4096,
        prompt_len: 512.0,
        new_tokens: 32.0,
        host_kv_bytes: 0,
    };
    (rates, run)
}

/// The placement and batch `plan_batch` picks for 8B shapes, checked against
/// the expected tokens/s computed here from the rates (f64 arithmetic of the
/// same model: per request the resident layers' part of its FLOPs at the
/// GEMM rate and its share of the steps' reads of their weights, plus the
/// streamed layers' part of its FLOPs or its share of the steps' copies of
/// their weights, whichever is longer; a step generates a token for at most
/// 32 of every 544 of its rows).
#[test]
fn batch_plan_picks_resident_split_or_streamed() -> Result<()> {
    use streamer_models::{
        plan_batch, request_flops, BatchPlacement, BatchPlan, LayerFootprint,
        PlacementChoice::{AllStreamed, Any, Streaming},
        STEP_COMPUTE_SHARE,
    };
    let cfg = LlamaConfig::llama31_8b();
    let (rates, run) = rates_and_run();
    // FLOPs row by row: 2 x layer params per row and layer, 4 x width x
    // context for attention, the head on the 32 generated rows.
    let mut want = 0.0;
    for i in 1..=543usize {
        want += 32.0 * (2.0 * cfg.layer_params() as f64 + 4.0 * 4096.0 * i as f64);
    }
    want += 32.0 * 2.0 * 4096.0 * 128256.0;
    let got = request_flops(&cfg, 512, 32);
    ensure!((got / want - 1.0).abs() < 1e-12, "{got} vs {want}");
    let slot = 2.0 * cfg.layer_params() as f64;
    let bf16 = (DType::BF16, LayerFootprint::dense(&cfg, DType::BF16));
    let streamed_layers = |p: &BatchPlan| match p.placement {
        BatchPlacement::Resident => 0,
        BatchPlacement::Streamed { resident, .. } => 32 - resident,
    };
    let expect = |p: &BatchPlan| {
        let compute = want / rates.flops_per_s;
        // A step's rows bound the tokens it generates: 32 of every 544 rows.
        let share = 32.0 / (p.sequences as f64).min(p.step_rows as f64 * 32.0 / 544.0);
        let streamed = streamed_layers(p) as f64;
        let copy = streamed * slot / rates.h2d_bytes_per_s;
        let read = (32.0 - streamed) * slot / rates.device_bytes_per_s;
        // The resident layers run first; only the streamed ones overlap
        // their copies.
        let part = streamed / 32.0;
        32.0 / (compute * (1.0 - part) + share * read + (compute * part).max(share * copy))
    };
    // A streamed plan's steps hold as many rows as the GEMM rate computes
    // while its streamed layers are copied, one whole request at least.
    let hidden = |p: &BatchPlan| {
        let copy = streamed_layers(p) as f64 * slot / rates.h2d_bytes_per_s;
        let rows = (STEP_COMPUTE_SHARE * copy * rates.flops_per_s
            / (64.0 * cfg.layer_params() as f64))
            .floor();
        rows.clamp(544.0, 16384.0) as usize
    };
    let plan = |gib: usize, choice, rates: &DecodeRates| {
        plan_batch(&cfg, bf16, (gib << 30, 2, choice), run, rates)
    };
    // Every layer streamed: the most sequences 24 GiB holds beside two layers.
    let s = plan(24, AllStreamed, &rates)?;
    let all = BatchPlacement::Streamed {
        window: 2,
        resident: 0,
    };
    ensure!(s.placement == all && s.sequences > 200, "{s}");
    ensure!((s.tokens_per_s / expect(&s) - 1.0).abs() < 1e-9, "{s}");
    ensure!(s.step_rows == hidden(&s) && s.step_rows < 16384, "{s}");
    ensure!(s.limits().sequences == s.sequences && s.limits().step_rows == s.step_rows);
    // At least one layer streamed: the first layers stay resident, a step
    // copies the others, and the weights counted are theirs and the window's
    // (the final norm and the head beside them; the embedding stays on the
    // host).
    let t = plan(24, Streaming, &rates)?;
    let BatchPlacement::Streamed {
        window: 2,
        resident,
    } = t.placement
    else {
        anyhow::bail!("{t}");
    };
    ensure!(resident > 0 && resident < 32, "{t}");
    let outer = (128256 * 4096 + 4096) * 2;
    ensure!(
        t.memory.weights == (resident + 2).min(32) * slot as usize + outer,
        "{t}"
    );
    ensure!(
        t.memory.total() <= 24 << 30 && t.step_rows == hidden(&t),
        "{t}"
    );
    ensure!((t.tokens_per_s / expect(&t) - 1.0).abs() < 1e-9, "{t}");
    ensure!(t.tokens_per_s > s.tokens_per_s, "{t} vs {s}");
    // Any placement: the fastest, never slower than the split.
    let p = plan(24, Any, &rates)?;
    ensure!(
        p.placement == BatchPlacement::Resident || p == t,
        "{p} vs {t}"
    );
    ensure!(p.tokens_per_s >= t.tokens_per_s, "{p} vs {t}");
    ensure!((p.tokens_per_s / expect(&p) - 1.0).abs() < 1e-9, "{p}");
    ensure!(p.memory.total() <= 24 << 30, "{p}");
    // 16 GiB cannot hold the model's 15 GiB of weights and a step: part of
    // it streams.
    let q = plan(16, Any, &rates)?;
    ensure!(
        streamed_layers(&q) > 0 && q.memory.total() <= 16 << 30,
        "{q}"
    );
    // With PCIe as fast as device memory, more sequences win: few layers
    // stay resident.
    let fast = DecodeRates {
        h2d_bytes_per_s: 3e12,
        ..rates
    };
    let f = plan(24, Any, &fast)?;
    ensure!(streamed_layers(&f) > streamed_layers(&t), "{f} vs {t}");
    // Nothing fits: the streamed plan's error names the budget.
    let e = plan(4, Any, &rates).expect_err("4 GiB holds no plan");
    ensure!(
        streamer_device::Error::is_out_of_memory(&e) && e.to_string().contains("4.00 GiB"),
        "{e}"
    );
    for p in [&s, &t, &p, &q, &f] {
        println!("{p}");
    }
    Ok(())
}

/// A quantized base's layers count as their packed bytes in a window slot
/// plus one layer dequantized while it computes: the footprint equals the
/// packed buffers `QuantizedWeights::synthetic` makes, and for 8B shapes in
/// NF4 (block size 64, an f32 absmax a block) 0.5625 bytes a linear weight.
/// A quantized plan streams (its layers cannot be resident), holds more
/// sequences than the dense streamed plan in the same budget, and predicts
/// its PCIe floor from the packed bytes.
#[test]
fn batch_plan_counts_packed_layers() -> Result<()> {
    use streamer_models::{
        plan_batch, BatchPlacement, LayerFootprint, PlacementChoice, QuantizedWeights,
    };
    use streamer_quant::QuantScheme;
    let nf4 = QuantScheme::parse("nf4")?;
    let tiny = LlamaConfig::preset("tiny")?;
    for scheme in ["nf4", "int8", "fp8"] {
        let scheme = QuantScheme::parse(scheme)?;
        let q = QuantizedWeights::synthetic(&tiny, scheme, 0, 0.05)?;
        let f = LayerFootprint::quantized(&tiny, DType::BF16, scheme, |_| false)?;
        let norms = 2 * tiny.hidden_size * 2;
        let linear = tiny.layer_params() - 2 * tiny.hidden_size;
        ensure!(
            f.slot * tiny.num_hidden_layers == q.packed_bytes() + norms * tiny.num_hidden_layers,
            "{scheme:?}: {f:?} against {} packed bytes",
            q.packed_bytes()
        );
        ensure!(f.scratch == linear * 2 && f.quantized, "{f:?}");
    }
    let cfg = LlamaConfig::llama31_8b();
    let linear = cfg.layer_params() - 2 * 4096;
    let f = LayerFootprint::quantized(&cfg, DType::BF16, nf4, |_| false)?;
    ensure!(f.slot == linear * 9 / 16 + 2 * 4096 * 2, "{f:?}");
    // Weights kept dense (a checkpoint's skip_modules) count in full.
    let skip = LayerFootprint::quantized(&cfg, DType::BF16, nf4, |n| n.contains("down_proj"))?;
    let down = 4096 * 14336;
    ensure!(skip.slot == f.slot + down * 2 - down * 9 / 16, "{skip:?}");
    ensure!(skip.scratch == f.scratch - down * 2, "{skip:?}");
    let (rates, run) = rates_and_run();
    let budget = (24 << 30, 2, PlacementChoice::Any);
    let p = plan_batch(&cfg, (DType::BF16, f), budget, run, &rates)?;
    ensure!(
        p.placement
            == BatchPlacement::Streamed {
                window: 2,
                resident: 0
            },
        "{p}"
    );
    // The final norm and the head; the embedding stays on the host.
    let outer = (128256 * 4096 + 4096) * 2;
    ensure!(p.memory.weights == 2 * f.slot + f.scratch + outer, "{p}");
    // The packed layers leave room for more sequences than dense ones.
    let dense = LayerFootprint::dense(&cfg, DType::BF16);
    let streamed = BatchPlacement::Streamed {
        window: 2,
        resident: 0,
    };
    let most = (544, p.step_rows, 4096);
    let fit =
        |l| streamer_models::sequences_for_budget(&cfg, DType::BF16, (streamed, l), most, 24 << 30);
    ensure!(fit(f)? == p.sequences && fit(dense)? < p.sequences, "{p}");
    // Steps of as many rows as the GEMM rate computes while the packed
    // layers are copied, and at least one whole request.
    let copy_s = (32 * f.slot) as f64 / rates.h2d_bytes_per_s;
    let hidden = (streamer_models::STEP_COMPUTE_SHARE * copy_s * rates.flops_per_s
        / (64.0 * cfg.layer_params() as f64))
        .floor();
    ensure!(
        p.step_rows as f64 == hidden.max(544.0),
        "{p}: {hidden} rows"
    );
    let slow = DecodeRates {
        flops_per_s: 1e12,
        ..rates
    };
    let s = plan_batch(&cfg, (DType::BF16, f), budget, run, &slow)?;
    ensure!(
        s.step_rows == 544,
        "{s}: a step holds one whole request at least"
    );
    // Streamed: the request's FLOPs or its share of the packed copies.
    let compute = streamer_models::request_flops(&cfg, 512, 32) / rates.flops_per_s;
    let per_step = (p.sequences as f64).min(p.step_rows as f64 * 32.0 / 544.0);
    let floor = 32.0 * (32 * f.slot) as f64 / rates.h2d_bytes_per_s / per_step;
    let want = 32.0 / compute.max(floor);
    ensure!((p.tokens_per_s / want - 1.0).abs() < 1e-9, "{p}: {want}");
    Ok(())
}

/// Host-memory kv caches in the plan: for 70B shapes in NF4 under 24 GiB
/// (packed layers of about 0.45 GB a step each, so a step's weights take
/// 0.7 s over PCIe while the device holds the cache of about 100 sequences),
/// sequences with their cache on the host raise the predicted tokens/s;
/// the plan's prediction equals the same model computed here with each host
/// sequence's whole cache added to the step's copies, the host caches stay
/// within the run's host memory and the device part within the budget. With
/// no host memory allowed, none is planned.
#[test]
fn batch_plan_keeps_kv_in_host_memory_where_it_pays() -> Result<()> {
    use streamer_models::{
        kv_bytes_per_sequence, plan_batch, request_flops, LayerFootprint, PlacementChoice,
        STEP_COMPUTE_SHARE,
    };
    let cfg = LlamaConfig::llama31_70b();
    let nf4 = streamer_quant::QuantScheme::parse("nf4")?;
    let f = LayerFootprint::quantized(&cfg, DType::BF16, nf4, |_| false)?;
    let (rates, run) = rates_and_run();
    let budget = (24 << 30, 2, PlacementChoice::Any);
    let device = plan_batch(&cfg, (DType::BF16, f), budget, run, &rates)?;
    ensure!(
        device.host_sequences == 0 && device.memory.kv_staging == 0,
        "{device}"
    );
    let host_run = BatchRun {
        host_kv_bytes: 64 << 30,
        ..run
    };
    let p = plan_batch(&cfg, (DType::BF16, f), budget, host_run, &rates)?;
    let per_seq = kv_bytes_per_sequence(&cfg, DType::BF16, 544);
    ensure!(per_seq == 2 * 80 * 8 * 128 * 544 * 2, "{per_seq}");
    ensure!(p.host_sequences > 0, "{p}");
    ensure!(p.host_sequences * per_seq <= 64 << 30, "{p}");
    ensure!(p.memory.total() <= 24 << 30, "{p}");
    ensure!(
        p.memory.kv_staging == 3 * p.host_sequences * per_seq / 80,
        "{p}"
    );
    ensure!(
        p.memory.kv == (p.sequences - p.host_sequences) * per_seq,
        "{p}"
    );
    ensure!(
        p.tokens_per_s > 1.3 * device.tokens_per_s,
        "{p} vs {device}"
    );
    let limits = p.limits();
    ensure!(limits.host_kv == p.host_sequences && limits.sequences == p.sequences);
    // The prediction, every layer streamed: the request's FLOPs or its share
    // of a step's copies (the packed layers and the host caches), whichever
    // is longer; the steps' rows from the copy time at the GEMM rate.
    let copy = (80 * f.slot + p.host_sequences * per_seq) as f64 / rates.h2d_bytes_per_s;
    let rows = (STEP_COMPUTE_SHARE * copy * rates.flops_per_s
        / (2.0 * 80.0 * cfg.layer_params() as f64)) as usize;
    ensure!(
        p.step_rows == rows.clamp(544, 16384),
        "{p}: {rows} rows expected"
    );
    let share = 32.0 / (p.sequences as f64).min(p.step_rows as f64 * 32.0 / 544.0);
    let compute = request_flops(&cfg, 512, 32) / rates.flops_per_s;
    let want = 32.0 / compute.max(share * copy);
    ensure!((p.tokens_per_s / want - 1.0).abs() < 1e-9, "{p}: {want}");
    println!("{device}\n{p}");
    Ok(())
}
