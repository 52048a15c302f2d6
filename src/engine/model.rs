//! The Qwen3.5 model: weights placed on a backend, the vision tower, the hybrid decoder, the
//! readout head, and the forkable [`State`] that makes "prefill once, extend many" possible.
//!
//! Everything here is written against [`Backend`]; nothing here knows about HTTP or questions.

use super::adapter::{readout_path, LoraAdapter, ReadoutFile};
use super::config::{LayerKind, ModelConfig, TextRope};
use super::positions::{self, SequenceLayout};
use super::progress::LoadProgress;
use crate::backend::tree::{self, TreeCalls};
use crate::backend::{
    AttentionDims, Backend, DeltaNetDims, DeltaNetInputs, Gelu, LinearPart, PatchGeometry, RgbImage,
};
use crate::image::PatchedImage;
use crate::weights::{TensorRef, WeightStore};
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

/// Per-layer cache of one sequence.
pub enum LayerState<B: Backend> {
    Attention(B::KvCache),
    DeltaNet(B::DeltaState),
}

impl<B: Backend> Clone for LayerState<B> {
    fn clone(&self) -> Self {
        match self {
            LayerState::Attention(c) => LayerState::Attention(c.clone()),
            LayerState::DeltaNet(s) => LayerState::DeltaNet(s.clone()),
        }
    }
}

/// Everything the decoder remembers about a sequence: attention KV, DeltaNet conv + recurrent
/// state per layer, how many tokens it has seen and the next text position. `clone()` forks it.
pub struct State<B: Backend> {
    pub layers: Vec<LayerState<B>>,
    pub tokens: usize,
    pub next_pos: i64,
    /// Left unfinished by a forward that only read it out ([`FinalStates::Continued`]): it
    /// cannot be continued.
    spent: bool,
}

impl<B: Backend> Clone for State<B> {
    fn clone(&self) -> Self {
        State { layers: self.layers.clone(), tokens: self.tokens, next_pos: self.next_pos, spent: self.spent }
    }
}

/// A mark to record in a forward's device queue before one of its layers
/// ([`Qwen35::forward_readout_marked`]).
#[derive(Debug)]
pub struct LayerMark<M> {
    /// Before this layer (a forward of fewer layers records none).
    pub layer: usize,
    /// Set by the forward.
    pub marker: Option<M>,
}

/// Which sequences of a forward have usable states after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalStates {
    /// Every sequence's: the caller continues them (prefill, extend).
    All,
    /// Only those another sequence of the same forward continues. The others are read out and
    /// dropped (question passes), so their final DeltaNet states are never computed or stored
    /// (the state update after their last chunk, the recurrent state and the conv history:
    /// ~2 MB a sequence and layer at Qwen3.5-4B's shapes, and no fresh buffers for them); their
    /// `State`s are marked spent. Their hidden rows are the same bits either way.
    Continued,
}

impl<B: Backend> State<B> {
    /// Whether a [`FinalStates::Continued`] forward left this state unfinished.
    pub fn is_spent(&self) -> bool {
        self.spent
    }

    /// An independent copy that can be extended without touching `self`.
    pub fn fork(&self) -> Self {
        self.clone()
    }

    /// Freezes the attention caches so that forks share them instead of copying them (call on a
    /// prefix state before forking it many times).
    pub fn share(&mut self, backend: &B) -> Result<()> {
        for l in &mut self.layers {
            if let LayerState::Attention(c) = l {
                backend.share_kv(c)?;
            }
        }
        Ok(())
    }
}

/// One sequence of a packed forward: its layout, the merged features of its images (indexed by
/// the image numbers in `layout.images`) and optionally the earlier sequence of the same forward
/// that it continues (its state becomes a fork of that sequence's state after its tokens, and its
/// layout starts at that sequence's `next_pos`): a shared prefix and the passes that extend it
/// run as one forward, with no separate prefill. The parent may continue a sequence itself (two
/// levels at most: a prefix, the tokens a question's rotations share, each rotation's own).
pub struct Segment<'a, B: Backend> {
    pub layout: &'a SequenceLayout,
    pub images: &'a [B::Tensor],
    pub parent: Option<usize>,
}

enum Mixer<B: Backend> {
    Attention {
        qkv: B::Linear,
        o: B::Linear,
        q_norm: B::Tensor,
        k_norm: B::Tensor,
    },
    DeltaNet {
        in_proj: B::Linear,
        conv: B::Tensor,
        a_log: B::Tensor,
        dt_bias: B::Tensor,
        norm: B::Tensor,
        out: B::Linear,
    },
}

struct Layer<B: Backend> {
    input_norm: B::Tensor,
    post_norm: B::Tensor,
    mixer: Mixer<B>,
    gate_up: B::Linear,
    down: B::Linear,
}

struct VisionBlock<B: Backend> {
    norm1: (B::Tensor, B::Tensor),
    norm2: (B::Tensor, B::Tensor),
    qkv: B::Linear,
    proj: B::Linear,
    fc1: B::Linear,
    fc2: B::Linear,
}

struct VisionTower<B: Backend> {
    patch: B::Linear,
    pos: B::Tensor,
    blocks: Vec<VisionBlock<B>>,
    merger_norm: (B::Tensor, B::Tensor),
    merger_fc1: B::Linear,
    merger_fc2: B::Linear,
    act: Gelu,
    /// The rotary tables of the last image set, on the device.
    tables: std::sync::Mutex<Option<VisionTables<B>>>,
}

