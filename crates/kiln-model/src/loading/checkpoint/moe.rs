//! The mixture-of-experts steps of a load plan: per layer the router, Qwen2-MoE's shared
//! expert and its sigmoid gate, and every routed expert's gate, up and down matrices, in
//! either layout a checkpoint stores them:
//!
//! - MLX (what `mlx_lm.convert` writes): each matrix of every expert stacked in one
//!   tensor, `{block}.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}` with shape
//!   `[experts, out, ...]`, quantized per expert. Each expert is planned as its entry of
//!   the stack, so it loads as a view into the mapped file: the stack is never copied.
//! - Hugging Face: one tensor per expert, `mlp.experts.{i}.{gate,up,down}_proj.weight`
//!   (Mixtral: `block_sparse_moe.experts.{i}.{w1,w3,w2}.weight`).
//!
//! `{block}` is `mlp`, or Mixtral's `block_sparse_moe`. Routed experts run through the
//! quantized kernels only (an expert cache slot holds packed codes), so float experts must
//! be quantized on load; a float stack quantizes one expert at a time, like a dense matrix.

use super::plan::{LinearPlan, MatrixPlan, Planner, Step};
use super::safetensors::TensorRef;
use crate::error::{ModelError, Result};
use crate::loading::config::{Architecture, MoeConfig};

/// Where a layer's experts live, and what its matrices are called.
struct Names {
    /// `{layer}.mlp`, or Mixtral's `{layer}.block_sparse_moe`.
    block: String,
    /// The per-expert names of gate, up and down in the Hugging Face layout.
    hf: [&'static str; 3],
    /// The config field giving the expert count.
    count_field: &'static str,
}

impl Names {
    fn of(p: &Planner<'_>, layer: &str) -> Names {
        if p.config.architecture == Architecture::Mixtral {
            Names {
                block: format!("{layer}.block_sparse_moe"),
                hf: ["w1", "w3", "w2"],
                count_field: "num_local_experts",
            }
        } else {
            Names {
                block: format!("{layer}.mlp"),
                hf: ["gate_proj", "up_proj", "down_proj"],
                count_field: "num_experts",
            }
        }
    }
}

/// The MLX names of gate, up and down inside `switch_mlp`.
const STACKED: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// Plans the MoE MLP of `layer` (`model.layers.N`) onto `steps`: the router, the shared
/// expert and its gate when the config has one, then each routed expert's gate, up, down.
/// Returns the bytes of an expert cache slot for the layer's first expert, as loaded.
pub(crate) fn plan_layer(
    p: &Planner<'_>,
    layer: &str,
    moe: &MoeConfig,
    steps: &mut Vec<Step>,
) -> Result<Option<u64>> {
    let names = Names::of(p, layer);
    let (h, e_count, inter) = (p.config.hidden_size, moe.experts, moe.expert_intermediate_size);
    steps.push(Step::Linear(p.linear(&format!("{}.gate", names.block), e_count, h, false)?));
    if let Some(s) = moe.shared_expert_intermediate_size {
        let shared = format!("{}.shared_expert", names.block);
        steps.push(Step::Linear(p.linear(&format!("{shared}.gate_proj"), s, h, false)?));
        steps.push(Step::Linear(p.linear(&format!("{shared}.up_proj"), s, h, false)?));
        steps.push(Step::Linear(p.linear(&format!("{shared}.down_proj"), h, s, false)?));
        steps.push(Step::Linear(p.linear(&format!("{}.shared_expert_gate", names.block), 1, h, false)?));
    }
    let first_routed = steps.len();
    // gate and up are [inter, hidden], down is [hidden, inter].
    let shapes = [(inter, h), (inter, h), (h, inter)];
    let stack = |i: usize| format!("{}.switch_mlp.{}", names.block, STACKED[i]);
    let per_expert = |e: usize, i: usize| format!("{}.experts.{e}.{}", names.block, names.hf[i]);
    if p.ck.contains(&format!("{}.weight", stack(0))) {
        let stacks: Vec<Stack> = (0..3)
            .map(|i| Stack::find(p, &stack(i), e_count, shapes[i], names.count_field))
            .collect::<Result<_>>()?;
        for e in 0..e_count {
            for s in &stacks {
                steps.push(Step::Linear(s.expert(p, e)?));
            }
        }
    } else if p.ck.contains(&format!("{}.weight", per_expert(0, 0))) {
        let extra = format!("{}.weight", per_expert(e_count, 0));
        if let Some(t) = p.ck.get(&extra) {
            return Err(p.error(
                t,
                format!(
                    "tensor {extra} is expert {e_count}, but config.json's {} is {e_count}: expected \
                     experts 0 to {}",
                    names.count_field,
                    e_count - 1
                ),
            ));
        }
        for e in 0..e_count {
            for (i, &(n, k)) in shapes.iter().enumerate() {
                let plan = p.linear(&per_expert(e, i), n, k, false)?;
                steps.push(Step::Linear(routed(p, plan)?));
            }
        }
    } else {
        return Err(ModelError::Checkpoint {
            path: p.ck.origin().to_path_buf(),
            message: format!(
                "missing the routed experts of {layer}: expected {}.weight (MLX layout, {e_count} experts \
                 stacked) or {}.weight (Hugging Face layout, one tensor per expert); the weights are in {}",
                stack(0),
                per_expert(0, 0),
                p.ck.describe_files()
            ),
        });
    }
    let slot = steps[first_routed..first_routed + 3]
        .iter()
        .map(|s| match s {
            Step::Linear(l) => l.slot_bytes(crate::forward::expert_cache::PART_ALIGN),
            Step::Vector(_) => None,
        })
        .sum::<Option<u64>>();
    Ok(slot)
}

/// One stacked matrix of every expert of a layer: `.weight`, and `.scales` and `.biases`
/// when quantized, each `[experts, ...]`.
struct Stack {
    module: String,
    n: usize,
    k: usize,
    weight: TensorRef,
    scales: Option<TensorRef>,
    biases: Option<TensorRef>,
}

impl Stack {
    fn find(
        p: &Planner<'_>,
        module: &str,
        experts: usize,
        (n, k): (usize, usize),
        count_field: &str,
    ) -> Result<Stack> {
        let weight_name = format!("{module}.weight");
        let weight = p.require(&weight_name, &format!("{experts} stacked [{n}, {k}] expert matrices"))?;
        let scales = p.ck.get(&format!("{module}.scales")).cloned();
        let biases = p.ck.get(&format!("{module}.biases")).cloned();
        for (suffix, t) in
            [("weight", Some(&weight)), ("scales", scales.as_ref()), ("biases", biases.as_ref())]
        {
            let Some(t) = t else { continue };
            if t.shape.len() != 3 || t.shape[0] != experts {
                return Err(p.error(
                    t,
                    format!(
                        "tensor {module}.{suffix} has shape {:?}, expected [{experts}, ...]: \
                         {count_field} = {experts} experts (config.json) stacked along the first \
                         axis, each a [{n}, {k}] matrix",
                        t.shape
                    ),
                ));
            }
        }
        Ok(Stack { module: module.to_string(), n, k, weight, scales, biases })
    }

