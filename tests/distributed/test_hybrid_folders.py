"""A published-style Qwen3.5 folder (the multimodal Qwen3_5ForConditionalGeneration: text model, vision tower,
multi-token-prediction tensors) through the commands a user runs: `./run_train.sh --model.flavor hf` trains its text
model and says what it leaves out; `titanlite convert to-hf` writes the trained text weights back into the folder's
layout with the vision tower and mtp tensors unchanged, and transformers loads the export as the multimodal model
with the trained model's logits."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from tests.helpers import REPO, TINY, env, train_in_pool  # noqa: E402
from tests.unit.test_qwen3_5 import TEXT, VISION  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.mark.slow  # a training run and a conversion (about 12 s): tests/unit/test_qwen3_5.py exports the layout fast
def test_a_multimodal_folder_trains_and_converts_back_into_its_layout(tmp_path):
    from safetensors.torch import load_file, save_file

    from titanlite.components.checkpoint import load_model_only
    from titanlite.models.build import model_from_args
    from titanlite.models.hf_config import folder_args

    torch.manual_seed(0)
    text = {k: v for k, v in TEXT.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    text["vocab_size"] = 320  # the byte tokenizer's 257 ids fit
    config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION)
    hf = transformers.Qwen3_5ForConditionalGeneration(config)
    folder = tmp_path / "qwen3_5"
    hf.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    run = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), *TINY, "--model.tokenizer", "byte"]
    run += ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2", "--job.name", "run"]
    proc = train_in_pool(1, run, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "tensors the model does not train (model.visual.*, mtp.fc.*): left out of the run, carried" in proc.stdout

    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "convert", "to-hf", "--output", str(out)]
    cmd += ["--job.dump_folder", str(tmp_path), "--job.name", "run"]
    done = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["vision_config"]["depth"] == 1
    after = load_file(out / "model.safetensors")
    carried = [k for k in tensors if k.startswith(("model.visual.", "mtp."))]
    assert set(after) == set(tensors) and all(torch.equal(after[k], tensors[k]) for k in carried)
    assert not torch.equal(after["model.language_model.norm.weight"], tensors["model.language_model.norm.weight"])

    ours = model_from_args(folder_args(folder, 32))
    load_model_only(tmp_path / "run" / "step-2", ours)
    back = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)