/// The vision tower's rotary tables for one list of patch grids: they depend on nothing else,
/// and a photo's are large (a 4096² photo's 65,536 patches × 64 × cos and sin in f32 are 33.5 MB,
/// ~11 ms of host work and then an upload before its first block can run), while photos of one
/// size come again. Kept until images of other sizes come.
struct VisionTables<B: Backend> {
    grids: Vec<[usize; 3]>,
    cos: B::Tensor,
    sin: B::Tensor,
}

/// Every row's hidden state at each layer boundary of one forward, row-major `[rows, hidden]`
/// in f32: `hidden[0]` is the decoder's input (token embeddings with the image features in
/// place), `hidden[i]` the residual stream after decoder layer `i − 1` (what transformers'
/// `output_hidden_states` holds at index `i`), and `final_norm` the output of the final norm
/// (the last-token rows of which are what [`Qwen35::forward`] returns). For locating where two
/// implementations part: `forward --dump-layers` writes it.
#[derive(Debug, Clone, Default)]
pub struct LayerDump {
    pub rows: usize,
    pub hidden_size: usize,
    pub hidden: Vec<Vec<f32>>,
    pub final_norm: Vec<f32>,
}

/// What loading took and found, for logs and `/v1/models`.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub seconds: f64,
    pub checkpoint_bytes: u64,
    pub lora_modules: usize,
    pub lora_rank: Option<usize>,
    pub readout_rows: Option<usize>,
    pub fp8_weights: usize,
    /// Bytes of weights the backend holds after placing them (converted, quantised, padded):
    /// what the model costs in host or device memory, not its checkpoint's size.
    pub weight_bytes: u64,
}

/// A loaded Qwen3.5 model (+ optional LoRA and readout) on backend `B`.
pub struct Qwen35<B: Backend> {
    pub backend: B,
    pub config: ModelConfig,
    pub kinds: Vec<LayerKind>,
    pub report: LoadReport,
    rope: TextRope,
    /// The text rotary table rows made so far ([`positions::TextRopeCache`]).
    rope_rows: std::sync::Mutex<positions::TextRopeCache>,
    attn_dims: AttentionDims,
    delta_dims: DeltaNetDims,
    eps: f32,
    embed: B::Tensor,
    layers: Vec<Layer<B>>,
    norm: B::Tensor,
    vision: Option<VisionTower<B>>,
    readout: Option<(B::Tensor, usize)>,
}

struct Loader<'s, 'a> {
    store: &'s WeightStore,
    adapter: Option<&'a LoraAdapter>,
    used_lora: BTreeSet<String>,
    progress: LoadProgress,
    fp8: usize,
    /// Bytes the backend holds for what was placed so far.
    held: u64,
}

impl<'s, 'a> Loader<'s, 'a> {
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<TensorRef<'s>> {
        let t = self.store.get_shaped(name, shape)?;
        self.progress.advance(t.bytes.len() as u64);
        Ok(t)
    }

    fn param<B: Backend>(&mut self, b: &B, name: &str, shape: &[usize]) -> Result<B::Tensor> {
        let t = self.get(name, shape)?;
        let placed = b.param(&t).with_context(|| format!("placing {name}"))?;
        Ok(self.held_tensor(b, placed))
    }

    /// Counts a placed tensor's bytes.
    fn held_tensor<B: Backend>(&mut self, b: &B, t: B::Tensor) -> B::Tensor {
        self.held += b.tensor_bytes(&t) as u64;
        t
    }

    /// Counts a placed projection's bytes.
    fn held_linear<B: Backend>(&mut self, b: &B, w: B::Linear) -> B::Linear {
        self.held += b.linear_bytes(&w) as u64;
        w
    }

    /// A projection made of the given modules (`<module>.weight` `[out, in]`, optional bias),
    /// each with its LoRA pair when the adapter has one.
    fn linear<B: Backend>(
        &mut self,
        b: &B,
        modules: &[(&str, usize)],
        input: usize,
        bias: bool,
    ) -> Result<B::Linear> {
        let mut tensors = Vec::new();
        for &(m, out) in modules {
            let w = self.get(&format!("{m}.weight"), &[out, input])?;
            if w.scale_inv.is_some() {
                self.fp8 += 1;
            }
            let bias_t = if bias { Some(self.get(&format!("{m}.bias"), &[out])?) } else { None };
            let lora = match self.adapter {
                Some(a) => {
                    let p = a.pair(m)?;
                    if p.is_some() {
                        self.used_lora.insert(m.to_string());
                    }
                    p
                }
                None => None,
            };
            tensors.push(LinearPart { weight: w, bias: bias_t, lora });
        }
        let names: Vec<&str> = modules.iter().map(|m| m.0).collect();
        let placed = b.linear(&tensors).with_context(|| format!("placing {}", names.join(" + ")))?;
        Ok(self.held_linear(b, placed))
    }
}

