//! The whole engine on the GPU: the golden models (vision, decoder, LoRA, readout) against the CPU
//! and transformers' goldens, whole forwards with the fused norm quantisation bitwise against
//! the unfused ones, and prefix + forks (separately and in one forward) against full forwards.

use super::harness::{argmax, bit_diff, fixtures, floats, images, rel, synthesize, variant, Report};
use anyhow::{anyhow, Result};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::CudaBackend;
use imajev_serve::backend::Backend;
use imajev_serve::engine::Qwen35;
use imajev_serve::synth::{self, SynthDtype};
use imajev_serve::tokenizer::QwenTokenizer;
use serde_json::Value;
use std::collections::HashMap;
use std::time::Instant;

pub fn engine(g: &CudaBackend, rep: &mut Report) -> Result<()> {
    let p = "engine";
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json"))?)?;
    let mut models = HashMap::new();
    for m in doc["models"].as_array().unwrap() {
        models.insert(m["name"].as_str().unwrap().to_string(), synthesize(m)?);
    }
    type Pair = (Qwen35<CpuBackend>, Qwen35<CudaBackend>);
    let mut loaded: HashMap<(String, bool), Pair> = HashMap::new();
    for (i, case) in doc["cases"].as_array().unwrap().iter().enumerate() {
        let name = case["model"].as_str().unwrap().to_string();
        let with_adapter = case["adapter"].as_bool().unwrap();
        let s = &models[&name];
        if let std::collections::hash_map::Entry::Vacant(e) = loaded.entry((name.clone(), with_adapter)) {
            let ad = with_adapter.then_some(s.adapter.as_path());
            e.insert((
                Qwen35::load(CpuBackend::default(), &s.model, ad)?,
                Qwen35::load(g.clone(), &s.model, ad)?,
            ));
        }
        let (cm, gm) = &loaded[&(name.clone(), with_adapter)];
        let tok = QwenTokenizer::from_model_dir(&s.model)?;
        let ids = tok.encode(case["prompt"].as_str().unwrap())?;
        let imgs = images(case, &s.model)?;
        let refs: Vec<&_> = imgs.iter().collect();
        let t0 = Instant::now();
        let (_, hg, _) = gm.prefill(&ids, &refs)?;
        let hgv = gm.backend.download(&hg)?;
        let gpu_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (_, hc, _) = cm.prefill(&ids, &refs)?;
        let hcv = cm.backend.download(&hc)?;
        let label = format!(
            "case {i:2} {name} adapter={with_adapter} images={} tokens={}",
            refs.len(),
            case["input_ids"].as_array().unwrap().len()
        );
        rep.check(p, format!("{label}: hidden vs CPU"), rel(&hgv, &hcv), 3e-2);
        rep.info(
            p,
            format!("case {i:2}: hidden vs transformers fp32 golden"),
            rel(&hgv, &floats(&case["hidden_last"])),
            format!("GPU prefill {gpu_ms:.1} ms"),
        );
        if with_adapter {
            let (lg, lc) = (gm.readout(&hg)?.remove(0), cm.readout(&hc)?.remove(0));
            rep.check(p, format!("case {i:2}: readout logits vs CPU"), rel(&lg, &lc), 3e-2);
            rep.flag(
                p,
                format!("case {i:2}: readout argmax agrees"),
                argmax(&lg) == argmax(&lc),
                format!("gpu {} cpu {}", argmax(&lg), argmax(&lc)),
            );
        }
    }
    Ok(())
}

