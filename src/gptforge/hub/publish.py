"""What `gptforge export` / `import` and training's `checkpoint.push` do: checkpoint <-> HF folder, then git."""

from __future__ import annotations

import tempfile
from pathlib import Path

from gptforge.checkpoint import load_checkpoint, resolve_checkpoint, write_checkpoint
from gptforge.config import Config, lora_spec
from gptforge.errors import GptforgeError
from gptforge.hub.convert import export_hf, import_hf
from gptforge.hub.git import push_folder
from gptforge.hub.peft_export import BASE, export_peft
from gptforge.model.gpt import GPT
from gptforge.outputs import check_output_dir, check_output_file
from gptforge.tokens.chat import added_tokens, chat_template
from gptforge.tokens.fim import FIM_TEXTS
from gptforge.tokens.tokenizer import Tokenizer


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    push: str = "",
    branch: str = "",
    message: str = "",
    force: bool = False,
) -> list[str]:
    """`gptforge export`: a checkpoint (or a run's newest) as an HF folder, optionally committed to `push`
    on `branch` (default: the run folder's name); returns what was done, a line each. An existing non-empty
    `out_dir` is replaced (atomically) only with `force`."""
    check_output_dir(out_dir, force, reads=[resolve_checkpoint(checkpoint)])
    model, tok, _, meta = load_checkpoint(checkpoint)
    out = export_hf(model, tok, out_dir)
    done = [f"wrote {out} (config.json, model.safetensors, tokenizer files)"]
    if push:
        branch = branch or run_name(resolve_checkpoint(checkpoint).resolve())
        try:
            commit = push_folder(out, push, branch, message or f"step {meta['step']}")
        except GptforgeError as e:
            raise GptforgeError(f"wrote {out}, but the push failed: {e}") from None
        done.append(f"pushed {commit[:12]} to {push} branch {branch}")
    return done


def export_adapter(checkpoint: str | Path, out_dir: str | Path, force: bool = False) -> str:
    """`gptforge export --format peft`: a LoRA run's adapters as a PEFT folder, its base model in OUT/base."""
    check_output_dir(out_dir, force, reads=[resolve_checkpoint(checkpoint)])
    model, tok, cfg, _ = load_checkpoint(checkpoint, merge=False)
    spec = lora_spec(cfg.train)
    if spec is None:
        raise GptforgeError(f"--format peft: {checkpoint} trained every weight (train.lora_rank=0): no adapters")
    out = export_peft(model, tok, spec, out_dir)
    return f"wrote {out} (adapter_config.json, adapter_model.safetensors; the base model in {out}/{BASE})"


def run_name(ckpt: Path) -> str:
    """The run folder's name for RUN/checkpoints/step_N (resolved), else the checkpoint folder's own."""
    return ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else ckpt.name


def export_gguf(checkpoint: str | Path, out: str | Path, gguf_type: str = "f32", force: bool = False) -> str:
    """`gptforge export --format gguf`: a checkpoint (or a run's newest) as one GGUF file for llama.cpp, named
    after its run folder; an existing `out` is replaced (atomically) only with `force`."""
    from gptforge.hub.gguf_export import write_gguf

    try:
        import gguf  # noqa: F401
    except ModuleNotFoundError:
        raise GptforgeError("--format gguf needs llama.cpp's writer: pip install 'gptforge[gguf]'") from None
    ckpt = resolve_checkpoint(checkpoint).resolve()
    check_output_file(out, force, reads=[ckpt])
    model, tok, _, meta = load_checkpoint(ckpt)
    path = write_gguf(model, tok, Path(out), gguf_type, run_name(ckpt))
    size = path.stat().st_size / 2**20
    return f"wrote {path} ({gguf_type}, {size:.1f} MiB, step {meta['step']}): run it with llama-cli -m {path}"


def export_and_push(model: GPT, tokenizer: Tokenizer, remote: str, branch: str, message: str) -> str:
    """Export a model as a Hugging Face folder and commit it to `branch` of `remote`; returns the commit."""
    with tempfile.TemporaryDirectory(prefix="gptforge-export-") as tmp:
        return push_folder(export_hf(model, tokenizer, Path(tmp) / "model"), remote, branch, message)


def import_checkpoint(hf_dir: str | Path, out: str | Path, force: bool = False) -> str:
    """`gptforge import`: an HF GPT-2/Llama/Qwen3/Arcee folder as a gptforge checkpoint (no optimizer state,
    step 0); an existing non-empty `out` is replaced (atomically) only with `force`."""
    # --force replaces a checkpoint folder, never a run: a bare checkpoint would take its log and checkpoints' place
    check_output_dir(out, force, reads=[hf_dir])
    model, tok, precision = import_hf(hf_dir)
    meta = {"step": 0, "tokens": 0, "imported_from": str(hf_dir)}
    cfg = Config(model=model.config)
    cfg.train.dtype = precision  # sampling and evaluation compute in it, as transformers would
    cfg.data.chat_template = template.name if (template := chat_template(tok)) else ""  # our chat export, back
    # our FIM export, back: the rate is not exported, StarCoder's stands for it (what counts is that it is not 0)
    cfg.data.fim_rate = 0.5 if FIM_TEXTS[0] in added_tokens(tok).values() else 0.0
    path = write_checkpoint(Path(out), model, None, cfg, tok, meta)
    return f"wrote {path}: {model.num_params():,} parameters, tokenizer {tok.name}"
