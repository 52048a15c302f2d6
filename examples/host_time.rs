//! Host (CPU) time of one request outside the model forward, stage by stage (not a test: the
//! timings are printed, never asserted). The request is bench/gpu_bench.py's: a state of about
//! 256, 4K or 16K prompt tokens, 3 questions (a 4-option choice, a noul, a 5-level score) and 4
//! rotations: 11 passes. The engine is replaced by a call that returns logits of the right shape
//! at once, so `host total` is what `usage.total_ms` counts besides the engine's stages; the
//! engine's own host work (layouts, rotary tables, tree tables) is timed beside it with the
//! Qwen3.5-4B config, the same calls the engine makes.
//!
//! `cargo run --release --example host_time -- [--repeats 21] [--tokens 257,4097,16385]`

use imajev_serve::api::parse::{parse_request, ParseContext, RequestBody, DEFAULT_MAX_QUESTIONS};
use imajev_serve::api::{decide_direct, ApiError, EngineCall};
use imajev_serve::backend::tree::TreeCalls;
use imajev_serve::decision::answer::tallies;
use imajev_serve::decision::prompt::{pass_text, INSTRUCTION, TEMPLATE_TAIL, USER_START};
use imajev_serve::decision::{pyjson, Codebook, ContractMode, Decider, DecisionSettings, Timings};
use imajev_serve::engine::positions;
use imajev_serve::image::ImageProcessorConfig;
use imajev_serve::tokenizer::{Piece, QwenTokenizer};
use imajev_serve::worker::{BatchLimits, EngineOutput};
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

const WORDS: &str =
    "printer network outage invoice refund account password badge floor office laptop screen \
error update firmware vendor contract team manager urgent tomorrow meeting report customer server database \
backup restore ticket queue escalation policy budget approval";

/// bench/gpu_bench.py's state: `n` words drawn from WORDS (a small LCG, deterministic).
fn state_text(n: usize, seed: u64) -> String {
    let words: Vec<&str> = WORDS.split(' ').collect();
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.push(words[((x >> 33) % words.len() as u64) as usize]);
    }
    out.join(" ")
}

