"""Adapter: model files on disk. Reads a checkpoint's ``config.json`` (and ModelOpt's ``hf_quant_config.json``)
into the pure :class:`runtime.models.spec.ModelSpec`, holds the built-in model catalog (package data), and
converts the demo's SmolLM2 GGUF into a Hugging Face folder. The pure core (``runtime.models``) does no I/O.
"""
