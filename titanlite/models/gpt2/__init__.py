"""GPT-2 (learned positions, LayerNorm, GELU MLP): its spec. The folder holds its arguments and sizes, its
config.json both ways, the module, its Hugging Face weight names and its tensor-parallel plan."""

from titanlite.models.gpt2 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="gpt2",
    args_type=args.GPT2Args,
    flavors=args.FLAVORS,
    model="titanlite.models.gpt2.model:GPT2",
    tp_plan="titanlite.models.gpt2.parallelize:tp_plan",
    hf_weights="titanlite.models.gpt2.weights",
    tp_split_sizes=args.tp_split_sizes,
    hf=HFConfig("gpt2", hf_config.read, hf_config.write, hf_config.tokenizer, fields=hf_config.FIELDS),
    learned_positions=True,
    description="GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings",
)