fn body(state: &str) -> Vec<u8> {
    let req = json!({
        "model": "jev-latest",
        "state": {"case": state},
        "questions": {
            "route": {"type": "choice", "instructions": "Which team should handle this case?",
                      "criteria": {"infra": "network and connectivity", "facilities": "physical devices and rooms",
                                   "identity": "accounts and access", "billing": "invoices and refunds"}},
            "urgent": {"type": "noul", "instructions": "Does the reporter need an answer today?",
                       "criteria": {"true": "a deadline or an outage is mentioned"}},
            "impact": {"type": "score", "instructions": "How many people are affected?",
                       "criteria": ["nobody", "one person", "a team", "a department", "the whole company"]}
        }
    });
    serde_json::to_vec(&req).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median milliseconds of `f` over `repeats` runs (after one warm-up run).
fn time<T>(repeats: usize, mut f: impl FnMut() -> T) -> f64 {
    std::hint::black_box(f());
    median(
        (0..repeats)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(f());
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let repeats: usize = arg("--repeats").map_or(Ok(21), |s| s.parse())?;
    let targets: Vec<usize> = arg("--tokens")
        .unwrap_or_else(|| "257,4097,16385".into())
        .split(',')
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;

    let tok = Arc::new(QwenTokenizer::builtin()?);
    let codebook = Codebook::derive(&tok, 256)?;
    let settings = DecisionSettings {
        rotations: 4,
        calibration: None,
        mode: ContractMode::Imajev,
        max_input_tokens: 65536,
        model_name: "jev-latest".into(),
    };
    let decider = Arc::new(Decider::new(tok.clone(), codebook, settings));
    let ctx = ParseContext::for_decider(&decider, DEFAULT_MAX_QUESTIONS, ImageProcessorConfig::default());
    let config = imajev_serve::synth::preset("qwen3.5-4b")?;
    let rope = config.text_config.rope()?;
    let limits = BatchLimits::default();
    println!("threads {}, repeats {repeats}", rayon::current_num_threads());

    for &target in &targets {
        // As gpu_bench.py: guess the words, measure the ratio, guess again.
        let overhead = 130;
        let words = target.saturating_sub(overhead).max(1);
        let ratio = tok.encode(&state_text(words, 7))?.len() as f64 / words as f64;
        let state = state_text(((target - overhead) as f64 / ratio) as usize, 7);
        let bytes = body(&state);

        let parsed = parse_request(RequestBody::json(bytes.clone()), &ctx).map_err(api)?;
        let req = parsed.request.clone();
        let plan = decider.plan(&req).map_err(|e| anyhow::anyhow!("{e}"))?;
        let logits: Vec<Vec<Vec<f32>>> = plan
            .scored
            .iter()
            .map(|sp| {
                let n = sp.question.candidates.len();
                sp.passes
                    .iter()
                    .enumerate()
                    .map(|(p, _)| (0..n).map(|i| (i + p) as f32 * 0.37).collect())
                    .collect()
            })
            .collect();
        let alone = limits.one_forward(&plan).is_none();

        // The whole host path: `decide_direct` (its runtime, parsing, planning, the answers) with
        // an engine that answers at once.
        let host_total = time(repeats, || {
            decide_direct(RequestBody::json(bytes.clone()), ctx.clone(), decider.clone(), |_: EngineCall| {
                Ok(EngineOutput { logits: logits.clone(), ..Default::default() })
            })
            .map(|d| d.response)
            .map_err(|e| e.to_string())
        });
        let t_parse = time(repeats, || {
            parse_request(RequestBody::json(bytes.clone()), &ctx).map_err(|e| e.to_string())
        });
        let t_plan = time(repeats, || decider.plan(&req).map_err(|e| e.to_string()));
        let t_dumps = time(repeats, || pyjson::dumps(&req.state, pyjson::PROMPT_STATE).is_ok());
        // The plan's two tokenizer parts, each by itself: the shared prefix (a long one is cut into
        // pieces encoded in parallel), and every pass one after another on this thread.
        let state_json = pyjson::dumps(&req.state, pyjson::PROMPT_STATE).unwrap();
        let user = format!("{INSTRUCTION}\nState: {state_json}\n");
        let t_prefix =
            time(repeats, || tok.encode_pieces(&[Piece::Template(USER_START), Piece::Text(&user)]).unwrap());
        let pass_texts: Vec<String> = plan
            .scored
            .iter()
            .flat_map(|sp| {
                let labels = decider.codebook.labels(sp.question.candidates.len());
                sp.passes.iter().map(move |p| pass_text(&sp.question, &labels, p.offset)).collect::<Vec<_>>()
            })
            .collect();
        let t_passes = time(repeats, || {
            for t in &pass_texts {
                let (user, _) = t.split_at(t.len() - TEMPLATE_TAIL.len());
                std::hint::black_box(
                    tok.encode_pieces(&[Piece::Text(user), Piece::Template(TEMPLATE_TAIL)]).unwrap(),
                );
            }
        });
        let t_answers = time(repeats, || {
            let outcomes = decider.outcomes(&req, &plan, &logits);
            let response = decider.respond_with(&req, &plan, &outcomes, Timings::default());
            (tallies(&req, &outcomes), response)
        });
        let response = decider.respond(&req, &plan, &logits, Timings::default());
        let t_serialise = time(repeats, || serde_json::to_vec(&response).unwrap());
        let t_runtime = time(repeats, || tokio::runtime::Builder::new_current_thread().build().unwrap());

        // The engine's host work, as the runner does it: the layouts (one level: every pass
        // continues the prefix with its question's shared tokens and its suffix), then the rows'
        // rotary tables and the tree tables of the forward(s).
        let image_token = config.image_token_id;
        let merge = config.vision_config.spatial_merge_size;
        let layouts = || -> anyhow::Result<Vec<positions::SequenceLayout>> {
            let prefix = positions::layout(&plan.prefix, image_token, &[], merge, 0)?;
            let start = prefix.next_pos;
            let mut out = vec![prefix];
            for sp in &plan.scored {
                for pass in &sp.passes {
                    let ids = [sp.common.as_slice(), pass.suffix.as_slice()].concat();
                    out.push(positions::layout(&ids, image_token, &[], merge, start)?);
                }
            }
            Ok(out)
        };
        let t_layouts = time(repeats, || layouts().unwrap());
        let ls = layouts()?;
        let forwards: Vec<Vec<&positions::SequenceLayout>> =
            if alone { vec![vec![&ls[0]], ls[1..].iter().collect()] } else { vec![ls.iter().collect()] };
        let t_rope = time(repeats, || {
            for f in &forwards {
                let pos: [Vec<i64>; 3] =
                    std::array::from_fn(|a| f.iter().flat_map(|l| l.positions[a].iter().copied()).collect());
                std::hint::black_box(positions::text_rope_tables(
                    &pos,
                    rope.theta,
                    rope.rotary_dim,
                    rope.mrope_section,
                ));
            }
        });
        // The same tables as the engine makes them now: from the rows kept from earlier forwards
        // (made once here, before the timing, as the server's first request would).
        let mut kept = positions::TextRopeCache::new(rope.theta, rope.rotary_dim, rope.mrope_section);
        let t_rope_kept = time(repeats, || {
            for f in &forwards {
                let pos: [Vec<i64>; 3] =
                    std::array::from_fn(|a| f.iter().flat_map(|l| l.positions[a].iter().copied()).collect());
                let (c, s) = kept.tables(&pos);
                std::hint::black_box((c.len(), s.len()));
            }
        });
        let t_tree = time(repeats, || {
            let mut ranges = Vec::new();
            let mut at = 0;
            for l in &ls {
                ranges.push(at..at + l.ids.len());
                at += l.ids.len();
            }
            let parents: Vec<Option<usize>> = (0..ls.len()).map(|i| (i > 0).then_some(0)).collect();
            TreeCalls::new(&parents, &ranges).unwrap()
        });
        println!(
            "{} tokens ({} bytes of body, {} passes, {}): host total {host_total:.2} ms = parse {t_parse:.2} + plan \
             {t_plan:.2} (state dumps {t_dumps:.2}; by themselves: prefix {t_prefix:.2}, passes {t_passes:.2}) + answers {t_answers:.2} + runtime {t_runtime:.3}; response \
             serialisation {t_serialise:.3}; engine host: layouts {t_layouts:.3}, rope tables {t_rope:.2} (from kept rows {t_rope_kept:.2}), tree \
             tables {t_tree:.3}",
            plan.max_pass_tokens,
            bytes.len(),
            plan.pass_count(),
            if alone { "alone" } else { "one packed forward" },
        );
    }
    Ok(())
}

fn api(e: ApiError) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}
