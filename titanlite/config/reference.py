"""The configuration as text: the resolved config as TOML, `--help`, and docs/configuration.md."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Any

from titanlite.config.rules import rule_text
from titanlite.config.sections import (
    DEFAULT_CONFIG,
    HF_DEFAULT_CONFIG,
    JobConfig,
    field_docs,
    field_types,
    section_classes,
    type_name,
)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (every field, so a run folder says exactly what ran)."""
    lines = []
    for section in section_classes():
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def help_text() -> str:
    out = [
        "usage: ./run_train.sh [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        f"  --config FILE   TOML file (default: the checkout's {DEFAULT_CONFIG}, or its {HF_DEFAULT_CONFIG} when",
        "                  the command line sets --model.flavor hf; from any working folder); command-line values",
        "                  override it.",
        "",
    ]
    defaults = JobConfig()
    for section, cls in section_classes().items():
        out.append(f"[{section}]")
        docs, types = field_docs(cls), field_types(cls)
        for name, tp in types.items():
            default = _toml_value(getattr(getattr(defaults, section), name))
            out.append(f"  --{section}.{name}  ({type_name(tp)}, default {default})")
            text = " ".join(t for t in (docs.get(name, ""), rule_text(f"{section}.{name}")) if t)
            out.append(textwrap.fill(text, width=100, initial_indent="      ", subsequent_indent="      "))
        out.append("")
    return "\n".join(out)


def reference_markdown() -> str:
    """docs/configuration.md: every key with its type, default and meaning, from the dataclasses above
    (`titanlite help --markdown`; tests/unit/test_docs.py keeps the file equal to it)."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from titanlite/config/sections.py by `.venv/bin/titanlite help --markdown > "
        "docs/configuration.md`;",
        "     do not edit by hand: tests/unit/test_docs.py fails when this file and the code differ. -->",
        "",
        "Every key is set in a TOML file (`[section]`, then `key = value`; `--config FILE`, default the checkout's",
        f"`{DEFAULT_CONFIG}`, or its `{HF_DEFAULT_CONFIG}` when the command line sets `--model.flavor hf`, from any",
        "working folder) or on the command line (`--section.key VALUE`, which wins over the file).",
        "Unknown keys and wrong types stop the run with one line naming the key, and so do a number outside its",
        "*Bounds* and a key set while the feature it *Applies only* with is off (titanlite/config/rules.py;",
        "[Configuring a run](configuration-guide.md#what-is-checked-before-launch)). The defaults below are",
        "`titanlite/config/sections.py`'s; the shipped configs in `train_configs/` override some of them (the default "
        "file sets",
        '`job.name = "debug_model"` and `optimizer.lr = 3e-3`, for example).',
        "",
    ]
    defaults = JobConfig()
    for section, cls in section_classes().items():
        out += [
            f"## `[{section}]`",
            "",
            inspect.getdoc(cls) or "",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        docs, types = field_docs(cls), field_types(cls)
        for name, tp in types.items():
            default = _toml_value(getattr(getattr(defaults, section), name))
            meaning = " ".join(f"{docs.get(name, '')} {rule_text(f'{section}.{name}')}".split())
            cells = [f"`{section}.{name}`", type_name(tp), f"`{default}`", meaning]
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        out.append("")
    return "\n".join(out)