impl<B: Backend> Qwen35<B> {
    /// Loads a Hugging Face model directory, an optional adapter folder (LoRA + readout).
    pub fn load(backend: B, model_dir: &Path, adapter_dir: Option<&Path>) -> Result<Self> {
        let started = Instant::now();
        let config = ModelConfig::from_file(&model_dir.join("config.json"))?;
        let mut store = WeightStore::open_model_dir(model_dir)?;
        store.set_fp8_block(config.quantization_config.as_ref().and_then(|q| {
            match q.weight_block_size.as_deref() {
                Some([a, b]) => Some([*a, *b]),
                _ => None,
            }
        }));
        let adapter = adapter_dir.map(LoraAdapter::open).transpose()?;
        let readout_file = match adapter_dir {
            Some(d) if readout_path(d).exists() => {
                Some(ReadoutFile::open(&readout_path(d), config.text_config.hidden_size)?)
            }
            Some(d) => {
                tracing::warn!(
                    "{} has no decision_readout.safetensors; readout logits are unavailable",
                    d.display()
                );
                None
            }
            None => None,
        };
        let t = config.text_config.clone();
        let kinds = t.layer_kinds()?;
        let rope = t.rope()?;
        let eps = t.rms_norm_eps as f32;
        let prefix = if store.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else if store.contains("model.embed_tokens.weight") {
            "model."
        } else {
            bail!(
                "{}: no model.language_model.embed_tokens.weight — not a Qwen3.5 checkpoint?",
                model_dir.display()
            );
        };
        let mut ld = Loader {
            store: &store,
            adapter: adapter.as_ref(),
            used_lora: BTreeSet::new(),
            progress: LoadProgress::new("loading weights", store.total_bytes()),
            fp8: 0,
            held: 0,
        };
        let b = &backend;
        let (h, inter) = (t.hidden_size, t.intermediate_size);
        let embed = ld.param(b, &format!("{prefix}embed_tokens.weight"), &[t.vocab_size, h])?;
        let attn_dims = t.attention_dims()?;
        let delta_dims = t.deltanet_dims();
        let mut layers = Vec::with_capacity(kinds.len());
        for (i, kind) in kinds.iter().enumerate() {
            let p = format!("{prefix}layers.{i}.");
            let mixer = match kind {
                LayerKind::FullAttention => {
                    let (nh, kvh, hd) = (t.num_attention_heads, t.num_key_value_heads, t.head_dim);
                    let q = format!("{p}self_attn.q_proj");
                    let k = format!("{p}self_attn.k_proj");
                    let v = format!("{p}self_attn.v_proj");
                    let qkv = ld.linear(
                        b,
                        &[(&q, nh * hd * 2), (&k, kvh * hd), (&v, kvh * hd)],
                        h,
                        t.attention_bias,
                    )?;
                    let o =
                        ld.linear(b, &[(&format!("{p}self_attn.o_proj"), h)], nh * hd, t.attention_bias)?;
                    Mixer::Attention {
                        qkv,
                        o,
                        q_norm: ld.param(b, &format!("{p}self_attn.q_norm.weight"), &[hd])?,
                        k_norm: ld.param(b, &format!("{p}self_attn.k_norm.weight"), &[hd])?,
                    }
                }
                LayerKind::LinearAttention => {
                    let d = &delta_dims;
                    let (kd, vd) = (t.key_dim(), t.value_dim());
                    let c = t.conv_dim();
                    let la = format!("{p}linear_attn.");
                    let in_proj = ld.linear(
                        b,
                        &[
                            (&format!("{la}in_proj_qkv"), c),
                            (&format!("{la}in_proj_z"), vd),
                            (&format!("{la}in_proj_b"), d.value_heads),
                            (&format!("{la}in_proj_a"), d.value_heads),
                        ],
                        h,
                        false,
                    )?;
                    let _ = kd;
                    let conv_t = ld.get(&format!("{la}conv1d.weight"), &[c, 1, d.conv_kernel])?;
                    let conv_shape = [c, d.conv_kernel];
                    let conv = b.param(&TensorRef { shape: &conv_shape, ..conv_t })?;
                    let conv = ld.held_tensor(b, conv);
                    Mixer::DeltaNet {
                        in_proj,
                        conv,
                        a_log: ld.param(b, &format!("{la}A_log"), &[d.value_heads])?,
                        dt_bias: ld.param(b, &format!("{la}dt_bias"), &[d.value_heads])?,
                        norm: ld.param(b, &format!("{la}norm.weight"), &[d.value_dim])?,
                        out: ld.linear(b, &[(&format!("{la}out_proj"), h)], vd, false)?,
                    }
                }
            };
            let gate_up = ld.linear(
                b,
                &[(&format!("{p}mlp.gate_proj"), inter), (&format!("{p}mlp.up_proj"), inter)],
                h,
                false,
            )?;
            let down = ld.linear(b, &[(&format!("{p}mlp.down_proj"), h)], inter, false)?;
            layers.push(Layer {
                input_norm: ld.param(b, &format!("{p}input_layernorm.weight"), &[h])?,
                post_norm: ld.param(b, &format!("{p}post_attention_layernorm.weight"), &[h])?,
                mixer,
                gate_up,
                down,
            });
        }
        let norm = ld.param(b, &format!("{prefix}norm.weight"), &[h])?;
        let vision = if store.contains("model.visual.patch_embed.proj.weight") {
            Some(Self::load_vision(&mut ld, b, &config)?)
        } else {
            None
        };
        if let Some(a) = &adapter {
            let unused: Vec<&String> = a.modules().difference(&ld.used_lora).collect();
            if !unused.is_empty() {
                bail!(
                    "adapter {} has LoRA weights for {} module(s) this model does not have or does not adapt, e.g. {}",
                    a.dir.display(),
                    unused.len(),
                    unused[0]
                );
            }
        }
        let readout = match &readout_file {
            Some(f) => Some((ld.held_tensor(b, b.param_f32(&f.tensor()?)?), f.rows())),
            None => None,
        };
        ld.progress.finish();
        let report = LoadReport {
            seconds: started.elapsed().as_secs_f64(),
            checkpoint_bytes: store.total_bytes(),
            lora_modules: ld.used_lora.len(),
            lora_rank: adapter.as_ref().map(|a| a.config.r),
            readout_rows: readout.as_ref().map(|r| r.1),
            fp8_weights: ld.fp8,
            weight_bytes: ld.held,
        };
        Ok(Qwen35 {
            backend,
            config,
            kinds,
            report,
            rope_rows: std::sync::Mutex::new(positions::TextRopeCache::new(
                rope.theta,
                rope.rotary_dim,
                rope.mrope_section,
            )),
            rope,
            attn_dims,
            delta_dims,
            eps,
            embed,
            layers,
            norm,
            vision,
            readout,
        })
    }

