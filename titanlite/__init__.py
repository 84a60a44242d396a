"""titanlite: a lean, TorchTitan-style pretraining codebase.

The package is built in layers, bottom to top; a module imports only from its own layer or below
(tests/unit/test_layers.py checks every import, function-level ones too, and that there is no cycle).
docs/architecture.md explains each layer.
"""

__version__ = "0.1.0"

# (layer, where, what it holds), bottom to top. `where` is a dotted path under titanlite/ in which "*" stands for
# any one name (a model family's folder); a module takes the layer of the longest `where` that contains it, so a
# family's folder spans layers: its spec, arguments and config.json at 0, its module at 2, its plan at 3.
LAYERS = (
    (
        0,
        "base",
        "errors and exit statuses, devices, command-line options, logging set-up, reading a Hugging Face "
        "config.json; no torch needed but in devices and failures",
    ),
    (0, "models", "the ModelSpec, the registry of families, config.json of any family both ways; torch-free"),
    (0, "models.*", "a family's spec, arguments and sizes, its config.json both ways; torch-free"),
    (0, "models.common.moe.args", "a mixture-of-experts block's arguments, shared by the families; torch-free"),
    (0, "models.common.decoder_args", "the shared decoder's arguments and switches; torch-free"),
    (0, "models.common.decoder_config", "the shared decoder's config.json both ways (DecoderConfig); torch-free"),
    (0, "models.common.decoder_spec", "the specs of the families the shared decoder's switches describe; torch-free"),
    (0, "models.common.moe.hf_config", "a mixture-of-experts block's config.json fields both ways; torch-free"),
    (0, "models.common.rope_args", "rotary scalings' arguments (Llama 3.1's, YaRN) and their config.json; torch-free"),
    (
        0,
        "models.common.linear_attention_args",
        "the linear-attention layers' kinds and pattern, Gated DeltaNet's arguments (GatedDeltaNetArgs); torch-free",
    ),
    (0, "models.common.mamba2_args", "the Mamba-2 layers' arguments (Mamba2Args); torch-free"),
    (0, "models.common.qwen_hybrid.args", "the Qwen hybrid (linear + full attention) decoder's arguments; torch-free"),
    (0, "models.common.qwen_hybrid.hf_config", "the Qwen hybrid decoder's config.json both ways; torch-free"),
    (0, "models.common.latent.args", "multi-head latent attention's arguments (LatentArgs); torch-free"),
    (0, "models.common.latent.hf_config", "multi-head latent attention's config.json fields both ways; torch-free"),
    (1, "config", "the run configuration: sections, loading and validation, reference text"),
    (2, "models.common", "blocks every family may use: the model interface, attention, KV cache, weight init"),
    (2, "models.build", "the configured model (a flavor or a folder's shape) built from its family's spec"),
    (2, "models.*.model", "a family's plain module, no parallelism inside"),
    (2, "models.*.weights", "a family's Hugging Face weight names and layouts"),
    (2, "data", "tokenizers, sources, the prepared token store, sample order, the loader"),
    (3, "parallel", "one apply_* per parallelism, parallelize() in its order, the mesh, pipeline schedules"),
    (3, "models.*.parallelize", "a family's tensor-parallel plan for its blocks"),
    (3, "models.common.qwen_hybrid.parallelize", "the Qwen hybrid decoder's tensor-parallel plan"),
    (3, "models.common.latent.parallelize", "multi-head latent attention's tensor-parallel plan"),
    (
        3,
        "components",
        "loss, optimizer, metrics, profiling, resilience, checkpoints, Hugging Face weights and tokenizer files",
    ),
    (4, "engine", "the Trainer (the loop for every layout), the Validator, decoding, the Scorer and lm-eval's model"),
    (5, "builder", "from a config to a run: the layout plan, data, model, Trainer; the memory planner's estimator"),
    (
        6,
        "commands",
        "entry points: the torchrun workers (train, eval), generate, check, convert, the launcher, the CLI",
    ),
    (6, "tools", "plan, bench, analyze, prepare"),
)
