"""Helpers for the cookbook notebooks: each turns one stage of the port into something to look at.

The notebooks call the port's stages themselves (`gemma4lib.port`); what lives here is what a
notebook shows between them, one idea per module:

- `display`: `Table` (HTML in Jupyter, aligned text in logs) and the tables of settings, prompts,
  graphs, compile results, the three checks side by side, benchmarks and records;
- `family`: facts about the released variants, computed from their configs;
- `architecture`: what makes a variant different (PLE, KV producers, k_eq_v, attention forms, the
  MoE block and its expert forms);
- `tensor_parallel`: the TP plan, KV heads per rank, the CPU ranks' runs side by side;
- `vision`: "What the model sees": the image, its patches and soft tokens, where they sit in the
  prompt, and the prefill masks over them;
- `witness`: prompts that pass SEQ_MATCH on nonsense, and the random-weights witness;
- `speed`: the measured decode against its ceiling;
- `serving`: 06_serving's tables (a batch's rows, the batch and drafting ceilings, the CPU sweep) and
  07_serve's (the endpoint under N concurrent clients);
- `status`: the status box at the top of each variant notebook (what ran, what never ran, sources);
- `records`: the notebook's run record and the records the variant notebooks wrote;
- `formatting`: figures, shapes and tokens written as people write them; `plots`: the figures
  (`plots_batch`: tok/s against B; `plots_draft`: drafts accepted per verify step; `plots_serve`:
  the endpoint's latency and throughput against concurrent clients);
- `long_context`: the graphs each engine call ran and a conversation's turns side by side (01_e2b §7b);
- `chat`: the optional chat box.

`from gemma4lab import notebook as nb` gives all of them under one name, as the notebooks use it.
"""

from gemma4lab.notebook.architecture import (
    attention_implementations_agree,
    describe_model,
    expert_forms_on_a_token,
    k_eq_v_report,
    kv_sharing_report,
    moe_report,
    ple_report,
)
from gemma4lab.notebook.audio import audio_demo, clip_table, sound_picture
from gemma4lab.notebook.chat import chat
from gemma4lab.notebook.display import (
    Table,
    answer_text,
    bench_table,
    describe_compile,
    describe_graphs,
    record_summary,
    results_table,
    show_prompt,
    show_settings,
    side_by_side,
    until_stop,
    witness_table,
)
from gemma4lab.notebook.family import (
    context_plan,
    device_bytes,
    effective_size,
    family_table,
    kv_cache_bytes,
    kv_sharing_real,
    memory_rows,
    real_config,
    real_layout,
    recipe_table,
    tp_fit,
)
from gemma4lab.notebook.formatting import format_number, readable_tokens, token_labels, with_unit
from gemma4lab.notebook.long_context import StepLog, turns_table
from gemma4lab.notebook.records import load_results, record, save_record, tensor_digest
from gemma4lab.notebook.serving import (
    batch_ceilings_table,
    batch_rows_table,
    batch_sweep_table,
    draft_effect_table,
    load_levels_table,
)
from gemma4lab.notebook.speed import measured_vs_ceiling
from gemma4lab.notebook.status import StatusBox, bandwidth_text, status_box
from gemma4lab.notebook.tensor_parallel import (
    kv_heads_under_tp,
    rank_module_table,
    sharded_attention_by_hand,
    tp_cpu_run,
    tp_demo,
    tp_plan,
    tp_runs_table,
)
from gemma4lab.notebook.vision import image_demo, layout_table, mask_picture, patch_picture, reference_masks, show_image
from gemma4lab.notebook.witness import equality_is_not_enough, gemma3_style_ids, run_witness

__all__ = [
    "StatusBox",
    "StepLog",
    "Table",
    "answer_text",
    "attention_implementations_agree",
    "audio_demo",
    "bandwidth_text",
    "batch_ceilings_table",
    "batch_rows_table",
    "batch_sweep_table",
    "bench_table",
    "clip_table",
    "chat",
    "describe_compile",
    "describe_graphs",
    "describe_model",
    "draft_effect_table",
    "device_bytes",
    "effective_size",
    "equality_is_not_enough",
    "expert_forms_on_a_token",
    "family_table",
    "format_number",
    "gemma3_style_ids",
    "image_demo",
    "k_eq_v_report",
    "kv_cache_bytes",
    "kv_heads_under_tp",
    "rank_module_table",
    "sharded_attention_by_hand",
    "kv_sharing_real",
    "kv_sharing_report",
    "layout_table",
    "load_levels_table",
    "load_results",
    "mask_picture",
    "measured_vs_ceiling",
    "memory_rows",
    "moe_report",
    "patch_picture",
    "ple_report",
    "readable_tokens",
    "real_config",
    "real_layout",
    "recipe_table",
    "record",
    "reference_masks",
    "record_summary",
    "results_table",
    "run_witness",
    "save_record",
    "tensor_digest",
    "turns_table",
    "show_image",
    "show_prompt",
    "show_settings",
    "side_by_side",
    "sound_picture",
    "status_box",
    "token_labels",
    "tp_cpu_run",
    "tp_demo",
    "tp_fit",
    "context_plan",
    "tp_plan",
    "tp_runs_table",
    "until_stop",
    "with_unit",
    "witness_table",
]
