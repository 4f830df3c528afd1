"""Benchmark section `mtp`: decode with and without Gemma-4's assistant drafting, in one run.

Per variant (tiny trained target + its trained assistant, the backend of the suite): the drafted
run's checks (tokens equal to the host reference and to transformers' assisted generate), its
acceptance, and decode tok/s with the draft and verify graphs next to the plain decode graph on
the same prompt (eos ignored, so both emit the same number of tokens), then the inf2 ceilings
with drafting computed from the released shapes and the acceptance measured here
(`mtp_roofline`, computed, unverified).

What tiny models can and cannot show: they prove the mechanics (exactness whatever the drafts,
acceptance of a distilled assistant, one verify of k + 1 tokens instead of k + 1 decode steps).
Their speed-up on a CPU says little about inf2: a tiny step is bound by per-call overhead, not by
bandwidth, so k assistant calls cost about as much as k target calls and a verify of k + 1 tokens
about as much as one decode step. On inf2 the ratio of the bytes decides (`break_even_accepted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gemma4lab.inf2.mtp_roofline import STATUS, draft_table
from gemma4lib.models.variants import VARIANTS
from gemma4lib.port import PortSettings, assisted_fields, eos_ids, load_model, prompt_rows, requests_for, run_device
from gemma4lib.reference import reference_greedy

# the one-core member, the dense giant and the MoE: the three the drafter was first checked on
MTP_VARIANTS = tuple(name for name, v in VARIANTS.items() if name in ("e2b", "31b") or v.is_moe)


def bench_mtp(
    variants: Sequence[str] = MTP_VARIANTS,
    *,
    backend: str = "cpu",
    draft_tokens: int = 4,
    warmup: int = 1,
    iters: int = 3,
    new_tokens: int = 32,
) -> dict[str, Any]:
    rows = []
    for name in variants:
        settings = PortSettings(
            variant=name,
            backend=backend,
            draft="assistant",
            draft_tokens=draft_tokens,
            warmup=warmup,
            iters=iters,
            max_new_tokens=new_tokens,
            witness=False,
        )
        model = load_model(settings)
        prompts, eos = prompt_rows(model, settings), eos_ids(model)
        ids = prompts[0].ids
        # the port's own device run: drafted tokens, then drafted vs plain decode timed in turns (`bench_drafted`)
        device = run_device(model, settings, requests_for(prompts, settings, eos))
        run = {
            **device.record_fields(),
            **assisted_fields(model, device, prompts[0], new_tokens, eos),
            "tokens": device.tokens,
            "compile_s": device.compile_s,
        }
        rows.append(
            {
                "variant": name,
                "model_source": model.source,
                "assistant_source": run["assistant_source"],
                "draft_tokens": draft_tokens,
                "tokens_equal_reference": run["tokens"] == reference_greedy(model.lm, ids, new_tokens, eos),
                "hf_assisted_match": run["hf_assisted_match"],
                "accepted_per_step": run["accepted_per_step"],
                "hf_accepted_per_step": run["hf_accepted_per_step"],
                "bench_accepted_per_step": run["bench_accepted_per_step"],
                "decode_tok_s_with_draft": run["decode_tok_s_with_draft"],
                "decode_tok_s_without_draft": run["decode_tok_s_without_draft"],
                "speedup_with_draft": run["speedup_with_draft"],
                "decode_tok_s_runs": run["decode_tok_s_runs"],
                "compile_s": run["compile_s"],
            }
        )
    accepted = {r["variant"]: r["bench_accepted_per_step"] for r in rows}
    return {
        "rows": rows,
        "inf2_computed": draft_table(accepted, draft_tokens),
        "inf2_status": STATUS,
        "note": (__doc__ or "").split("What tiny models can and cannot show: ")[-1].strip(),
    }


__all__ = ["MTP_VARIANTS", "bench_mtp"]
