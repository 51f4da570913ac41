"""The budget a decode worker gives a chat request that names none, read from the served model's files (adapter).

vLLM 0.28 gives a chat request without `max_tokens` / `max_completion_tokens` the context left after its
prompt, capped by the model's default: `max_new_tokens` of its generation config (vllm/config/model.py
`get_diff_sampling_param` maps it to the default `max_tokens`; vllm/entrypoints/serve/utils/api_utils.py
`get_max_tokens` takes the least of the two). Each request gets it whole, so a continuation of a stream cut
mid-answer (runtime.server.migration.continuation_body) must ask for what is left of it, else it answers with
up to that many tokens again. A completions request always names a budget: vLLM sets an absent or null
`max_tokens` to 16 (`CompletionRequest.normalize_null_max_tokens`) before the default could apply.

With vLLM's default `--generation-config auto` the generation config is the model folder's
generation_config.json (transformers `GenerationConfig.from_pretrained`), or, where the folder has none, the
generation fields of its config.json (`GenerationConfig.from_model_config`). A worker started with a flag that
takes it from elsewhere or overrides it (`GENERATION_FLAGS`) has a default the runtime does not know.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: vLLM 0.28 flags that take the generation config from elsewhere than the model folder, or change it:
#: `--generation-config` (vllm: none; a folder), `--override-generation-config` (a `max_new_tokens` there also
#: caps a request that names its budget), `--hf-config-path` (another config.json), `--config` (a YAML file
#: that may hold any of them).
GENERATION_FLAGS = ("--generation-config", "--override-generation-config", "--hf-config-path", "--config")

# where transformers' from_model_config looks for generation fields a model config holds in a sub-config
_SUB_CONFIGS = ("decoder", "generator", "text_config")


def names_generation_flag(worker_args: Iterable[str]) -> bool:
    """Whether vLLM CLI arguments `worker_args` (EngineSpec.extra_args) set one of `GENERATION_FLAGS`: the
    flag, with underscores for dashes (vLLM reads both), an abbreviation of it (argparse takes any unambiguous
    prefix), or one of its keys (vLLM's `--flag.key value`). Pure."""
    for arg in worker_args:
        if not isinstance(arg, str) or not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0].replace("_", "-")
        for flag in GENERATION_FLAGS:
            if name.startswith(flag + ".") or (len(name) > 2 and flag.startswith(name)):
                return True
    return False


def chat_default_max_tokens(model_dir: Path | None, worker_args: Iterable[str] = ()) -> int | None:
    """The `max_tokens` vLLM 0.28 workers that serve `model_dir` with vLLM CLI arguments `worker_args` give a
    chat request that names none, besides the context left after its prompt: the model's generation config
    `max_new_tokens`. None where they give the context left (no `max_new_tokens`), and where it is not known
    here: no `model_dir`, arguments that name one of `GENERATION_FLAGS`, a file that cannot be read as a JSON
    object or a `max_new_tokens` that is not a whole number > 0 (logged). Read once, at start-up."""
    if model_dir is None:
        return None
    if names_generation_flag(worker_args):
        logger.info("the workers' arguments name one of %s: a chat continuation without a budget gets the "
                    "worker's default again", ", ".join(GENERATION_FLAGS))
        return None
    folder = Path(model_dir)
    gen_path = folder / "generation_config.json"
    # vLLM reads config.json only where the folder has no generation_config.json
    path = gen_path if gen_path.is_file() else folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        logger.warning("%s cannot be read (%s): a chat continuation without a budget gets the worker's default "
                       "again", path, exc)
        return None
    if not isinstance(config, dict):
        logger.warning("%s is not a JSON object: a chat continuation without a budget gets the worker's default "
                       "again", path)
        return None
    value = config.get("max_new_tokens")
    if value is None and path != gen_path:
        for key in _SUB_CONFIGS:
            if isinstance(config.get(key), dict):
                value = config[key].get("max_new_tokens")
                break
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        logger.warning("%s: max_new_tokens %r is not a whole number > 0: a chat continuation without a budget "
                       "gets the worker's default again", path, value)
        return None
    return value