    fn load_vision(ld: &mut Loader, b: &B, config: &ModelConfig) -> Result<VisionTower<B>> {
        let v = &config.vision_config;
        let d = v.hidden_size;
        let pd = v.patch_dim();
        // Conv3d with kernel == stride over one flattened patch row is a linear map.
        let pw = ld.get(
            "model.visual.patch_embed.proj.weight",
            &[d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        )?;
        let flat = [d, pd];
        let pb = ld.get("model.visual.patch_embed.proj.bias", &[d])?;
        let patch =
            b.linear(&[LinearPart { weight: TensorRef { shape: &flat, ..pw }, bias: Some(pb), lora: None }])?;
        let patch = ld.held_linear(b, patch);
        let pos = ld.param(b, "model.visual.pos_embed.weight", &[v.num_position_embeddings, d])?;
        let mut blocks = Vec::with_capacity(v.depth);
        for i in 0..v.depth {
            let p = format!("model.visual.blocks.{i}.");
            let mut ln = |n: &str| -> Result<(B::Tensor, B::Tensor)> {
                Ok((
                    ld.param(b, &format!("{p}{n}.weight"), &[d])?,
                    ld.param(b, &format!("{p}{n}.bias"), &[d])?,
                ))
            };
            let norm1 = ln("norm1")?;
            let norm2 = ln("norm2")?;
            blocks.push(VisionBlock {
                norm1,
                norm2,
                qkv: ld.linear(b, &[(&format!("{p}attn.qkv"), 3 * d)], d, true)?,
                proj: ld.linear(b, &[(&format!("{p}attn.proj"), d)], d, true)?,
                fc1: ld.linear(b, &[(&format!("{p}mlp.linear_fc1"), v.intermediate_size)], d, true)?,
                fc2: ld.linear(b, &[(&format!("{p}mlp.linear_fc2"), d)], v.intermediate_size, true)?,
            });
        }
        let m = v.spatial_merge_size * v.spatial_merge_size * d;
        let merger_norm = (
            ld.param(b, "model.visual.merger.norm.weight", &[d])?,
            ld.param(b, "model.visual.merger.norm.bias", &[d])?,
        );
        let merger_fc1 = ld.linear(b, &[("model.visual.merger.linear_fc1", m)], m, true)?;
        let merger_fc2 = ld.linear(b, &[("model.visual.merger.linear_fc2", v.out_hidden_size)], m, true)?;
        let act = match v.hidden_act.as_str() {
            "gelu" => Gelu::Erf,
            "gelu_pytorch_tanh" | "gelu_new" => Gelu::Tanh,
            other => bail!("vision hidden_act {other:?} is not supported"),
        };
        Ok(VisionTower {
            patch,
            pos,
            blocks,
            merger_norm,
            merger_fc1,
            merger_fc2,
            act,
            tables: std::sync::Mutex::new(None),
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.config.text_config.hidden_size
    }

    pub fn has_vision(&self) -> bool {
        self.vision.is_some()
    }

    pub fn readout_rows(&self) -> Option<usize> {
        self.readout.as_ref().map(|r| r.1)
    }

    /// A fresh, empty state (no tokens seen).
    pub fn new_state(&self) -> Result<State<B>> {
        let layers = self
            .kinds
            .iter()
            .map(|k| {
                Ok(match k {
                    LayerKind::FullAttention => {
                        LayerState::Attention(self.backend.new_kv_cache(&self.attn_dims)?)
                    }
                    LayerKind::LinearAttention => {
                        LayerState::DeltaNet(self.backend.new_delta_state(&self.delta_dims)?)
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(State { layers, tokens: 0, next_pos: 0, spent: false })
    }

    /// Lays out `ids` (one `<|image_pad|>` per image) after a state that has seen `start` positions.
    pub fn layout(&self, ids: &[u32], images: &[&PatchedImage], start: i64) -> Result<SequenceLayout> {
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        positions::layout(
            ids,
            self.config.image_token_id,
            &grids,
            self.config.vision_config.spatial_merge_size,
            start,
        )
    }

    /// Runs the vision tower once over all images; returns each image's merged features
    /// `[tokens_i, text hidden]`.
    pub fn encode_images(&self, images: &[&PatchedImage]) -> Result<Vec<B::Tensor>> {
        Ok(self.encode_images_until(images, &|| false)?.unwrap_or_default())
    }

    /// [`Qwen35::encode_images`], asking `stop` before every vision block: `Ok(None)` when it
    /// said stop (a request past its deadline or whose caller left must not hold the engine for
    /// the rest of its vision tower).
    pub fn encode_images_until(
        &self,
        images: &[&PatchedImage],
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<B::Tensor>>> {
        if images.is_empty() {
            return Ok(Some(vec![]));
        }
        let vt = self
            .vision
            .as_ref()
            .ok_or_else(|| anyhow!("this checkpoint has no vision tower (model.visual.*); send text only"))?;
        let vc = &self.config.vision_config;
        let b = &self.backend;
        let pd = vc.patch_dim();
        let merge = vc.spatial_merge_size;
        let mut rgb = Vec::new();
        let mut idx = Vec::new();
        let mut wts = Vec::new();
        let mut segments = Vec::new();
        let mut per_image = Vec::new();
        let mut row = 0;
        let geometry = PatchGeometry { patch: vc.patch_size, temporal: vc.temporal_patch_size, merge };
        ensure!(
            geometry.row_len() == pd,
            "the vision tower takes {pd} values per patch, RGB patches have {}",
            geometry.row_len()
        );
        for img in images {
            let [gt, gh, gw] = img.grid_thw;
            let n = gt * gh * gw;
            ensure!(
                gt == 1
                    && img.patch_dim == pd
                    && (img.patch_size, img.temporal_patch_size, img.merge_size)
                        == (vc.patch_size, vc.temporal_patch_size, merge)
                    && img.resized_hw == (gh * vc.patch_size, gw * vc.patch_size),
                "image of grid {:?} was cut for another vision tower (patch {}, temporal {}, merge {})",
                img.grid_thw,
                img.patch_size,
                img.temporal_patch_size,
                img.merge_size
            );
            ensure!(
                gh % merge == 0 && gw % merge == 0,
                "image grid {:?} is not divisible by the merge size",
                img.grid_thw
            );
            rgb.push(RgbImage {
                rgb: &img.rgb,
                width: img.resized_hw.1,
                height: img.resized_hw.0,
                lut: &img.lut,
            });
            let (i, w) = positions::pos_embed_taps(img.grid_thw, merge, vc.pos_grid_side());
            idx.extend(i);
            wts.extend(w);
            for f in 0..gt {
                segments.push(row + f * gh * gw..row + (f + 1) * gh * gw);
            }
            per_image.push(row / (merge * merge)..(row + n) / (merge * merge));
            row += n;
        }
        let x = b.image_patches(&rgb, geometry)?;
        let mut x = b.matmul(&x, &vt.patch)?;
        let pos = b.embed_bag(&vt.pos, &idx, &wts, 4)?;
        b.add_assign(&mut x, &pos)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|img| img.grid_thw).collect();
        let mut tables = vt.tables.lock().unwrap_or_else(|e| e.into_inner());
        if tables.as_ref().is_none_or(|t| t.grids != grids) {
            *tables = None; // the old tables' memory goes before the new tables take theirs
            let coords: Vec<(usize, usize)> =
                grids.iter().flat_map(|&g| positions::patch_coords(g, merge)).collect();
            let (cos, sin) = positions::vision_rope_tables(&coords, vc.head_dim(), vc.rope_theta());
            let (cos, sin) = (b.upload(&cos, &[row, vc.head_dim()])?, b.upload(&sin, &[row, vc.head_dim()])?);
            *tables = Some(VisionTables { grids, cos, sin });
        }
        let VisionTables { cos, sin, .. } = tables.as_ref().expect("set above");
        // Each residual add is fused with the LayerNorm that follows it: the block's second norm,
        // and the next block's first (after the last block, the merger's), so `h` enters every
        // block already normalised. The same ops in the same order as add, then norm.
        let norm1 = |i: usize| match vt.blocks.get(i) {
            Some(blk) => (&blk.norm1.0, &blk.norm1.1),
            None => (&vt.merger_norm.0, &vt.merger_norm.1),
        };
        let mut h = b.layer_norm(&x, norm1(0).0, norm1(0).1, 1e-6)?;
        for (i, blk) in vt.blocks.iter().enumerate() {
            // The device has run all but the last block queued: `stop` is asked about work that
            // is about to run, not seconds ahead of it.
            b.pace()?;
            if stop() {
                return Ok(None);
            }
            let qkv = b.matmul(&h, &blk.qkv)?;
            let a = b.vision_attention(&qkv, cos, sin, vc.num_heads, &segments)?;
            let a = b.matmul(&a, &blk.proj)?;
            let h2 = b.add_layer_norm(&mut x, &a, &blk.norm2.0, &blk.norm2.1, 1e-6)?;
            let mut f = b.matmul(&h2, &blk.fc1)?;
            let f = b.gelu_matmul(&mut f, vt.act, &blk.fc2)?;
            let (w, bias) = norm1(i + 1);
            h = b.add_layer_norm(&mut x, &f, w, bias, 1e-6)?;
        }
        let h = b.reshape(h, &[row / (merge * merge), merge * merge * vc.hidden_size])?;
        let mut h = b.matmul(&h, &vt.merger_fc1)?;
        let merged = b.gelu_matmul(&mut h, Gelu::Erf, &vt.merger_fc2)?;
        per_image
            .into_iter()
            .map(|r| b.gather_rows(&merged, &r.collect::<Vec<_>>()))
            .collect::<Result<_>>()
            .map(Some)
    }

    /// Multiply-accumulates of the vision tower for `grids` (`[t, h, w]` patches each): per block,
    /// the projections and MLP per patch, and attention over each frame's patches (quadratic).
    pub fn vision_macs(&self, grids: &[[usize; 3]]) -> f64 {
        let vc = &self.config.vision_config;
        let (d, inter) = (vc.hidden_size as f64, vc.intermediate_size as f64);
        let per_block: f64 = grids
            .iter()
            .map(|&[t, h, w]| {
                let n = (h * w) as f64;
                t as f64 * (n * (4.0 * d * d + 2.0 * d * inter) + 2.0 * n * n * d)
            })
            .sum();
        per_block * vc.depth as f64
    }

    /// Multiply-accumulates of the decoder for `tokens` tokens (projections and MLPs; attention
    /// over the context is left out: it is small next to them at the lengths allowed).
    pub fn decoder_macs(&self, tokens: usize) -> f64 {
        let t = &self.config.text_config;
        let (d, inter) = (t.hidden_size as f64, t.intermediate_size as f64);
        tokens as f64 * t.num_hidden_layers as f64 * (4.0 * d * d + 3.0 * d * inter)
    }

    /// Runs the decoder over a packed batch of sequences, each continuing its own state, and
    /// returns the final-normed hidden state of each sequence's last token (`[segments, hidden]`).
    pub fn forward(&self, segs: &[Segment<B>], states: &mut [&mut State<B>]) -> Result<B::Tensor> {
        self.forward_dumped(segs, states, None)
    }

    /// [`Qwen35::forward`] for sequences that are only read out: the states of the sequences that
    /// no other sequence of the forward continues are left unfinished ([`FinalStates::Continued`]).
    pub fn forward_readout(&self, segs: &[Segment<B>], states: &mut [&mut State<B>]) -> Result<B::Tensor> {
        Ok(self
            .forward_inner(segs, states, None, None, FinalStates::Continued, None)?
            .expect("a forward without a stop check runs to its end"))
    }

    /// [`Qwen35::forward_readout`] that also marks the device's queue before layer `mark.layer`
    /// ([`Backend::marker`]): waiting on the mark returns while the device still runs the layers
    /// after it. With `stop`, paced and asked before every layer as [`Qwen35::forward_until`]
    /// (`Ok(None)`: it said stop).
    pub fn forward_readout_marked(
        &self,
        segs: &[Segment<B>],
        states: &mut [&mut State<B>],
        stop: Option<&dyn Fn() -> bool>,
        mark: &mut LayerMark<B::Marker>,
    ) -> Result<Option<B::Tensor>> {
        self.forward_inner(segs, states, None, stop, FinalStates::Continued, Some(mark))
    }

    /// [`Qwen35::forward`], and with `dump` also every row's hidden state at each layer boundary
    /// (see [`LayerDump`]). A dump runs the last layer on every row (the serving forward runs
    /// its MLP only on the rows it reads out), so it costs a little more; the returned rows are
    /// the same.
    pub fn forward_dumped(
        &self,
        segs: &[Segment<B>],
        states: &mut [&mut State<B>],
        dump: Option<&mut LayerDump>,
    ) -> Result<B::Tensor> {
        Ok(self
            .forward_inner(segs, states, dump, None, FinalStates::All, None)?
            .expect("a forward without a stop check runs to its end"))
    }

    /// [`Qwen35::forward`] paced against the device layer by layer ([`Backend::pace`]), asking
    /// `stop` before every layer: `Ok(None)` when it said stop (the states are then half-written
    /// and must be dropped). For long prefixes that run alone: a request past its deadline or
    /// whose caller left must not hold the engine for the rest of a multi-second forward. Not for
    /// short packed forwards, whose layers run about as long as the host takes to queue them.
    pub fn forward_until(
        &self,
        segs: &[Segment<B>],
        states: &mut [&mut State<B>],
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<B::Tensor>> {
        self.forward_inner(segs, states, None, Some(stop), FinalStates::All, None)
    }

    fn forward_inner(
        &self,
        segs: &[Segment<B>],
        states: &mut [&mut State<B>],
        mut dump: Option<&mut LayerDump>,
        stop: Option<&dyn Fn() -> bool>,
        finals: FinalStates,
        mut mark: Option<&mut LayerMark<B::Marker>>,
    ) -> Result<Option<B::Tensor>> {
        ensure!(segs.len() == states.len() && !segs.is_empty(), "forward needs one state per sequence");
        for (j, (s, st)) in segs.iter().zip(states.iter()).enumerate() {
            // A child's state is replaced by a fork of its parent's; a root continues its own.
            ensure!(
                s.parent.is_some() || !st.spent,
                "sequence {j}'s state was left unfinished by a read-out-only forward and cannot be continued"
            );
        }
        let b = &self.backend;
        let mut ids = Vec::new();
        let mut pos: [Vec<i64>; 3] = [vec![], vec![], vec![]];
        let mut ranges = Vec::with_capacity(segs.len());
        for s in segs {
            ensure!(!s.layout.ids.is_empty(), "every sequence needs at least one token");
            let start = ids.len();
            ids.extend_from_slice(&s.layout.ids);
            for (p, src) in pos.iter_mut().zip(&s.layout.positions) {
                p.extend_from_slice(src);
            }
            ranges.push(start..ids.len());
        }
        let n = ids.len();
        let parents: Vec<Option<usize>> = segs.iter().map(|s| s.parent).collect();
        let parents: &[Option<usize>] = if parents.iter().all(Option::is_none) { &[] } else { &parents };
        // The mixers run the tree as one call, or two when it is two levels deep (tree::TreeCalls).
        let tree = TreeCalls::new(parents, &ranges)?;
        // Per sequence, whether its final DeltaNet states are computed (empty: all).
        let keep: Vec<bool> = match finals {
            FinalStates::All => Vec::new(),
            FinalStates::Continued => vec![false; segs.len()],
        };
        for (j, s) in segs.iter().enumerate() {
            if let Some(p) = s.parent {
                ensure!(
                    s.layout.positions[0].first() == Some(&segs[p].layout.next_pos),
                    "sequence {j} does not start where its parent {p} ends"
                );
            }
        }
        let mut prof = super::profile::StageTimer::start(b);
        let mut x = b.embed(&self.embed, &ids)?;
        for (s, range) in segs.iter().zip(&ranges) {
            for (img, rows) in &s.layout.images {
                let feats =
                    s.images.get(*img).ok_or_else(|| anyhow!("features for image {img} are missing"))?;
                let fr = b.shape(feats)[0];
                ensure!(
                    fr == rows.len(),
                    "image {img} has {fr} feature rows for {} placeholder tokens",
                    rows.len()
                );
                let rows: Vec<usize> = rows.clone().map(|r| r + range.start).collect();
                b.scatter_rows(&mut x, &rows, feats)?;
            }
        }
        // Rotary tables per mixer call, of that call's rows (built on the host and uploaded: a
        // gather on the device could round them); text positions' rows come from the rows kept
        // from earlier forwards.
        let mut rope_rows = self.rope_rows.lock().unwrap_or_else(|e| e.into_inner());
        let rope = tree
            .calls
            .iter()
            .map(|call| {
                let pos_call: [Vec<i64>; 3];
                let pos = if tree.is_single() {
                    &pos
                } else {
                    pos_call = std::array::from_fn(|a| call.rows.iter().map(|&r| pos[a][r]).collect());
                    &pos_call
                };
                let rows = pos[0].len();
                let (cos, sin) = rope_rows.tables(pos);
                Ok((
                    b.upload(&cos, &[rows, self.rope.rotary_dim])?,
                    b.upload(&sin, &[rows, self.rope.rotary_dim])?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        drop(rope_rows);
        let last_rows: Vec<usize> = ranges.iter().map(|r| r.end - 1).collect();
        prof.mark(b, "embed");
        // Each later layer's input norm (and the final norm) is fused with the residual add of
        // the MLP before it, at the end of the loop body.
        if let Some(d) = dump.as_deref_mut() {
            d.hidden.push(b.download(&x)?);
            d.rows = n;
            d.hidden_size = self.hidden_size();
        }
        let mut h =
            b.rms_norm(&x, self.layers.first().map_or(&self.norm, |l| &l.input_norm), self.eps, 1.0)?;
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(m) = mark.as_deref_mut().filter(|m| m.layer == li) {
                m.marker = Some(b.marker()?);
            }
            if let Some(stop) = stop {
                b.pace()?;
                if stop() {
                    return Ok(None);
                }
            }
            prof.mark(b, "norms+residual");
            // A dump needs every row of the last layer too.
            let last_layer = li + 1 == self.layers.len() && dump.is_none();
            let o = match &layer.mixer {
                Mixer::Attention { qkv, o, q_norm, k_norm } => {
                    let p = b.matmul(&h, qkv)?;
                    let mut caches = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Attention(c) => Ok(c),
                            _ => Err(anyhow!("state layer {li} is not an attention cache")),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    prof.mark(b, "attn.proj_in");
                    // The last layer attends only the rows that are read out (every row's keys
                    // and values still enter the caches, which forks continue).
                    let core = tree::gated_attention(
                        b,
                        &tree,
                        &p,
                        q_norm,
                        k_norm,
                        &rope,
                        &self.attn_dims,
                        &mut caches,
                        last_layer,
                    )?;
                    prof.mark(b, "attn.core");
                    let y = b.matmul(&core, o)?;
                    prof.mark(b, "attn.proj_out");
                    y
                }
                Mixer::DeltaNet { in_proj, conv, a_log, dt_bias, norm, out } => {
                    let d = &self.delta_dims;
                    let p = b.matmul(&h, in_proj)?;
                    let mut sts = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::DeltaNet(c) => Ok(c),
                            _ => Err(anyhow!("state layer {li} is not a DeltaNet state")),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let inputs =
                        DeltaNetInputs { proj: &p, conv_weight: conv, a_log, dt_bias, norm_weight: norm };
                    prof.mark(b, "gdn.proj_in");
                    let core = tree::gated_delta_net(b, &tree, &inputs, d, &mut sts, &keep)?;
                    prof.mark(b, "gdn.core");
                    let y = b.matmul(&core, out)?;
                    prof.mark(b, "gdn.proj_out");
                    y
                }
            };
            let hm = if last_layer {
                // Only the last token of each sequence is read out: the last MLP runs on those rows
                // (gathered before the residual add when the mixer returned only them, else after).
                if matches!(layer.mixer, Mixer::Attention { .. }) {
                    x = b.gather_rows(&x, &last_rows)?;
                    b.add_assign(&mut x, &o)?;
                } else {
                    b.add_assign(&mut x, &o)?;
                    x = b.gather_rows(&x, &last_rows)?;
                }
                b.rms_norm(&x, &layer.post_norm, self.eps, 1.0)?
            } else {
                b.add_rms_norm(&mut x, &o, &layer.post_norm, self.eps, 1.0)?
            };
            let o = b.swiglu_mlp(&hm, &layer.gate_up, &layer.down)?;
            // The residual add, fused with the next layer's input norm (the final norm after the last).
            let next_norm = self.layers.get(li + 1).map_or(&self.norm, |l| &l.input_norm);
            h = b.add_rms_norm(&mut x, &o, next_norm, self.eps, 1.0)?;
            if let Some(d) = dump.as_deref_mut() {
                d.hidden.push(b.download(&x)?);
            }
            prof.mark(b, "mlp");
        }
        let out = match dump {
            Some(d) => {
                d.final_norm = b.download(&h)?;
                b.gather_rows(&h, &last_rows)?
            }
            None => h,
        };
        prof.mark(b, "final");
        prof.report(&format!("forward of {} sequence(s)", segs.len()), n);
        super::profile::kernel_report(b, &format!("forward of {} sequence(s) ({n} tokens)", segs.len()));
        for (j, s) in segs.iter().enumerate() {
            let before = s.parent.map_or(states[j].tokens, |p| states[p].tokens);
            states[j].tokens = before + s.layout.ids.len();
            states[j].next_pos = s.layout.next_pos;
            states[j].spent = finals == FinalStates::Continued && !tree.continued[j];
        }
        Ok(Some(out))
    }

    /// `prefill(tokens, images) → (State, hidden of the last token)`.
    pub fn prefill(
        &self,
        ids: &[u32],
        images: &[&PatchedImage],
    ) -> Result<(State<B>, B::Tensor, SequenceLayout)> {
        let feats = self.encode_images(images)?;
        let layout = self.layout(ids, images, 0)?;
        let mut st = self.new_state()?;
        let h = self.forward(&[Segment { layout: &layout, images: &feats, parent: None }], &mut [&mut st])?;
        Ok((st, h, layout))
    }

    /// `prefill` that also records every row's hidden state at each layer boundary.
    pub fn prefill_dumped(
        &self,
        ids: &[u32],
        images: &[&PatchedImage],
    ) -> Result<(B::Tensor, SequenceLayout, LayerDump)> {
        let feats = self.encode_images(images)?;
        let layout = self.layout(ids, images, 0)?;
        let mut st = self.new_state()?;
        let mut dump = LayerDump::default();
        let h = self.forward_dumped(
            &[Segment { layout: &layout, images: &feats, parent: None }],
            &mut [&mut st],
            Some(&mut dump),
        )?;
        Ok((h, layout, dump))
    }

    /// Extends each state with its text suffix (a batch, one suffix per state) and returns the
    /// hidden state at each suffix's last token (`[states, hidden]`). Extending a fork of a prefix
    /// state equals one forward of prefix + suffix.
    pub fn extend(&self, states: &mut [State<B>], suffixes: &[&[u32]]) -> Result<B::Tensor> {
        self.extend_with(states, suffixes, FinalStates::All)
    }

    /// [`Qwen35::extend`] for suffixes that are only read out: every state is left unfinished
    /// (spent), its final DeltaNet states never computed ([`FinalStates::Continued`]).
    pub fn extend_readout(&self, states: &mut [State<B>], suffixes: &[&[u32]]) -> Result<B::Tensor> {
        self.extend_with(states, suffixes, FinalStates::Continued)
    }

    fn extend_with(
        &self,
        states: &mut [State<B>],
        suffixes: &[&[u32]],
        finals: FinalStates,
    ) -> Result<B::Tensor> {
        ensure!(states.len() == suffixes.len(), "extend needs one suffix per state");
        let layouts = states
            .iter()
            .zip(suffixes)
            .map(|(s, ids)| self.layout(ids, &[], s.next_pos))
            .collect::<Result<Vec<_>>>()?;
        let segs: Vec<Segment<B>> =
            layouts.iter().map(|l| Segment { layout: l, images: &[], parent: None }).collect();
        let mut refs: Vec<&mut State<B>> = states.iter_mut().collect();
        Ok(self
            .forward_inner(&segs, &mut refs, None, None, finals, None)?
            .expect("a forward without a stop check runs to its end"))
    }

    /// `prefill` of a laid-out prefix (images already encoded) and `extend` of one fork of it per
    /// suffix, as ONE packed forward. Returns the states (the prefix's first, then one per suffix)
    /// and the hidden state at each sequence's last token, `[1 + suffixes, hidden]` (row 0 is the
    /// prefix's). Equals `forward` of the prefix, `share`, forks, then `extend`.
    pub fn prefill_extend(
        &self,
        layout: &SequenceLayout,
        feats: &[B::Tensor],
        suffixes: &[&[u32]],
    ) -> Result<(Vec<State<B>>, B::Tensor)> {
        let layouts =
            suffixes.iter().map(|ids| self.layout(ids, &[], layout.next_pos)).collect::<Result<Vec<_>>>()?;
        let mut segs = vec![Segment { layout, images: feats, parent: None }];
        segs.extend(layouts.iter().map(|l| Segment { layout: l, images: &[], parent: Some(0) }));
        // The suffixes' states are replaced by forks of the prefix's inside the forward; until
        // then they are forks of the empty state (nothing allocated per suffix).
        let root = self.new_state()?;
        let forks: Vec<State<B>> = suffixes.iter().map(|_| root.fork()).collect();
        let mut states: Vec<State<B>> = std::iter::once(root).chain(forks).collect();
        let mut refs: Vec<&mut State<B>> = states.iter_mut().collect();
        let hidden = self.forward(&segs, &mut refs)?;
        Ok((states, hidden))
    }

    /// Readout logits `[rows]` per hidden row, in f32.
    pub fn readout(&self, hidden: &B::Tensor) -> Result<Vec<Vec<f32>>> {
        let pending = self.readout_start(hidden)?;
        self.readout_finish(pending)
    }

    /// [`Qwen35::readout`] queued ([`Backend::readout_start`]): collected by
    /// [`Qwen35::readout_finish`], the host free to queue other work in between.
    pub fn readout_start(&self, hidden: &B::Tensor) -> Result<B::Readout> {
        let (w, _) = self.readout_head()?;
        self.backend.readout_start(hidden, w)
    }

    /// The logits of a [`Qwen35::readout_start`], `[rows]` per hidden row.
    pub fn readout_finish(&self, pending: B::Readout) -> Result<Vec<Vec<f32>>> {
        let (_, rows) = self.readout_head()?;
        let flat = self.backend.readout_finish(pending)?;
        Ok(flat.chunks(rows).map(|c| c.to_vec()).collect())
    }

    fn readout_head(&self) -> Result<(&B::Tensor, usize)> {
        let (w, rows) = self.readout.as_ref().ok_or_else(|| {
            anyhow!("no readout head is loaded (adapter folder without decision_readout.safetensors)")
        })?;
        Ok((w, *rows))
    }
}