    /// Expert `e`'s matrix: its entry of each stacked tensor.
    fn expert(&self, p: &Planner<'_>, e: usize) -> Result<LinearPlan> {
        let entry = |t: &Option<TensorRef>| t.as_ref().map(|t| t.entry(e));
        let matrix = p
            .matrix(
                &self.module,
                self.n,
                self.k,
                self.weight.entry(e),
                entry(&self.scales),
                entry(&self.biases),
            )
            .map_err(|err| match err {
                ModelError::Checkpoint { path, message } => ModelError::Checkpoint {
                    path,
                    message: format!(
                        "{message}, for each expert of the stack (shapes below the expert axis)"
                    ),
                },
                other => other,
            })?;
        routed(p, LinearPlan { module: self.module.clone(), n: self.n, k: self.k, matrix, bias: None })
    }
}

/// `plan`, when kiln can run it as a routed expert: quantized as stored, or quantized on
/// load. A float expert kiln would keep in f32 is refused, naming how to quantize it.
fn routed(p: &Planner<'_>, plan: LinearPlan) -> Result<LinearPlan> {
    let MatrixPlan::Dense { weight } = &plan.matrix else { return Ok(plan) };
    let (module, k) = (&plan.module, plan.k);
    let how = match (&p.config.quantization, p.quantize) {
        (Some(_), _) => format!(
            "config.json's quantization leaves {module} unquantized; quantize the experts too \
             (mlx_lm.convert does by default)"
        ),
        (None, None) => "quantize it on load (--quantize 4 or --quantize 8)".to_string(),
        (None, Some(spec)) => format!(
            "its input width {k} is not a multiple of the group size {} kiln quantizes to on load",
            spec.group_size()
        ),
    };
    Err(p.error(
        weight,
        format!(
            "tensor {module}.weight is a float routed expert, and kiln runs routed experts only \
             quantized (an expert cache slot holds packed codes): {how}"
        ),
    ))
}