/// Whole forwards with the FP8 activation quantisation fused into the norms equal forwards with
/// it in its own kernel, bitwise: an FP8 checkpoint whose norms are whole 128-blocks wide (the
/// golden tiny models are 64 wide, so their norms never fuse), four layers of the 4B's widths
/// (cuBLASLt's block-scaled FP8 GEMM refuses K = 256, so no narrower model) with a 4096-wide
/// MLP; a prefill (input norms, post-attention norms, DeltaNet gated norms, the last layer's norm
/// on gathered rows) and a batched extend of two forks.
pub fn fused_engine(g: &CudaBackend, rep: &mut Report) -> Result<()> {
    let p = "engine";
    let mut v = synth::preset_json("tiny").expect("the tiny preset");
    let t = &mut v["text_config"];
    for (k, n) in [
        ("hidden_size", 2560),
        ("intermediate_size", 4096),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 4),
        ("head_dim", 256),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("linear_num_key_heads", 16),
        ("linear_num_value_heads", 32),
    ] {
        t[k] = n.into();
    }
    t["rope_parameters"]["partial_rotary_factor"] = serde_json::json!(0.25);
    t["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    v["vision_config"]["out_hidden_size"] = 2560.into();
    let dir = tempfile::tempdir()?;
    let cfg_path = dir.path().join("config-128.json");
    std::fs::write(&cfg_path, serde_json::to_string(&v)?)?;
    let cfg = synth::preset(cfg_path.to_str().unwrap())?;
    let (model, adapter) = (dir.path().join("model"), dir.path().join("adapter"));
    synth::write_model(&cfg, SynthDtype::Fp8, 21, &model)?;
    synth::write_adapter(&cfg, 4, 8.0, 12, 21, &adapter)?;
    let u = variant(g, |o| o.unfused_act_quant = true)?;
    let gm = Qwen35::load(g.clone(), &model, Some(&adapter))?;
    let um = Qwen35::load(u, &model, Some(&adapter))?;
    let tok = QwenTokenizer::from_model_dir(&model)?;
    let ids = tok.encode(
        "State: the printer on the third floor prints every page twice and the toner light is on. \
         Question: what should the office manager do first? Answer",
    )?;
    let ((mut sg, hg, _), (mut su, hu, _)) = (gm.prefill(&ids, &[])?, um.prefill(&ids, &[])?);
    let (hgv, huv) = (gm.backend.download(&hg)?, um.backend.download(&hu)?);
    let (lg, lu) = (gm.readout(&hg)?.remove(0), um.readout(&hu)?.remove(0));
    rep.check(
        p,
        format!("fused norm quant, 4B-wide 4-layer FP8 model, prefill {} tokens: hidden + readout ≠ unfused (bitwise)", ids.len()),
        (bit_diff(&hgv, &huv) + bit_diff(&lg, &lu)) as f64,
        0.0,
    );
    let (s1, s2) = (tok.encode(" Restart it")?, tok.encode(" Call the vendor and ask for a new drum unit")?);
    sg.share(&gm.backend)?;
    su.share(&um.backend)?;
    let mut fg = vec![sg.fork(), sg.fork()];
    let mut fu = vec![su.fork(), su.fork()];
    let eg = gm.backend.download(&gm.extend(&mut fg, &[&s1, &s2])?)?;
    let eu = um.backend.download(&um.extend(&mut fu, &[&s1, &s2])?)?;
    rep.check(p, "… extend of 2 forks: hidden ≠ unfused (bitwise)", bit_diff(&eg, &eu) as f64, 0.0);

    // Programmatic dependent launch (CudaOptions::pdl) toggled from what `g` runs: every kernel
    // may launch before the previous one finishes and waits for it in pdl_begin, so the same
    // work in the same order gives the same bits — and a kernel reading before its wait would
    // show here as a difference.
    let pdl_on = !g.options().pdl.unwrap_or(false);
    let t = variant(g, |o| o.pdl = Some(pdl_on))?;
    let tm = Qwen35::load(t, &model, Some(&adapter))?;
    let (mut st, ht, _) = tm.prefill(&ids, &[])?;
    let (htv, lt) = (tm.backend.download(&ht)?, tm.readout(&ht)?.remove(0));
    st.share(&tm.backend)?;
    let mut ft = vec![st.fork(), st.fork()];
    let et = tm.backend.download(&tm.extend(&mut ft, &[&s1, &s2])?)?;
    rep.check(
        p,
        format!(
            "programmatic dependent launch {} (Hopper: {}): prefill hidden + readout + extend of 2 forks ≠ {} (bitwise)",
            if pdl_on { "on" } else { "off" },
            g.info().hopper(),
            if pdl_on { "off" } else { "on" }
        ),
        (bit_diff(&hgv, &htv) + bit_diff(&lg, &lt) + bit_diff(&eg, &et)) as f64,
        0.0,
    );
    Ok(())
}

pub fn prefix_extend(g: &CudaBackend, rep: &mut Report) -> Result<()> {
    let p = "extend";
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json"))?)?;
    let spec = doc["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "tiny-bf16")
        .ok_or_else(|| anyhow!("no tiny-bf16"))?;
    let s = synthesize(spec)?;
    let model = Qwen35::load(g.clone(), &s.model, Some(&s.adapter))?;
    let case = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["model"] == "tiny-bf16" && !c["images"].as_array().unwrap().is_empty())
        .unwrap();
    let tok = QwenTokenizer::from_model_dir(&s.model)?;
    let ids = tok.encode(case["prompt"].as_str().unwrap())?;
    let imgs = images(case, &s.model)?;
    let refs: Vec<&_> = imgs.iter().collect();
    let split = ids.len() - 12;
    let (prefix, suffix) = ids.split_at(split);
    let suffix2 = tok.encode("Question: is the printer broken? Answer")?;
    let (mut st, _, _) = model.prefill(prefix, &refs)?;
    st.share(&model.backend)?;
    let tokens_before = st.tokens;
    let mut forks = vec![st.fork(), st.fork()];
    let h = model.extend(&mut forks, &[suffix, &suffix2])?;
    let hv = model.backend.download(&h)?;
    let d = model.hidden_size();
    let logits = model.readout(&h)?;
    for (r, suf) in [suffix, &suffix2[..]].iter().enumerate() {
        let full: Vec<u32> = prefix.iter().chain(suf.iter()).copied().collect();
        let (_, hf, _) = model.prefill(&full, &refs)?;
        let hfv = model.backend.download(&hf)?;
        rep.check(
            p,
            format!(
                "fork {r}: prefix {} + suffix {} (batched extend) vs full forward",
                prefix.len(),
                suf.len()
            ),
            rel(&hv[r * d..(r + 1) * d], &hfv),
            3e-2,
        );
        let lf = model.readout(&hf)?.remove(0);
        rep.flag(
            p,
            format!("fork {r}: readout argmax agrees with full forward"),
            argmax(&logits[r]) == argmax(&lf),
            "",
        );
    }
    rep.flag(p, "prefix state untouched by extending its forks", st.tokens == tokens_before, "");
    // The prefix and both suffixes as ONE forward (the forks made inside it) equal prefill,
    // share, fork, extend — bitwise, as every row's arithmetic is the same — and the states it
    // leaves continue like the forks'.
    let feats = model.encode_images(&refs)?;
    let layout = model.layout(prefix, &refs, 0)?;
    let (mut tree, ht) = model.prefill_extend(&layout, &feats, &[suffix, &suffix2])?;
    let htv = model.backend.download(&ht)?;
    let e = rel(&htv[d..], &hv);
    rep.check(p, "prefix + 2 forks in one forward vs prefill then extend", e, 3e-2);
    rep.flag(
        p,
        "… bitwise identical",
        htv[d..].iter().zip(&hv).all(|(a, b)| a.to_bits() == b.to_bits()),
        format!("max rel diff {e:.2e}"),
    );
    let more = tok.encode(" Answer again")?;
    let mut tails: Vec<_> = tree.drain(1..).collect();
    let a = model.backend.download(&model.extend(&mut tails, &[&more, &more])?)?;
    let b = model.backend.download(&model.extend(&mut forks, &[&more, &more])?)?;
    let e = rel(&a, &b);
    rep.check(p, "states left by the one forward continue like the forks'", e, 3e-2);
    rep.flag(
        p,
        "… bitwise identical",
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        format!("max rel diff {e:.2e}"),
    );
    // The original, extended alone, equals fork 0 extended in a batch of two: the forks did not
    // write into its caches, and a row does not depend on its batch companions.
    let mut alone = vec![st];
    let ha = model.backend.download(&model.extend(&mut alone, &[suffix])?)?;
    let e = rel(&ha, &hv[..d]);
    let bitwise = ha.iter().zip(&hv[..d]).all(|(a, b)| a.to_bits() == b.to_bits());
    rep.check(p, "original extended alone vs fork 0 extended in a batch of 2", e, 3e-2);
    rep.flag(p, "… bitwise identical (batch invariance)", bitwise, format!("max rel diff {e:.2e}"));
    Ok(())
}
